// The host-staging communicator (communicator.h make_staging_communicator) over MPI's, run with 2
// and 3 ranks: the cases every communicator passes (comm_cases.cpp), each buffer moved through
// host memory with the CPU backend's copies, as two ranks sharing one GPU move theirs with the
// CUDA backend's. In-place layouts, counters, split, the progress board and MPI's refusals must
// all come through the wrapper unchanged.
#include <memory>
#include <utility>

#include <gtest/gtest.h>

#include "comm_world.h"
#include "mpi_test_main.h"
#include "peftplan/executor/backend.h"
#include "peftplan/executor/communicator.h"

namespace {

using namespace peftplan::executor;
using peftplan::testing::Comm;

TEST_F(Comm, StagedNamesItsHostCommunicator) {
  EXPECT_EQ(peftplan::testing::g_world->backend(), "mpi+staging");
}

}  // namespace

int main(int argc, char** argv) {
  static std::unique_ptr<Backend> cpu = make_backend("cpu", 1);
  return peftplan::testing::run_mpi_tests(argc, argv, [](std::unique_ptr<Communicator> mpi) {
    return make_staging_communicator(std::move(mpi), *cpu);
  });
}
