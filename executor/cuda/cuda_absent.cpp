// The CUDA backend's factory in a build without the CUDA toolkit (see cuda_backend.h).
#include "cuda_backend.h"

#include "peftplan/common/error.h"

namespace peftplan::executor {

bool cuda_backend_built() { return false; }

std::string cuda_backend_unavailable() {
  return "this build has no CUDA backend (configured without the CUDA toolkit, or with PEFTPLAN_WITH_CUDA=OFF)";
}

std::unique_ptr<Backend> make_cuda_backend() { throw InputError("backend cuda: " + cuda_backend_unavailable()); }

}  // namespace peftplan::executor
