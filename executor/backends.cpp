// The backends this build has (backend.h: backend_names, make_backend): the one list a new
// backend joins, so that the backend-ops test and peftplan-exec see it.
// Deliberately not here: choosing a backend for a run (peftplan-exec's options do that).
#include <omp.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "cuda/cuda_backend.h"
#include "peftplan/common/error.h"
#include "peftplan/executor/backend.h"

namespace peftplan::executor {

std::vector<std::string> backend_names() {
  std::vector<std::string> names = {"cpu"};
  if (cuda_backend_built()) names.emplace_back("cuda");
  return names;
}

std::string backend_unavailable(std::string_view name) {
  if (name == "cpu") return {};
  if (name == "cuda") return cuda_backend_unavailable();
  return fmt::format("this build has {}", fmt::join(backend_names(), ", "));
}

std::unique_ptr<Backend> make_backend(std::string_view name, int threads) {
  if (name == "cpu") return make_cpu_backend(threads);
  if (name == "cuda" && cuda_backend_built()) {
    // The host's share of a device run (an offloaded optimizer's AdamW, runner.cpp) is OpenMP
    // code too: the rank keeps to its threads, as the CPU backend's kernels do.
    if (threads > 0) omp_set_num_threads(threads);
    return make_cuda_backend();
  }
  throw InputError(fmt::format("backend {}: this build has {}", name, fmt::join(backend_names(), ", ")));
}

}  // namespace peftplan::executor
