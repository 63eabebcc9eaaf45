// The job's world where the build has no MPI (communicator.h WorldRuntime; CMake compiles this
// file or world_mpi.cpp, never both): one rank, its collectives on the one-rank communicator.
// A launch as one of several ranks (mpirun -np 2 of this build) is refused rather than run as
// several unrelated one-rank jobs writing the same files.
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include <fmt/format.h>

#include "peftplan/executor/communicator.h"

namespace peftplan::executor {

struct WorldRuntime::Impl {};

WorldRuntime::WorldRuntime(int*, char***) : impl_(std::make_unique<Impl>()) {
  // What Open MPI's and MPICH/Hydra's launchers tell each rank the job's size is.
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE"}) {
    const char* v = std::getenv(var);
    if (v != nullptr && std::atoi(v) > 1)
      throw CommError(fmt::format("{}={}: this build has no MPI, so it runs one rank only (rebuild where MPI is found "
                                  "for several)", var, v));
  }
}
WorldRuntime::~WorldRuntime() = default;

int WorldRuntime::rank() const { return 0; }
int WorldRuntime::size() const { return 1; }
std::string_view WorldRuntime::kind() const { return "self"; }
std::unique_ptr<Communicator> WorldRuntime::make_world_communicator() const { return make_self_communicator(); }

void WorldRuntime::abort(int code) const {
  // As MPI_Abort ends a job: now, without destructors (a communicator's would wait for work a
  // failed rank left behind); what the process printed is flushed first.
  std::fflush(stdout);
  std::fflush(stderr);
  std::_Exit(code);
}

}  // namespace peftplan::executor
