// The MPI Communicator: the cases of comm_cases.cpp under mpirun with 2, 3 and 4 ranks (ctest
// label `mpi`). run_mpi_tests() initialises MPI; only rank 0 prints the usual output, other ranks
// print their failures with their rank, and every rank exits with the worst result of all.
#include "mpi_test_main.h"

int main(int argc, char** argv) { return peftplan::testing::run_mpi_tests(argc, argv); }
