// A launcher's config applied to a plan input: DeepSpeed's ds_config.json or accelerate's launch
// YAML (FSDP or MULTI_GPU) taking over the strategy and the training settings it covers. One rule
// for every front end that reads such a file (`plan --ds-config`, `--accelerate-config`, the
// explorer's File menu and its --ds-config / --accelerate-config).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "peftplan/planner/accelerate_config.h"
#include "peftplan/planner/plan.h"
#include "peftplan/sim/cluster.h"

namespace peftplan::planner {

// Whether a plan is launched under DeepSpeed (a ds_config.json, ZeRO under the deepspeed or
// executor profile) or accelerate alone (its YAML: FSDP, DDP under the hf profile, and DDP in
// pure bf16). One rule for every writer of launch files.
bool launches_with_deepspeed(const PlanInput& in);

// The profile that plans a job asked for under `requested`: hf for a job DeepSpeed does not run
// (an FSDP strategy: accelerate runs it; DDP in pure bf16: the Trainer's own DDP runs it), else
// `requested`. One rule for the front ends that choose a profile (plan's default, recommend's
// families, the report's and the explorer's columns); profile_switch_warning says so, and why,
// when the two differ: "--precision bf16-pure with --strategy ddp is planned with --profile hf:
// ..." with knob_prefix "--" (the command line), "precision bf16-pure with strategy ddp ..." with
// "" (the explorer's fields).
RuntimeProfile profile_that_runs(RuntimeProfile requested, const Strategy& strategy, const TrainingSpec& training);
std::string profile_switch_warning(const Strategy& strategy, const TrainingSpec& training, RuntimeProfile runs, std::string_view knob_prefix);

// ds_config.json (read_ds_config): the strategy (stage, offload, bucket sizes) and the training
// settings it covers replace `in`'s, its "auto" entries resolved from `in` (micro-batch,
// accumulation, precision, the model's hidden size); the ranks stay `in`'s. Warnings (unmodelled
// keys) are appended. `precision_given`: `in`'s precision is the Trainer's own (typed), so a
// missing fp16 or bf16 section follows it as accelerate adds it (DsConfigInputs::precision_given).
// Throws InputError naming `source` and the key; also when `in`'s strategy is an FSDP one (a
// DeepSpeed config runs ZeRO).
void apply_ds_config(PlanInput& in, const nlohmann::json& config, std::string_view source, std::vector<std::string>& warnings,
                     bool precision_given = false);

// What the command line says beside an accelerate YAML.
struct AccelerateOverrides {
  std::optional<std::int32_t> gpus;  // --gpus: overrides num_processes, as `accelerate launch --num_processes` does
  bool profile_given = false;        // --profile: kept; else the profile becomes hf
  bool precision_given = false;      // --precision: bf16 or fp16 (mixed) is the Trainer's, which overrides mixed_precision
};

// accelerate's YAML (read_accelerate_config): the strategy (DDP or an FSDP one, with its knobs)
// replaces `in`'s, on num_processes ranks unless `given.gpus` (a warning says so when they
// differ); FSDP's activation_checkpointing means non-reentrant full checkpointing; and unless
// `given.profile_given`, the profile becomes hf (an accelerate job runs transformers + PEFT).
// Its mixed_precision sets the precision ('no' is planned as pure bf16, with a warning) unless
// `given.precision_given` with a mixed precision: the Trainer's bf16 / fp16 override accelerate's
// (transformers TrainingArguments.__post_init__, "if training args is specified, it will override
// the one specified in the accelerate config"); a warning says so when they differ. Pure bf16
// given beside mixed_precision bf16 stays pure (autocast to bf16 of bf16 weights computes as
// they are). Throws InputError naming `source`: more processes than the cluster's GPUs.
void apply_accelerate_config(PlanInput& in, const AccelerateConfig& config, std::string_view source, const sim::Cluster& cluster,
                             const AccelerateOverrides& given, std::vector<std::string>& warnings);

}  // namespace peftplan::planner
