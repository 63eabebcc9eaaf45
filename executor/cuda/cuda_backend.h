// The CUDA backend's factory, private to the executor library. CMake compiles cuda_backend.cpp
// and cuda_kernels.cu where the CUDA toolkit is found and cuda_absent.cpp elsewhere, so no shared code has an #if:
// backends.cpp asks cuda_backend_built() whether to list "cuda", and the backend-ops test asks
// backend_unavailable() whether this machine has a device to run it on.
#pragma once

#include <memory>
#include <string>

#include "peftplan/executor/backend.h"

namespace peftplan::executor {

// Whether this build compiled the CUDA backend.
bool cuda_backend_built();
// Empty when a CUDA device can be used; otherwise why not ("no CUDA device: ...", "this build has
// no CUDA backend").
std::string cuda_backend_unavailable();
// The backend on the current CUDA device; an InputError naming the reason when there is none.
std::unique_ptr<Backend> make_cuda_backend();

}  // namespace peftplan::executor
