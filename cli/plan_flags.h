// Flags shared by `plan` (and later `run`, `recommend`, `sweep`): model, adapters, training,
// strategy, cluster. Turning them into a PlanInput and a Cluster is the only job here.
#pragma once

#include <optional>
#include <map>
#include <string>
#include <string_view>

#include <CLI/CLI.hpp>

#include "peft_flags.h"
#include "peftplan/planner/plan.h"
#include "peftplan/planner/program.h"
#include "peftplan/sim/cluster.h"

namespace peftplan::cli {

struct PlanFlags {
  std::string model = "llama-2-7b";
  PeftFlags peft;
  std::optional<std::int32_t> gpus;
  std::string cluster;
  std::string strategy = "ddp";
  std::optional<std::int32_t> fsdp_version;
  std::string offload_optimizer = "none";
  std::string offload_param = "none";
  std::string ds_config;
  std::string accelerate_config;
  std::int64_t micro_batch = 1;
  std::int64_t seq_len = 2048;
  std::int64_t grad_accum = 1;
  std::int64_t eval_batch = 8;
  std::string precision = "bf16";
  std::string checkpointing = "none";
  std::string attention = "flash";
  std::string cross_entropy = "standard";
  std::string optimizer = "adamw";
  std::string base_dtype;
  std::string profile;  // "": deepspeed, or the profile that runs the job (hf: --accelerate-config, FSDP, pure-bf16 DDP)
  double headroom_pct = 100.0 * planner::kDefaultHeadroomFraction;
  std::string alloc_conf;
  // The flags' set, as add_plan_flags registered them (a search's strategy is not --strategy).
  enum class Set { one_plan, search } set = Set::one_plan;
  // Which of the flags a launcher config also sets were on the command line (add_plan_flags lists them): a
  // flag left at its default gives way to the file, a typed one that says otherwise is refused.
  std::map<std::string, std::string, std::less<>> given;  // flag -> the value as typed
  bool was_given(std::string_view flag) const { return given.count(flag) != 0; }
};

// Which flags a command takes: `plan` all of them; a search (`recommend`) registers its own list
// spellings of --gpus, --strategy and --checkpointing, and searches micro-batch, accumulation and
// offload, so those (and the launcher configs that would fix them) are not registered.
using PlanFlagSet = PlanFlags::Set;
// A file or folder flag's value must not be empty: "not given" is leaving the flag out (an unset
// shell variable is not a default).
extern const CLI::Validator kNonEmpty;

void add_plan_flags(CLI::App* cmd, PlanFlags& flags, PlanFlagSet set = PlanFlagSet::one_plan);

struct ResolvedPlan {
  planner::PlanInput input;
  sim::Cluster cluster;
  std::vector<std::string> warnings;  // from ds_config.json or the accelerate config
  double headroom_fraction = planner::kDefaultHeadroomFraction;
};
ResolvedPlan resolve_plan_flags(const PlanFlags& flags);

// How the CLI names a knob (planner/knobs.h): its flag ("--micro-batch"), or for DeepSpeed's
// bucket sizes the ds_config key that sets them. The planner's suggestions and refusals are
// spelled with it on the terminal and in reports.
std::string flag_of(planner::Knob k);
// A planner's warning with each field it names in parentheses ("(training.eval_batch)") spelled
// as the flag that sets it ("(--eval-batch)"), as refusals name their flags, and every byte that
// would not print escaped and a newline shown as \n (error.h printable_line: a file's key in it
// may hold an escape sequence).
std::string with_flags(std::string warning);
// Each warning as "warning: ..." (with_flags) on stderr, where a command's --json output is not.
void print_warnings(const std::vector<std::string>& warnings);

}  // namespace peftplan::cli
