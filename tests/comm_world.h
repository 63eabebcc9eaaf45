// The communicator a test program's cases run on (comm_cases.cpp, test_distributed.cpp), set by
// the program's main: run_mpi_tests() (mpi_test_main.h) under mpirun, test_comm_self.cpp's on one
// rank. Null outside RUN_ALL_TESTS.
#pragma once

#include <functional>
#include <string>

#include <gtest/gtest.h>

#include "peftplan/executor/communicator.h"

namespace peftplan::testing {

inline executor::Communicator* g_world = nullptr;
// A program whose communicator is made when the first case runs (test_comm_nccl.cpp: not while
// ctest only lists the cases): it returns the communicator, or null with the reason in
// g_world_missing, and each case then skips with it.
inline std::function<executor::Communicator*()> g_world_maker;
inline std::string g_world_missing;

// The shared cases' fixture (comm_cases.cpp, and a program's own cases in the same suite).
class Comm : public ::testing::Test {
 protected:
  void SetUp() override {
    if (g_world == nullptr && g_world_maker) g_world = g_world_maker();
    if (g_world == nullptr) GTEST_SKIP() << g_world_missing;
  }
};

}  // namespace peftplan::testing
