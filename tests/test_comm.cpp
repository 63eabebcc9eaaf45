// The MPI Communicator: the cases of comm_cases.cpp under mpirun with 2, 3 and 4 ranks (ctest
// label `mpi`). run_mpi_tests() initialises MPI; only rank 0 prints the usual output, other ranks
// print their failures with their rank, and every rank exits with the worst result of all.
#include <chrono>
#include <cmath>
#include <vector>

#include <gtest/gtest.h>

#include "comm_world.h"
#include "mpi_test_main.h"

namespace {

using namespace peftplan::executor;
using peftplan::testing::Comm;  // the shared cases' fixture (comm_world.h)

// MPI only (one rank's collectives have no peer to wait for, nothing to overlap): the collective
// progresses on the communication thread while this thread computes and never
// calls wait(): done() turns true during the compute loop.
TEST_F(Comm, AsyncAllReduceOverlapsCompute) {
  Communicator& c = *peftplan::testing::g_world;
  const int n = c.size();
  ASSERT_GE(n, 2) << "run under mpirun -np 2 or more: one rank's all_reduce waits for no peer";
  const std::size_t count = 4u << 20;  // 16 MiB of fp32: milliseconds even on shared memory
  std::vector<float> grad(count, 1.0f);
  auto req = c.all_reduce_async(grad.data(), grad.data(), count, CommDType::fp32, ReduceOp::sum);
  std::vector<double> work(4096, 1.0);
  long chunks_before_done = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!req->done() && std::chrono::steady_clock::now() < deadline) {
    for (auto& w : work) w = std::sqrt(w * 1.0000001 + 1e-9);  // "backward compute"
    ++chunks_before_done;
  }
  EXPECT_TRUE(req->done()) << "the all_reduce did not complete while the caller computed";
  EXPECT_GT(chunks_before_done, 0) << "the all_reduce finished before the caller computed";
  req->wait();
  EXPECT_EQ(grad.front(), static_cast<float>(n));
  EXPECT_EQ(grad.back(), static_cast<float>(n));
  EXPECT_GT(work[0], 0.0);
}

}  // namespace

int main(int argc, char** argv) { return peftplan::testing::run_mpi_tests(argc, argv); }
