// What every Communicator shares, whichever implementations the build has: the names counters and
// traces give element types and operation kinds (communicator.h). The implementations live beside
// this file (mpi_communicator.cpp, self_communicator.cpp); nothing here talks to a library.
#include "peftplan/executor/communicator.h"

namespace peftplan::executor {

std::string_view name_of(CommDType t) {
  switch (t) {
    case CommDType::fp32: return "fp32";
    case CommDType::fp64: return "fp64";
    case CommDType::fp16: return "fp16";
    case CommDType::bf16: return "bf16";
    case CommDType::int32: return "int32";
    case CommDType::int64: return "int64";
    case CommDType::uint8: return "uint8";
  }
  return "?";
}

std::string_view name_of(CommKind k) {
  switch (k) {
    case CommKind::all_reduce: return "all_reduce";
    case CommKind::reduce_scatter: return "reduce_scatter";
    case CommKind::all_gather: return "all_gather";
    case CommKind::broadcast: return "broadcast";
    case CommKind::barrier: return "barrier";
  }
  return "?";
}

}  // namespace peftplan::executor
