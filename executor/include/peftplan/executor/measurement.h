// What a run measured, and its JSON (measurement.json, "schema": "peftplan.measurement/1"):
// losses and gradient norms per step, step times, memory per category with the same keys as
// `peftplan plan --json` (memory.device.<category>_bytes, memory.device.peak_bytes,
// memory.device.peak_op, memory.host.*), time per (phase, kernel, label), op_s (mean seconds per
// step of every program op over the steady steps, planner::steady_samples), and a Chrome trace
// of the last step.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "peftplan/executor/allocator.h"

namespace peftplan::executor {

// Time of the ops that share (phase, kernel, label), summed over the measured steps.
struct OpTime {
  std::string phase;    // "forward", "backward", ...
  std::string kernel;   // sim::name_of(Kernel)
  std::string label;    // "q_proj", "attention_eager", ...
  std::int64_t calls = 0;
  double total_s = 0.0;
  double flops = 0.0;   // the program's FLOPs of these calls
};

// One collective kind over the measured steps: what the communicator counted (nccl-tests sizes)
// and what the step program says one step moves.
struct CollectiveStat {
  std::string kind;                          // "all_reduce", "reduce_scatter", ...
  std::uint64_t calls = 0, bytes = 0;        // measured, all steps of this session
  double seconds = 0.0;                      // measured time executing
  std::uint64_t bytes_per_step = 0;          // measured bytes / steps
  std::uint64_t predicted_calls_per_step = 0, predicted_bytes_per_step = 0;  // the program's
};

struct Measurement {
  std::string backend;                  // Backend::description()
  std::int32_t ranks = 1;               // N
  std::int32_t rank = 0;                // the rank that measured this
  std::int64_t tokens_per_step = 0;     // all ranks
  double model_flops_per_step = 0.0;    // this rank's useful FLOPs (program, no recompute)
  std::vector<double> losses;           // mean over the step's G·S target tokens
  std::vector<double> grad_norms;       // global 2-norm before clipping
  std::int64_t skipped_steps = 0;       // steps whose update was skipped: a non-finite gradient
                                        //   norm under run.on_nonfinite "skip"
  std::vector<double> lrs;              // learning rate of each step
  std::vector<double> step_times_s;     // wall time of each step (setup excluded)
  double gemm_s = 0.0;                  // time in GEMM ops (linear, LoRA, attention), all steps
  double gemm_flops = 0.0;              // their FLOPs, all steps
  MemoryStats memory;                   // the tracked allocator at the end
  std::uint64_t untracked_gemm_scratch_bytes = 0;  // the largest GEMM library scratch of the
                                        // step (outside the tracked allocator; an estimate)
  // The backend's other memory kinds at the end of the run (Backend::device_memory_kinds; all 0
  // on the CPU backend): memory.device.reserved_peak_bytes, in_use_bytes, total_bytes.
  std::uint64_t device_reserved_peak_bytes = 0, device_in_use_bytes = 0, device_total_bytes = 0;
  std::string device_peak_op;           // "alloc <buffer>" as plan --json names it
  std::string host_peak_op;
  std::vector<OpTime> op_times;
  std::vector<double> op_s;             // by program op index: mean seconds per step over the
                                        //   steady steps (planner::steady_samples: the fastest
                                        //   quarter of the last 32 after the first); compute
                                        //   ops and copies as the rank timed them, collectives
                                        //   their execution on the communication thread
                                        //   (library call start to end, queueing excluded);
                                        //   0 for alloc/free and ops not run
  std::int64_t op_s_steps = 0;          // steps op_s averages over (0: op_s is all zeros)
  double exposed_comm_s = 0.0;          // mean over op_s's steps: time the rank's compute
                                        //   thread stood waiting for collectives
  std::vector<std::int32_t> collective_ops;  // program op index of each collective of a step
  std::vector<std::vector<double>> collective_op_s_by_step;  // [step][collective]: execution
                                        //   seconds on the communication thread, the last (up to
                                        //   32) steps after the first
  // Rank 0 of several, from every rank's collective_op_s_by_step: per collective op, the mean
  // over the recorded steps after the first (not only op_s's steady step: one step's call time
  // on shared cores is too noisy; run.cpp, split_collective_time) of the shortest rank's
  // execution — the rank that arrived last waits for nobody, so its call is the transfer — and of
  // the mean over ranks of the rest: waiting for the last rank to arrive (skew; calibrate
  // measures it, the timeline predicts it).
  std::vector<double> collective_transfer_s;  // aligned with collective_ops; empty otherwise
  std::vector<double> collective_wait_s;      // aligned with collective_ops: per step, the mean
                                        //   over ranks of (its call - the shortest rank's
                                        //   call), the mean over those steps
  double sync_wait_s = 0.0;             // per step: collective_wait_s summed over collective ops
  double speed_probe_flops_per_s = 0.0; // run_plan: speed_probe (calibrate.h) just before the
                                        //   steps, every rank at once; 0 = not taken
  std::optional<double> others_cpu_share;  // run_plan: other work's share of the host's CPUs
                                        //   over the steps (host_load.h); nullopt = not known
  nlohmann::json trace;                 // Chrome trace of the last step ("traceEvents")
  std::vector<CollectiveStat> collectives;  // per kind, NCCL's order
  nlohmann::json per_rank;              // rank 0 of several: every rank's measurement (memory,
                                        //   op times, collectives), null otherwise
};

nlohmann::json measurement_to_json(const Measurement& m);

}  // namespace peftplan::executor
