// The program runner: the executor's interpreter of the planner's step program
// (planner::build_program with RuntimeProfile::executor). For each op in program order:
//   alloc      -> a real allocation of exactly Buffer::bytes through the tracked allocator, under
//                 Buffer::category (a micro-batch's token buffer is filled by the data loader);
//   free       -> its release;
//   compute    -> one Backend call, dispatched on Op::kernel, with the buffers Op::args names
//                 (conventions in planner/program.cpp) and the dimensions of the model;
//   collective -> the Communicator (one rank: nothing to exchange, skipped);
//   copy       -> a copy on the backend's copy queue, after the kernels issued before it (the
//                 executor profile emits none without offload; ZeRO-3's parameter offload stages
//                 each host shard on the device before its gather); the ops that depend on it,
//                 and the frees of either side, wait for it (backend.h "the copy queue").
// Setup ops (weights, adapter, gradients, optimizer states) run once, when the session starts;
// the rest once per optimizer step. Because every byte a kernel touches is a program buffer,
// the measured memory per category is the planner's prediction.
// Several ranks: every rank interprets the same program with its own rank; the program's
// collectives go to the Communicator (asynchronously: a compute op that depends on one, or the
// free of its buffer, waits, with a watchdog), its copies move offloaded optimizer data, and
// the program's scalar all_reduces ("loss", "grad_norm") combine the step's loss and norm.
#pragma once

#include <stdexcept>

#include <cstdint>
#include <cstdio>
#include <optional>
#include <filesystem>
#include <memory>
#include <span>
#include <vector>

#include "peftplan/executor/backend.h"
#include "peftplan/executor/data.h"
#include "peftplan/executor/measurement.h"
#include "peftplan/planner/plan_file.h"
#include "peftplan/sim/program.h"

namespace peftplan::executor {

class Communicator;

// Result of one optimizer step.
// A step whose global gradient norm is not finite, under run.on_nonfinite "stop": what() names the
// step, the norm and the first non-finite gradient. peftplan-exec exits with code 1 on it. Every
// rank decides on the same all-reduced norm, so they all stop at the same op.
class NonFiniteError : public std::runtime_error {
 public:
  explicit NonFiniteError(const std::string& message) : std::runtime_error(message) {}
};

struct StepStats {
  std::int64_t step = 0;     // 1-based optimizer step
  double loss = 0.0;         // mean over the step's G·S target tokens
  double grad_norm = 0.0;    // global 2-norm before clipping
  double lr = 0.0;           // learning rate used
  double seconds = 0.0;      // wall time of the step
};

// What a session takes from its surroundings rather than from the plan: read from the
// environment once, by peftplan-exec's main (session_options_from_env), never by library code.
struct SessionOptions {
  double watchdog_s = 20.0;  // a collective waiting longer is a failed peer (PEFTPLAN_WATCHDOG_S): a
                             // stalled rank ends the job within 30 s
  // Fault injection for the fault tests (PEFTPLAN_FAULT="RANK:STEP:OP[:stall]"): that rank throws
  // when it reaches program op `op` of optimizer step `step` (0-based), or with `stall` stops
  // there and never returns (a hung kernel or a lost process, as its peers see it).
  struct Fault {
    std::int32_t rank = 0;
    std::int64_t step = 0;
    std::size_t op = 0;
    bool stall = false;
  };
  std::optional<Fault> fault;
};

class Session {
 public:
  // Checks that the executor can run the plan (check_executable), builds the step program,
  // opens the checkpoint and adapter files, and runs the setup ops. `comm` may be null (one
  // rank). Throws InputError for unsupported plans and bad files.
  Session(const planner::PlanFile& plan, Backend& backend, TokenData data,
          Communicator* comm = nullptr, const SessionOptions& options = {});
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  // One optimizer step (zero gradients, every micro-batch, clip, AdamW).
  StepStats step();
  // The step's forward and backward for optimizer step `step_index` (0-based: its data and
  // dropout masks) without the update; gradients are left in gradients(). Returns the loss.
  double forward_backward(std::int64_t step_index);

