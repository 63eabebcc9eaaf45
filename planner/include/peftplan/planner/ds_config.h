// DeepSpeed ds_config.json in and out. Reading turns a parsed config into Strategy and
// TrainingSpec updates (plus the scheduler and loss-scaling settings the executor needs, and
// warnings); writing turns them back into a config DeepSpeed accepts, with explicit numbers.
// Semantics follow DeepSpeed's code (deepspeed/runtime/config.py, runtime/constants.py,
// runtime/zero/config.py, runtime/zero/offload_config.py, runtime/lr_schedules.py), and "auto"
// values are resolved as Hugging Face transformers' HfTrainerDeepSpeedConfig does
// (src/transformers/integrations/deepspeed.py). Reading a file from disk is the caller's job:
// this header takes nlohmann::json and a source name for messages.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "peftplan/planner/specs.h"

namespace peftplan::planner {

// deepspeed/runtime/lr_schedules.py: the warmup schedulers the executor implements.
enum class SchedulerType {
  warmup_lr,          // "WarmupLR": warm up from warmup_min_lr to warmup_max_lr, then hold
  warmup_decay_lr,    // "WarmupDecayLR": WarmupLR, then linear decay to 0 at total_num_steps
  warmup_cosine_lr,   // "WarmupCosineLR": ratios of the optimizer lr, cosine decay after warmup
};

std::string_view name_of(SchedulerType t);  // DeepSpeed's spelling ("WarmupLR", ...)

// scheduler.params with lr_schedules.py's defaults; fields a type does not use are ignored.
struct SchedulerSpec {
  SchedulerType type = SchedulerType::warmup_lr;
  double warmup_min_lr = 0.0;                 // WarmupLR/WarmupDecayLR: lr at step 0
  double warmup_max_lr = 0.001;               // WarmupLR/WarmupDecayLR: lr after warmup
  std::int64_t warmup_num_steps = 1000;       // optimizer steps of warmup
  std::string warmup_type = "log";            // "log" or "linear"
  std::optional<std::int64_t> total_num_steps;  // required by WarmupDecayLR and WarmupCosineLR
  double warmup_min_ratio = 0.0;              // WarmupCosineLR: start lr / optimizer lr
  double cos_min_ratio = 0.0001;              // WarmupCosineLR: final lr / optimizer lr

  bool operator==(const SchedulerSpec&) const = default;
};

// fp16 section's loss-scaling settings (deepspeed/runtime/constants.py defaults).
struct LossScaling {
  double loss_scale = 0.0;                 // 0 = dynamic loss scaling; > 0 = static scale
  std::int64_t initial_scale_power = 16;   // dynamic: initial scale 2**power
  std::int64_t loss_scale_window = 1000;   // dynamic: steps without overflow before scaling up
  std::int64_t hysteresis = 2;             // dynamic: overflows tolerated before scaling down
  bool consecutive_hysteresis = false;     // dynamic: refill hysteresis on a good step
  double min_loss_scale = 1.0;             // dynamic: lower bound of the scale

  bool operator==(const LossScaling&) const = default;
};

// What ds_config.json carries beyond Strategy and TrainingSpec.
struct DsExtras {
  std::optional<SchedulerSpec> scheduler;  // none: the client (or no) scheduler
  LossScaling loss_scaling;                // used when precision is fp16_mixed
  double sgd_momentum = 0.9;               // optimizer.params.momentum when the optimizer is SGD

  bool operator==(const DsExtras&) const = default;
};

// The values "auto" entries are resolved from, as HfTrainerDeepSpeedConfig fills them from
// TrainingArguments and the model config; also the data-parallel world size DeepSpeed's batch
// rule uses (from flags: gpus per node x nodes).
struct DsConfigInputs {
  std::int32_t world_size = 1;             // N: data-parallel ranks
  TrainingSpec training;                   // micro_batch, grad_accum, lr, betas, eps, weight_decay,
                                           // grad_clip, precision; fields ds_config does not cover
                                           // (seq_len, checkpointing, ...) pass through unchanged
  std::optional<std::int64_t> hidden;      // H (model hidden size) for the bucket-size "auto"s
  std::optional<std::int64_t> total_steps;   // scheduler.params.total_num_steps "auto"
  std::optional<std::int64_t> warmup_steps;  // scheduler.params.warmup_num_steps "auto"
  // training.precision is the Trainer's own (typed by the user), not a default: a fp16 or bf16
  // section the file leaves out is then added enabled, as accelerate does for the Trainer's fp16
  // or bf16; otherwise a missing section is off (DeepSpeed's default) and the file decides.
  bool precision_given = false;
};

struct DsConfig {
  Strategy strategy;                       // stage, offload, knobs; ranks = inputs.world_size
  TrainingSpec training;                   // inputs.training updated by the config
  std::int64_t train_batch_size = 0;       // resolved: micro_batch * grad_accum * world_size
  DsExtras extras;
  std::vector<std::string> warnings;       // "<source>: <key path> ..." one per line, no newline
};

// Which of a ds_config's keys make `p` (read_precision's rule), and `p`'s name: for a message that
// names where a file set the precision ("bf16.enabled true with fp32 master weights: bf16").
std::string ds_precision_keys(Precision p);

// Reads a parsed ds_config.json. Throws InputError ("<source>: <key path> <problem>, got <value>")
// for: wrong types, negative sizes, stage outside 0..3, fp16 and bf16 both enabled,
// offload_param without stage 3, offload_optimizer without ZeRO, offload to "nvme", batch sizes
// that break DeepSpeed's rule (DeepSpeed's own assertion message is quoted), "auto" with nothing
// to resolve it from. Unknown keys, and DeepSpeed keys peftplan does not model set to a
// non-default value, become warnings naming the key path.
DsConfig read_ds_config(const nlohmann::json& config, std::string_view source, const DsConfigInputs& inputs);

// Writes a config DeepSpeed accepts: explicit numbers (no "auto"), train_batch_size,
// train_micro_batch_size_per_gpu and gradient_accumulation_steps consistent with DeepSpeed's
// rule, an fp16 or bf16 section (none for fp32), optimizer (AdamW or SGD; omitted for
// adamw_8bit, which DeepSpeed cannot construct: the client creates it), scheduler if any,
// gradient_clipping and zero_optimization with every knob. read_ds_config(write_ds_config(s, t,
// x), ..., {s.ranks, t}) gives back s, t and x. Throws InputError for what DeepSpeed would reject
// (bf16_pure needs ZeRO stage 1-3; offload_param needs stage 3; offload_optimizer needs ZeRO).
nlohmann::json write_ds_config(const Strategy& strategy, const TrainingSpec& training,
                               const DsExtras& extras = {});

}  // namespace peftplan::planner
