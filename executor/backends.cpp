// The backends this build has (backend.h: backend_names, make_backend): the one list a new
// backend joins, so that the backend-ops test and peftplan-exec see it.
// Deliberately not here: choosing a backend for a run (peftplan-exec's options do that).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "peftplan/common/error.h"
#include "peftplan/executor/backend.h"

namespace peftplan::executor {

std::vector<std::string> backend_names() { return {"cpu"}; }

std::unique_ptr<Backend> make_backend(std::string_view name, int threads) {
  if (name == "cpu") return make_cpu_backend(threads);
  throw InputError(fmt::format("backend {}: this build has {}", name, fmt::join(backend_names(), ", ")));
}

}  // namespace peftplan::executor