  // The adapter (fp32, its tensors in trainable-inventory order), copied from the device. With
  // ZeRO-3, all_gathered from the ranks' shards (a collective: every rank calls it; its bytes
  // are not counted in the steps' measurement).
  std::vector<float> trainable_weights();
  // Writes the adapter back (the same layout; under ZeRO-3 each rank writes its shards' part).
  void set_trainable_weights(std::span<const float> weights);
  // grad.flat copied from the device (DDP and ZeRO-1 keep the full gradients).
  std::vector<float> gradients() const;
  const sim::Program& program() const;
  const MemoryStats& memory() const;
  // Everything measured so far (memory, losses, op times, the last step's trace).
  Measurement measurement() const;
  // adapter_model.safetensors + adapter_config.json into dir.
  void save_adapter(const std::filesystem::path& dir) const;
  // Optimizer steps completed (including those before a resume).
  std::int64_t steps_done() const;
  // Collective over the ranks: writes <dir>/step-<steps_done>/ and <dir>/latest atomically
  // (layout in runner.cpp). Every rank must reach it at the same step.
  void save_checkpoint(const std::filesystem::path& dir) const;
  // Loads a checkpoint (a step-<k> folder, or a folder with "latest"): adapter (ZeRO-3: this
  // rank's adapter partition), this rank's optimizer states, the step; the next step()
  // continues as an uninterrupted run would.
  void resume(const std::filesystem::path& dir);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Validates what this executor supports, with a clear InputError otherwise: the executor
// profile, Llama-family models (llama, mistral, qwen2), one LoRA adapter without DoRA, bias or
// modules_to_save, eager attention, fp32 or bf16 base storage, AdamW; ddp, zero1, zero2 or zero3
// on any number of ranks, optimizer offload with a ZeRO stage, parameter offload with zero3;
// checkpoints and resume with every strategy.
void check_executable(const planner::PlanFile& plan);

// peftplan-exec PLAN.json: loads the data, runs plan.run.steps steps printing one progress line
// per step to `progress` (may be null), writes <out_dir>/measurement.json and
// <out_dir>/trace.json, and saves the adapter when plan.run.save_adapter is set.
// Under several ranks `comm` is the job's communicator: rank 0 prints and writes one
// measurement.json with every rank's in "per_rank". Checkpoints every plan.run.checkpoint_every
// steps; plan.run.resume continues from one.
Measurement run_plan(const planner::PlanFile& plan, Backend& backend,
                     const std::filesystem::path& out_dir, std::FILE* progress,
                     Communicator* comm = nullptr, const SessionOptions& options = {});

// peftplan-exec PLAN.json... --rounds R: every plan run R times, the rounds interleaved (round
// 1: each plan in turn, then round 2, ...) inside this one job, so a slow spell of a shared
// machine lands on all of them and the job is launched once, not R x plans times (mpirun's
// start costs about half a second a launch on the development machines, a third of one short
// run). Round 1 runs each plan as given, into its own folder (progress lines on `progress`,
// preceded with several plans by a header naming the strategy and folder); rounds 2..R repeat
// its steps for their times only, into <plan folder>/rounds/<k>/ (their plan.json written
// there), without saving the adapter or writing checkpoints. After each round `progress` gets
// one line: "round k/R: <strategy> <steady step> ms, ...". Every plan is loaded and checked
// (for this job's ranks too) before any runs. A non-finite step ends the rounds with a
// NonFiniteError naming the plan and round. `progress` null: nothing is printed.
// `out_dir` (one plan, one round only): round 1's folder instead of the plan's.
void run_rounds(const std::vector<std::filesystem::path>& plan_paths, int rounds, Backend& backend, std::FILE* progress,
                Communicator* comm = nullptr, const SessionOptions& options = {}, const std::filesystem::path& out_dir = {});

// Round k's plan: round 1 is the plan as given; later rounds neither save the adapter nor write
// checkpoints (they would overwrite the first round's with identical files, or a checkpoint a
// later round resumes from).
planner::PlanFile round_plan(const planner::PlanFile& plan, int round);

// Several ranks (a collective: every rank calls it): rank 0's `m` gets every rank's
// measurement in per_rank and, from their collective_op_s_by_step, each collective's transfer
// and arrival wait (collective_transfer_s, collective_wait_s, sync_wait_s). One rank: nothing.
void gather_ranks(Measurement& m, Communicator& comm);

// Rank 0: each collective's transfer (the shortest rank's execution, step by step: the rank
// that arrived last waited for nobody) and the time ranks waited for the last one to arrive,
// per collective op and in total, from every rank's collective_op_s_by_step (see Measurement).
// Each is the mean over every recorded step after the first, not over the one steady step the
// step time and op_s take: where ranks share the cores, a call's time is mostly how long the
// scheduler keeps its communication thread off the core its compute thread holds, and one
// step's sample of that is a lottery (ZeRO-3's transfer per step on the development VM: 1 to 16
// ms over rounds whose step times agreed within 3%; the mean over its 19 steps: 6 to 13 ms). The
// mean is also what the calibration fits (fit_collective_step_costs: the seconds a call adds).
// Reads m.step_times_s, m.collective_ops and every m.per_rank[r].collective_op_s_by_step; leaves m
// as it is when a rank lacks them or their collective ops differ.
void split_collective_time(Measurement& m);

}  // namespace peftplan::executor
