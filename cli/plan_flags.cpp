// Plan flags -> PlanInput + Cluster. Every bad value is an InputError naming the flag, the value
// and the valid spellings.
#include "plan_flags.h"

#include "peftplan/sim/caching_allocator.h"

#include "peftplan/common/error.h"
#include "peftplan/common/units.h"
#include "peftplan/models/config.h"
#include "peftplan/planner/accelerate_config.h"
#include "peftplan/planner/ds_config.h"
#include "peftplan/planner/launcher_config.h"

namespace peftplan::cli {
namespace {

// The value among `values` spelt `value` (planner's name_of), or an error naming the flag.
template <typename E, std::size_t N>
E pick(const std::string& flag, const std::string& value, const std::array<E, N>& values) {
  if (const std::optional<E> e = planner::from_name(value, values)) return *e;
  throw input_error(flag, "", "must be one of " + planner::names_of(values), "\"" + value + "\"");
}

// A setting a launcher config and a flag both make, spelled for a refusal: the flag, what it sets,
// where the file sets it (with the file's value), and whether the two disagree.
struct FileSetting {
  std::string_view flag, what;
  std::string field;
  bool differs;
};

// A ds_config's batch key with the value DeepSpeed takes; when the file leaves it out, the value
// DeepSpeed derives from train_batch_size, or its default (runtime/config.py
// _set_batch_related_parameters).
std::string ds_batch_field(const nlohmann::json& ds, const char* key, std::int64_t value) {
  if (!ds.is_object() || ds.contains(key)) return fmt::format("{} {}", key, value);
  if (const auto t = ds.find("train_batch_size"); t != ds.end() && t->is_number_integer())
    return fmt::format("{} {}, derived from train_batch_size {}", key, value, t->dump());
  return fmt::format("{} absent: DeepSpeed takes {}", key, value);
}

// A launcher config sets the strategy and some training settings. A flag left at its default gives
// way to the file; a flag typed on the command line that the file contradicts is refused, naming
// both, not resolved in silence. transformers refuses the same for a ds_config value that
// mismatches TrainingArguments (integrations/deepspeed.py, HfTrainerDeepSpeedConfig
// trainer_config_finalize: "Please correct the following DeepSpeed config values that mismatch
// TrainingArguments values").
void refuse_contradictions(const PlanFlags& f, std::string_view file_flag, std::string_view file, std::string_view launcher,
                           const std::vector<FileSetting>& settings) {
  for (const FileSetting& s : settings)
    if (s.differs && f.was_given(s.flag))
      throw InputError(fmt::format("{} {} with {} {}: the {} sets {} ({}); drop {}", file_flag, file, s.flag, f.given.find(s.flag)->second,
                                   launcher, s.what, s.field, s.flag));
}

}  // namespace

// An empty value where "not given" means a default (a file, the cluster, the profile, the base's
// storage): refused, so `--ds-config "$UNSET"` is not a plan without the file.
const CLI::Validator kNonEmpty(
    [](std::string& v) { return v.empty() ? std::string("must not be empty (leave the flag out for its default)") : std::string(); },
    "", "NONEMPTY");

void add_plan_flags(CLI::App* cmd, PlanFlags& f, PlanFlagSet set) {
  f.set = set;
  const bool one = set == PlanFlagSet::one_plan;
  cmd->add_option("--model", f.model, "zoo name, config.json, or a folder holding one")->capture_default_str();
  add_peft_flags(cmd, f.peft);
  cmd->add_flag("--full-finetune", f.peft.full_finetune, "train every weight (no adapter)");
  if (one) cmd->add_option("--gpus", f.gpus, "data-parallel ranks (alone: N GPUs of the default kind on one node)");
  cmd->add_option("--cluster", f.cluster, "preset, spelling like 2x8xH100-SXM-NDR, or a cluster JSON file")->check(kNonEmpty);
  if (one)
    cmd->add_option("--strategy", f.strategy, "ddp, zero1, zero2, zero3, fsdp-full-shard, fsdp-shard-grad-op, fsdp-no-shard or fsdp-hybrid-shard")
        ->capture_default_str();
  if (one) cmd->add_option("--fsdp-version", f.fsdp_version, "1 (FSDP1, flat parameters) or 2 (FSDP2 fully_shard, per-parameter shards: fsdp-full-shard or fsdp-shard-grad-op)");
  if (one) cmd->add_option("--offload-optimizer", f.offload_optimizer, "none or cpu")->capture_default_str();
  if (one) cmd->add_option("--offload-param", f.offload_param, "none or cpu (ZeRO-3; FSDP's CPUOffload)")->capture_default_str();
  if (one) cmd->add_option("--ds-config", f.ds_config, "DeepSpeed ds_config.json (sets the strategy and the batch, precision and optimizer it names; a typed flag it contradicts is refused)")->check(kNonEmpty);
  if (one)
    cmd->add_option("--accelerate-config", f.accelerate_config,
                    "accelerate launch config YAML with FSDP or MULTI_GPU (sets the strategy; a typed flag it contradicts is refused; implies --profile hf)")
        ->check(kNonEmpty);
  if (one) cmd->add_option("--micro-batch", f.micro_batch, "sequences per GPU per micro-step")->capture_default_str();
  cmd->add_option("--seq-len", f.seq_len, "tokens per sequence")->capture_default_str();
  if (one) cmd->add_option("--grad-accum", f.grad_accum, "micro-steps per optimizer step")->capture_default_str();
  cmd->add_option("--eval-batch", f.eval_batch, "evaluation sequences per GPU (the Trainer's per_device_eval_batch_size; 0: no evaluation), for the evaluation peak (--profile hf)")
      ->capture_default_str();
  cmd->add_option("--precision", f.precision, "fp32, fp16, bf16 (mixed) or bf16-pure")->capture_default_str();
  if (one) cmd->add_option("--checkpointing", f.checkpointing, "none, full, or every-K")->capture_default_str();
  cmd->add_option("--attention", f.attention, "eager or flash")->capture_default_str();
  cmd->add_option("--cross-entropy", f.cross_entropy,
                  "standard (the logits materialised) or chunked (a fused linear cross-entropy, Liger's)")->capture_default_str();
  cmd->add_option("--optimizer", f.optimizer, "adamw, adamw-8bit or sgd")->capture_default_str();
  cmd->add_option("--base-dtype", f.base_dtype, "frozen weight storage: fp32, bf16, fp16, int8, nf4")->check(kNonEmpty);
  cmd->add_option("--headroom", f.headroom_pct, "percent of the GPU's memory the verdict keeps free beyond the predicted peak in use")
      ->capture_default_str();
  cmd->add_option("--alloc-conf", f.alloc_conf,
                  "PYTORCH_CUDA_ALLOC_CONF for the caching allocator model (expandable_segments:True, max_split_size_mb:N)");
  cmd->add_option("--profile", f.profile,
                  "executor, deepspeed (the default) or hf (transformers + PEFT; the default with --accelerate-config, an FSDP strategy or pure-bf16 DDP; pytorch is its old name)")
      ->check(kNonEmpty);
  // The flags a launcher config also sets: whether each was typed, for resolve_plan_flags.
  for (const char* name : {"--strategy", "--offload-optimizer", "--offload-param", "--micro-batch", "--grad-accum", "--precision",
                           "--checkpointing", "--optimizer"})
    if (CLI::Option* o = cmd->get_option_no_throw(name)) o->each([&f, name](const std::string& v) { f.given[name] = v; });
}

ResolvedPlan resolve_plan_flags(const PlanFlags& f) {
  ResolvedPlan r;
  planner::PlanInput& in = r.input;
  in.model = models::load_model(f.model);
  in.peft = peft_from_flags(f.peft);
  for (auto& w : models::apply_checkpoint_quantization(in.model, in.peft, !f.peft.quant.empty()))
    r.warnings.push_back(std::move(w));
  for (auto& w : models::unmatched_target_warnings(in.model, in.peft)) r.warnings.push_back(std::move(w));  // once per input, not per plan
  auto& t = in.training;
  t.micro_batch = f.micro_batch;
  t.seq_len = f.seq_len;
  t.grad_accum = f.grad_accum;
  if (f.eval_batch < 0) throw input_error("--eval-batch", "", "must be 0 (no evaluation) or a positive integer", std::to_string(f.eval_batch));
  t.eval_batch = f.eval_batch;
  t.full_finetune = f.peft.full_finetune;
  using planner::Precision, planner::Checkpointing, planner::Attention, planner::Optimizer, planner::Stage;
  t.precision = pick("--precision", f.precision, planner::kPrecisions);
  if (f.checkpointing.rfind("every-", 0) == 0) {
    t.checkpointing = Checkpointing::every_k;
    try {
      t.checkpoint_every = std::stoll(f.checkpointing.substr(6));
    } catch (const std::exception&) {
      throw input_error("--checkpointing", "", "must be none, full or every-K with a positive K", "\"" + f.checkpointing + "\"");
    }
    if (t.checkpoint_every <= 0)
      throw input_error("--checkpointing", "", "must be none, full or every-K with a positive K", "\"" + f.checkpointing + "\"");
  } else {
    t.checkpointing = pick("--checkpointing", f.checkpointing, std::array{Checkpointing::none, Checkpointing::full});
  }
  t.attention = pick("--attention", f.attention, planner::kAttentions);
  t.cross_entropy = pick("--cross-entropy", f.cross_entropy, planner::kCrossEntropies);
  t.optimizer = pick("--optimizer", f.optimizer, planner::kOptimizers);
  if (!f.base_dtype.empty()) {
    auto d = parse_dtype(f.base_dtype);
    if (!d) throw input_error("--base-dtype", "", "must be fp32, bf16, fp16, int8 or nf4", "\"" + f.base_dtype + "\"");
    // A quantised base is stored as its quantisation: another storage contradicts it.
    if (in.peft.quantization && *d != in.peft.quantization->dtype)
      throw input_error("--base-dtype", "",
                        in.model.checkpoint_quantization
                            ? fmt::format("contradicts the model's quantization_config (saved quantised, {}, and loaded so): leave --base-dtype out",
                                          models::describe(*in.model.checkpoint_quantization))
                            : fmt::format("contradicts --quant {} (the quantised base is stored as {}): give one of them",
                                          name_of(in.peft.quantization->dtype), name_of(in.peft.quantization->dtype)),
                        "\"" + f.base_dtype + "\"");
    t.base_storage = *d;
  }
  if (!(f.headroom_pct >= 0.0 && f.headroom_pct < 100.0))
    throw input_error("--headroom", "", "must be a percentage in [0, 100)", fmt::format("{}", f.headroom_pct));
  r.headroom_fraction = f.headroom_pct / 100.0;
  in.alloc_conf = f.alloc_conf;
  (void)sim::AllocatorConfig::parse(in.alloc_conf, 0);  // refuse a bad --alloc-conf here
  std::string profile = f.profile.empty() ? std::string("deepspeed") : f.profile;
  if (profile == "pytorch") {  // the `hf` profile's old name
    r.warnings.push_back("--profile pytorch is now --profile hf (transformers + PEFT in eager PyTorch)");
    profile = "hf";
  }
  in.profile = pick("--profile", profile, planner::kRuntimeProfiles);
  // Cluster: --cluster, else --gpus N of the default kind, else the embedded default.
  if (!f.cluster.empty()) r.cluster = sim::resolve_cluster(f.cluster);
  else r.cluster = f.gpus ? sim::default_cluster(*f.gpus) : sim::resolve_cluster("8xA100-80GB");
  const std::int32_t total = sim::total_gpus(r.cluster);
  in.strategy.ranks = f.gpus.value_or(total);
  if (in.strategy.ranks <= 0) throw input_error("--gpus", "", "must be a positive integer", std::to_string(in.strategy.ranks));
  if (in.strategy.ranks > planner::kMaxRanks)
    throw input_error("--gpus", "", fmt::format("must be at most {}", with_commas(planner::kMaxRanks)), std::to_string(in.strategy.ranks));
  if (in.strategy.ranks > total)
    throw input_error("--gpus", "", fmt::format("must not exceed the cluster's {} GPUs ({})", total, r.cluster.name),
                      std::to_string(in.strategy.ranks));
  in.strategy.stage = pick("--strategy", f.strategy, planner::kStages);
  // HYBRID_SHARD shards within a node and replicates across nodes.
  if (in.strategy.stage == Stage::fsdp_hybrid_shard) in.strategy.shard_group = std::min(r.cluster.gpus_per_node, in.strategy.ranks);
  if (f.fsdp_version) {
    if (*f.fsdp_version != 1 && *f.fsdp_version != 2) throw input_error("--fsdp-version", "", "must be 1 or 2", std::to_string(*f.fsdp_version));
    if (!planner::is_fsdp(in.strategy.stage))
      throw InputError(fmt::format("--fsdp-version {} with --strategy {}: the FSDP version applies to the fsdp-* strategies", *f.fsdp_version, f.strategy));
    in.strategy.fsdp.version = *f.fsdp_version;
  }
  in.strategy.offload_optimizer = pick("--offload-optimizer", f.offload_optimizer, planner::kOffloadDevices);
  in.strategy.offload_param = pick("--offload-param", f.offload_param, planner::kOffloadDevices);
  if (!f.ds_config.empty() && planner::is_fsdp(in.strategy.stage))
    throw InputError(fmt::format("--ds-config {} with --strategy {}: a DeepSpeed config runs ZeRO, not FSDP (give FSDP's settings "
                                 "with --accelerate-config)", f.ds_config, f.strategy));
  if (!f.accelerate_config.empty() && f.fsdp_version)
    throw InputError(fmt::format("--accelerate-config {} with --fsdp-version: the accelerate config's fsdp_version sets it; drop --fsdp-version",
                                 f.accelerate_config));
  if (!f.ds_config.empty()) {
    const planner::PlanInput by_flags = in;
    const nlohmann::json ds = models::read_json_file(f.ds_config);
    planner::apply_ds_config(in, ds, f.ds_config, r.warnings, f.was_given("--precision"));
    const planner::TrainingSpec &a = by_flags.training, &b = in.training;
    const planner::Strategy &x = by_flags.strategy, &y = in.strategy;
    refuse_contradictions(
        f, "--ds-config", f.ds_config, "ds_config",
        {{"--strategy", "the strategy", fmt::format("zero_optimization.stage {}", name_of(y.stage)), x.stage != y.stage},
         {"--offload-optimizer", "the optimizer offload",
          fmt::format("zero_optimization.offload_optimizer.device {}", name_of(y.offload_optimizer)), x.offload_optimizer != y.offload_optimizer},
         {"--offload-param", "the parameter offload", fmt::format("zero_optimization.offload_param.device {}", name_of(y.offload_param)),
          x.offload_param != y.offload_param},
         {"--micro-batch", "the micro-batch", ds_batch_field(ds, "train_micro_batch_size_per_gpu", b.micro_batch), a.micro_batch != b.micro_batch},
         {"--grad-accum", "the accumulation", ds_batch_field(ds, "gradient_accumulation_steps", b.grad_accum), a.grad_accum != b.grad_accum},
         {"--precision", "the precision", planner::ds_precision_keys(b.precision), a.precision != b.precision},
         {"--optimizer", "the optimizer", fmt::format("optimizer.type: {}, which DeepSpeed builds in place of the Trainer's", name_of(b.optimizer)),
          a.optimizer != b.optimizer}});
  }
  if (!f.accelerate_config.empty()) {
    if (!f.ds_config.empty())
      throw InputError("--accelerate-config and --ds-config: give one launcher's config, not both");
    const planner::PlanInput by_flags = in;
    planner::apply_accelerate_config(in, planner::read_accelerate_config_file(f.accelerate_config), f.accelerate_config, r.cluster,
                                     {.gpus = f.gpus, .profile_given = !f.profile.empty(), .precision_given = f.was_given("--precision")},
                                     r.warnings);
    const planner::TrainingSpec &a = by_flags.training, &b = in.training;
    const planner::Strategy &x = by_flags.strategy, &y = in.strategy;
    refuse_contradictions(
        f, "--accelerate-config", f.accelerate_config, "accelerate config",
        {{"--strategy", "the strategy", fmt::format("distributed_type and fsdp_config: {}", name_of(y.stage)), x.stage != y.stage},
         {"--offload-optimizer", "the optimizer offload", "none: accelerate has no optimizer-only offload",
          x.offload_optimizer != y.offload_optimizer},
         {"--offload-param", "the parameter offload",
          planner::is_fsdp(y.stage) ? fmt::format("fsdp_config.fsdp_offload_params {}", y.offload_param == planner::OffloadDevice::cpu)
                                    : std::string("none: distributed_type MULTI_GPU keeps every parameter on the GPU"),
          x.offload_param != y.offload_param},
         {"--precision", "the precision", fmt::format("mixed_precision: {}", name_of(b.precision)), a.precision != b.precision},
         {"--checkpointing", "the checkpointing", "fsdp_config.fsdp_activation_checkpointing true: every layer",
          a.checkpointing != b.checkpointing || a.checkpoint_every != b.checkpoint_every}});
  }
  // A job DeepSpeed does not run (FSDP, pure-bf16 DDP) is planned, without --profile, under the
  // profile that runs it (one rule: planner::profile_that_runs), and says so.
  if (f.set == PlanFlagSet::one_plan && f.profile.empty()) {
    const planner::RuntimeProfile runs = planner::profile_that_runs(in.profile, in.strategy, in.training);
    if (runs != in.profile)
      r.warnings.push_back(planner::profile_switch_warning(in.strategy, in.training, runs, "--"));
    in.profile = runs;
  }
  return r;
}

std::string flag_of(planner::Knob k) {
  using planner::Knob;
  switch (k) {
    case Knob::model: return "--model";
    case Knob::lora_r: return "--lora-r";
    case Knob::quantization: return "--quant";
    case Knob::stage: return "--strategy";
    case Knob::ranks: return "--gpus";
    case Knob::offload_optimizer: return "--offload-optimizer";
    case Knob::offload_param: return "--offload-param";
    case Knob::fsdp_version: return "--fsdp-version";
    case Knob::reduce_bucket_size: return "zero_optimization.reduce_bucket_size (--ds-config)";
    case Knob::stage3_prefetch_bucket_size: return "zero_optimization.stage3_prefetch_bucket_size (--ds-config)";
    case Knob::stage3_max_live_parameters: return "zero_optimization.stage3_max_live_parameters (--ds-config)";
    case Knob::profile: return "--profile";
    case Knob::micro_batch: return "--micro-batch";
    case Knob::seq_len: return "--seq-len";
    case Knob::grad_accum: return "--grad-accum";
    case Knob::precision: return "--precision";
    case Knob::checkpointing: return "--checkpointing";
    case Knob::checkpoint_every: return "--checkpointing every-K";
    case Knob::attention: return "--attention";
    case Knob::cross_entropy: return "--cross-entropy";
    case Knob::optimizer: return "--optimizer";
    case Knob::eval_batch: return "--eval-batch";
    case Knob::gpu: return "--cluster";
    case Knob::search_gpus: return "--gpus";
    case Knob::search_stages: return "--strategy";
    case Knob::search_offload: return "offload in the search (drop --no-offload)";
    case Knob::min_micro_batch: return "--min-micro-batch";
    case Knob::global_batch: return "--global-batch";
    case Knob::max_gpus: return "--max-gpus";
    case Knob::objective: return "--objective";
  }
  return std::string(planner::field_of(k));
}

std::string with_flags(std::string warning) {
  for (int i = 0; i < planner::kNumKnobs; ++i) {
    const auto k = static_cast<planner::Knob>(i);
    const std::string field = fmt::format("({})", planner::field_of(k)), flag = fmt::format("({})", flag_of(k));
    for (std::size_t at = warning.find(field); at != std::string::npos; at = warning.find(field, at + flag.size()))
      warning.replace(at, field.size(), flag);
  }
  return printable_line(warning);  // a file's key in it may hold bytes a terminal would obey
}

void print_warnings(const std::vector<std::string>& warnings) {
  for (const auto& w : warnings) fmt::print(stderr, "warning: {}\n", with_flags(w));
}

}  // namespace peftplan::cli
