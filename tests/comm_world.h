// The communicator a test program's cases run on (comm_cases.cpp, test_distributed.cpp), set by
// the program's main: run_mpi_tests() (mpi_test_main.h) under mpirun, test_comm_self.cpp's on one
// rank. Null outside RUN_ALL_TESTS.
#pragma once

#include "peftplan/executor/communicator.h"

namespace peftplan::testing {

inline executor::Communicator* g_world = nullptr;

}  // namespace peftplan::testing
