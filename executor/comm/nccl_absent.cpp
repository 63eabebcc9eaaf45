// The NCCL communicator's stand-in where the build has no CUDA toolkit or no NCCL (CMake compiles
// this file or nccl_communicator.cpp, never both): its factory refuses, naming why.
#include <memory>
#include <string>

#include <fmt/format.h>

#include "peftplan/common/error.h"
#include "peftplan/executor/communicator.h"

namespace peftplan::executor {

std::string nccl_communicator_unavailable() {
  return "this build has no NCCL communicator (it needs the CUDA toolkit and NCCL where it is built)";
}

std::unique_ptr<Communicator> make_nccl_communicator(std::unique_ptr<Communicator>, void*) {
  throw InputError(fmt::format("the NCCL communicator: {}", nccl_communicator_unavailable()));
}

}  // namespace peftplan::executor
