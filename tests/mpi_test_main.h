// main() for GoogleTest programs that run under mpirun (test_comm, test_distributed): every rank
// runs every test against one world communicator; only rank 0 prints the usual report, other
// ranks print their own failures tagged with their rank, and the exit code is the worst rank's.
#pragma once

#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <utility>

#include <gtest/gtest.h>

#include "comm_world.h"
#include "peftplan/executor/communicator.h"

namespace peftplan::testing {

class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (r.failed())
      std::fprintf(stderr, "[rank %d] %s:%d: %s\n", rank_, r.file_name() ? r.file_name() : "?", r.line_number(),
                   r.summary());
  }

 private:
  int rank_;
};

// `wrap`, when given, makes the communicator the tests run on from MPI's (test_comm_staged).
inline int run_mpi_tests(int argc, char** argv,
                         const std::function<std::unique_ptr<executor::Communicator>(std::unique_ptr<executor::Communicator>)>& wrap = {}) {
  ::testing::InitGoogleTest(&argc, argv);
  executor::MpiRuntime mpi(&argc, &argv);
  if (mpi.world_rank() != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new RankFailurePrinter(mpi.world_rank()));
  }
  int result = 0;
  {
    std::unique_ptr<executor::Communicator> comm = executor::make_mpi_communicator();
    if (wrap) comm = wrap(std::move(comm));
    g_world = comm.get();
    result = RUN_ALL_TESTS();
    std::int32_t worst = result;
    comm->all_reduce(&worst, &worst, 1, executor::CommDType::int32, executor::ReduceOp::max);
    result = worst;
    g_world = nullptr;
  }
  return result;
}

}  // namespace peftplan::testing
