// `recommend --emit DIR`: the files a user launches the recommended configuration with.
#pragma once

#include <filesystem>
#include <string>

#include "plan_flags.h"
#include "peftplan/planner/recommend.h"

namespace peftplan::cli {

// Writes into `dir` (created when missing), each file under a temporary name then renamed:
// plan.json (the row's input and cluster, for `peftplan compare`), the launcher's config
// (ds_config.json and an accelerate config pointing at it for DeepSpeed; accelerate's FSDP or
// MULTI_GPU YAML for the hf profile), adapter_config.json (PEFT's format), train.py
// (transformers Trainer + PEFT with those settings), launch.sh (accelerate launch, deepspeed and
// torchrun lines, and the `peftplan run` line of a scaled-down twin on this machine).
// `model_arg` is what --model said (a zoo name or a path).
void emit_launch_files(const std::filesystem::path& dir, const planner::Candidate& row, const ResolvedPlan& base, const std::string& model_arg);

// The train.py text for a row (a pure function, for tests).
std::string train_py(const planner::Candidate& row, const std::string& model_id, bool deepspeed);

}  // namespace peftplan::cli
