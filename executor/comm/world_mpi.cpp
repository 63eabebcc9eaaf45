// The job's world where the build has MPI (communicator.h WorldRuntime; CMake compiles this file
// or world_self.cpp, never both): MPI started for main()'s scope, world communicators over MPI.
// A rank started without mpirun is MPI's singleton, a job of one rank, as before this file.
#include <memory>

#include "peftplan/executor/communicator.h"

namespace peftplan::executor {

struct WorldRuntime::Impl {
  MpiRuntime mpi;
};

WorldRuntime::WorldRuntime(int* argc, char*** argv) : impl_(new Impl{MpiRuntime(argc, argv)}) {}
WorldRuntime::~WorldRuntime() = default;

int WorldRuntime::rank() const { return impl_->mpi.world_rank(); }
int WorldRuntime::size() const { return impl_->mpi.world_size(); }
std::string_view WorldRuntime::kind() const { return "mpi"; }
std::unique_ptr<Communicator> WorldRuntime::make_world_communicator() const { return make_mpi_communicator(); }
void WorldRuntime::abort(int code) const { impl_->mpi.abort(code); }

}  // namespace peftplan::executor
