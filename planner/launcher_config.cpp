// A launcher's config applied to a plan input (see launcher_config.h).
#include "peftplan/planner/launcher_config.h"

#include <algorithm>

#include <fmt/format.h>

#include "peftplan/common/error.h"
#include "peftplan/planner/ds_config.h"

namespace peftplan::planner {

bool launches_with_deepspeed(const PlanInput& in) {
  return in.profile != RuntimeProfile::hf && deepspeed_runs(in.strategy, in.training);
}

RuntimeProfile profile_that_runs(RuntimeProfile requested, const Strategy& s, const TrainingSpec& t) {
  return requested == RuntimeProfile::deepspeed && (is_fsdp(s.stage) || !deepspeed_runs(s, t)) ? RuntimeProfile::hf : requested;
}

std::string profile_switch_warning(const Strategy& s, const TrainingSpec& t, RuntimeProfile runs, std::string_view knob_prefix) {
  const std::string stage = fmt::format("{}strategy {} is planned with {}profile {}", knob_prefix, name_of(s.stage), knob_prefix, name_of(runs));
  if (is_fsdp(s.stage)) return stage + ": torch FSDP runs under accelerate, not DeepSpeed";
  return fmt::format("{}precision {} with {}: DeepSpeed runs pure bf16 only under ZeRO, so the Trainer's own DDP runs it", knob_prefix,
                     name_of(t.precision), stage);
}

void apply_ds_config(PlanInput& in, const nlohmann::json& config, std::string_view source, std::vector<std::string>& warnings,
                     bool precision_given) {
  if (is_fsdp(in.strategy.stage))
    throw InputError(fmt::format("{}: a DeepSpeed config runs ZeRO, not {} (give FSDP's settings in an accelerate config)", source,
                                 name_of(in.strategy.stage)));
  DsConfigInputs di;
  di.world_size = in.strategy.ranks;
  di.training = in.training;
  di.hidden = in.model.hidden;
  di.precision_given = precision_given;
  DsConfig ds = read_ds_config(config, source, di);
  in.strategy = ds.strategy;
  in.training = ds.training;
  warnings.insert(warnings.end(), ds.warnings.begin(), ds.warnings.end());
}

void apply_accelerate_config(PlanInput& in, const AccelerateConfig& ac, std::string_view source, const sim::Cluster& cluster,
                             const AccelerateOverrides& given, std::vector<std::string>& warnings) {
  const std::int32_t total = sim::total_gpus(cluster);
  const std::optional<std::int32_t> gpus = given.gpus;
  const std::int32_t ranks = gpus ? *gpus : ac.strategy.ranks > 0 ? ac.strategy.ranks : in.strategy.ranks;
  if (ranks > total)
    throw input_error(source, "num_processes", fmt::format("must not exceed the cluster's {} GPUs ({})", total, cluster.name), std::to_string(ranks));
  if (gpus && ac.strategy.ranks > 0 && ac.strategy.ranks != *gpus)
    warnings.push_back(fmt::format("{}: --gpus {} overrides num_processes {} (as accelerate launch --num_processes does)", source, *gpus,
                                   ac.strategy.ranks));
  in.strategy = ac.strategy;
  in.strategy.ranks = ranks;
  // HYBRID_SHARD shards within a machine: num_processes / num_machines ranks, or a node's GPUs.
  if (in.strategy.stage == Stage::fsdp_hybrid_shard)
    in.strategy.shard_group = ac.num_machines > 1 ? ranks / ac.num_machines : std::min(cluster.gpus_per_node, ranks);
  const Precision asked = in.training.precision;
  const bool mixed = asked == Precision::bf16_mixed || asked == Precision::fp16_mixed;
  if (given.precision_given && mixed) {
    // TrainingArguments' bf16 / fp16 override the YAML's mixed_precision.
    const bool other = ac.precision ? *ac.precision != asked : ac.no_mixed_precision;
    if (other)
      warnings.push_back(fmt::format("{}: --precision {} overrides mixed_precision '{}' (the Trainer's {} overrides accelerate's)", source,
                                     name_of(asked), ac.precision ? (*ac.precision == Precision::fp16_mixed ? "fp16" : "bf16") : "no",
                                     asked == Precision::fp16_mixed ? "fp16=True" : "bf16=True"));
  } else {
    if (ac.precision && !(given.precision_given && asked == Precision::bf16_pure && *ac.precision == Precision::bf16_mixed))
      in.training.precision = *ac.precision;
    if (ac.no_mixed_precision && mixed) {
      // 'no': no autocast, the model in its torch_dtype; bf16 is what fine-tuning recipes load.
      in.training.precision = Precision::bf16_pure;
      warnings.push_back(fmt::format("{}: mixed_precision 'no' is planned as --precision bf16-pure (the model loaded in bf16, "
                                     "no autocast); give --precision fp32 for an fp32 model",
                                     source));
    }
  }
  if (in.strategy.fsdp.activation_checkpointing) {  // FSDP's checkpoint_wrapper on every decoder layer
    in.training.checkpointing = Checkpointing::full;
    in.training.checkpoint_reentrant = false;
  }
  // An accelerate job runs transformers + PEFT: the hf profile, unless another was asked for.
  if (!given.profile_given) in.profile = RuntimeProfile::hf;
  warnings.insert(warnings.end(), ac.warnings.begin(), ac.warnings.end());
}

}  // namespace peftplan::planner
