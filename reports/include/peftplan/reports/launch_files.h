// The files a user launches a configuration with: `recommend --emit DIR` for its top row, and the
// explorer's File → Export launch files for the plan it shows.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include "peftplan/planner/recommend.h"
#include "peftplan/sim/cluster.h"

namespace peftplan::reports {

// Writes into `dir` (created when missing), each file under a temporary name then renamed:
// plan.json (the row's input and cluster, for `peftplan compare`), the launcher's config
// (ds_config.json and an accelerate config pointing at it for DeepSpeed; accelerate's FSDP or
// MULTI_GPU YAML for the hf profile), adapter_config.json (PEFT's format), train.py
// (transformers Trainer + PEFT with those settings), launch.sh (accelerate launch, deepspeed and
// torchrun lines, and the `peftplan run` line of a scaled-down twin on this machine).
// `model_arg` is what --model said (a zoo name or a path); `cluster` is the cluster planned on (the
// row's GPU count is taken from it); `eval_batch` the evaluation batch the row is launched with (a
// search plans without the evaluation peak). `tool` names the writer in the files' comments
// ("peftplan recommend", "peftplan-gui"). The files are written together (write_files_together):
// one that cannot be written leaves none of them. Returns the launch files of an earlier plan
// that this one does not write and that stay in `dir` (ds_config.json beside an FSDP plan, say),
// for the caller to point out; they are not removed (the folder may be the user's own).
std::vector<std::string> emit_launch_files(const std::filesystem::path& dir, const planner::Candidate& row, const sim::Cluster& cluster, std::int64_t eval_batch,
                       const std::string& model_arg, const std::string& tool = "peftplan recommend");

// "note: DIR still holds ds_config.json from an earlier plan, which this one does not use", or
// "" when `stale` (what emit_launch_files returned) is empty.
std::string stale_launch_files_note(const std::filesystem::path& dir, const std::vector<std::string>& stale);

// The train.py text for a row (a pure function, for tests).
std::string train_py(const planner::Candidate& row, const std::string& model_id, bool deepspeed);

}  // namespace peftplan::reports
