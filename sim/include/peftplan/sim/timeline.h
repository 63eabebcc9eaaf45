// The timeline interpreter: cost every op of a step program on a cluster and schedule the ops on
// their streams, to get the step time and where it goes (compute, communication and how much of
// it is exposed, optimizer, offload), throughput and MFU.
// Scheduling: each stream (compute, comm, copy, host) runs its ops in program order, like a CUDA
// stream; an op starts when its stream is free and all its explicit dependencies have ended.
// alloc/free take no time (they are stamped when their stream reaches them), and setup-phase
// ops take no time and sit at t = 0. One rank is simulated (the program is SPMD).
// This is the hot path of search and the GUI: one pass over the ops, no allocation per op.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <vector>

#include "peftplan/common/dtype.h"
#include "peftplan/sim/cluster.h"
#include "peftplan/sim/collectives.h"
#include "peftplan/sim/program.h"

namespace peftplan::sim {

struct SimOptions {
  DType compute_dtype = DType::bf16;  // precision of the GEMMs: picks the peak FLOP/s
  bool allow_tf32 = false;            // fp32 GEMMs on TF32 tensor cores
  CollectiveAlgorithm algorithm = CollectiveAlgorithm::automatic;
  // Fraction of the roofline's rates the device's compute kernels sustain over a step: each
  // device compute op takes (roofline time) / sustained, plus its launch. Collectives, copies
  // and host ops are not scaled (they have their own measured efficiencies).
  double sustained = 1.0;
  // The host's own time per step, which the GPU cannot hide (a runtime's Python hooks that wait
  // for the device): the step takes at least this long (0: none).
  double host_floor_s = 0.0;
};

struct OpTime {
  double start_s = 0.0;  // from the start of the step
  double end_s = 0.0;
  double wait_s = 0.0;   // collectives: the part of [start, end) spent waiting for the last rank
                         //   to arrive (HostCalibration::collective_skew_s); the transfer is
                         //   the rest. 0 for every other op
};

struct Timeline {
  std::vector<OpTime> ops;              // one per program op, same index
  double step_s = 0.0;                  // end of the last op
  std::array<double, kNumStreams> busy_s{};  // total op duration on each stream
  double compute_s = 0.0;       // busy time of the compute stream from compute ops
  double comm_s = 0.0;          // total transfer time of collective ops (normally the comm
                                //   stream), their arrival waits excluded
  double sync_wait_s = 0.0;     // total time collectives wait for the last rank to arrive (the
                                //   calibrated skew per call; 0 on uncalibrated clusters)
  double exposed_comm_s = 0.0;  // time during which a collective runs (or waits for a peer)
                                //   and no compute op does:
                                //   |union(collective intervals) \ union(compute-op intervals
                                //   on the compute stream)|; 0 when communication is fully
                                //   hidden behind compute, comm_s when none of it is
  double optimizer_s = 0.0;     // duration of optimizer-phase compute ops (device or host)
  double offload_s = 0.0;       // busy time of the copy stream plus the host stream
  double host_floor_s = 0.0;    // SimOptions::host_floor_s
  double device_step_s = 0.0;   // the ops' critical path (step_s before the host floor)
  bool host_bound = false;      // the host floor, not the device, sets step_s
  double tokens_per_s = 0.0;    // program.tokens_per_step × program.ranks / step_s
  double mfu = 0.0;             // program.model_flops_per_step / (step_s × peak_flops_per_s)
  double peak_flops_per_s = 0.0;  // the per-GPU peak MFU is measured against
  std::array<std::uint64_t, kNumCollectives> collective_bytes{};  // sum of Op::bytes (nccl-tests
                                                                  //   size) per kind, this rank
  std::array<std::int32_t, kNumCollectives> collective_count{};   // collectives per kind
  std::uint64_t intra_node_bytes = 0;   // bytes this rank sends on intra-node links per step
  std::uint64_t inter_node_bytes = 0;   // bytes this rank sends on the network per step
  std::uint64_t device_to_host_bytes = 0;  // copied per step
  std::uint64_t host_to_device_bytes = 0;
};

// Throws InputError when the program needs more ranks than the cluster has GPUs.
Timeline simulate(const Program& program, const Cluster& cluster, const SimOptions& options = {});

// Where a collective runs for HostCalibration's load and skew: among the layers' compute
// (forward, backward, recompute, loss) or in the optimizer phase.
constexpr CollectivePlace collective_place(Phase phase) {
  return phase == Phase::optimizer || phase == Phase::setup ? CollectivePlace::optimizer : CollectivePlace::compute;
}

// For each collective op of the program, the compute around it, from `compute_s` (seconds per op
// index; only compute-stream compute ops outside setup are read; other ops get 0):
//   overlapped: the compute-stream ops after it in program order up to (not including) the
//     first op that depends on it (to the end of the step when none does) — what the rank
//     computes while the collective is pending;
//   since_previous: the compute-stream ops since the previous collective in program order (the
//     step repeats: the first collective counts from the step's last one) — how long the ranks
//     ran apart before meeting in it.
// The one rule for HostCalibration's per-compute load (overlapped) and skew (since_previous),
// used by simulate() on costed ops and by calibrate on measured ones.
struct CollectiveCompute {
  std::vector<double> overlapped;
  std::vector<double> since_previous;
};
CollectiveCompute collective_compute_s(const Program& program, std::span<const double> compute_s);

// Duration of one op on the cluster as simulate() costs it (0 for alloc/free and setup ops; a
// collective's arrival wait included, without the parts that grow with the compute since the
// previous collective, which only simulate() knows). `program`: the op's program's compute dtype.
double op_duration_s(const Op& op, const Cluster& cluster, const SimOptions& options = {}, DType program = DType::fp32);

}  // namespace peftplan::sim
