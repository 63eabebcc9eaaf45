// ds_config.json reader and writer. The reader walks every key: modelled keys go into the specs,
// DeepSpeed keys we do not model are accepted (a warning when set away from DeepSpeed's default),
// anything else is a warning naming its key path. Wrong types, impossible values and the
// combinations DeepSpeed rejects are InputErrors naming the source, the key path and the value.
#include "peftplan/planner/ds_config.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>
#include <map>
#include <set>

#include <fmt/format.h>

#include "peftplan/common/error.h"
#include "peftplan/common/json_fields.h"

namespace peftplan::planner {

using nlohmann::json;

std::string_view name_of(SchedulerType t) {
  switch (t) {
    case SchedulerType::warmup_lr: return "WarmupLR";
    case SchedulerType::warmup_decay_lr: return "WarmupDecayLR";
    case SchedulerType::warmup_cosine_lr: return "WarmupCosineLR";
  }
  return "?";
}

namespace {

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}

std::string join(std::string_view prefix, std::string_view key) {
  return prefix.empty() ? std::string(key) : fmt::format("{}.{}", prefix, key);
}

bool is_auto(const json& v) { return v.is_string() && v.get<std::string>() == "auto"; }

// Keys DeepSpeed accepts that peftplan does not model, with DeepSpeed's code default
// (json null = "warn whenever set"; `silent` = no effect on memory or time: logging, saving).
struct Unmodelled {
  json default_value;
  bool silent = false;
};

using UnmodelledTable = std::map<std::string, Unmodelled, std::less<>>;

// Top level: deepspeed/runtime/config.py and runtime/constants.py.
const UnmodelledTable& top_unmodelled() {
  static const UnmodelledTable t = {
      {"steps_per_print", {nullptr, true}},
      {"wall_clock_breakdown", {nullptr, true}},
      {"dump_state", {nullptr, true}},
      {"memory_breakdown", {nullptr, true}},
      {"tensorboard", {nullptr, true}},
      {"wandb", {nullptr, true}},
      {"csv_monitor", {nullptr, true}},
      {"comet", {nullptr, true}},
      {"comms_logger", {nullptr, true}},
      {"flops_profiler", {nullptr, true}},
      {"timers", {nullptr, true}},
      {"checkpoint", {nullptr, true}},
      {"zero_allow_untested_optimizer", {nullptr, true}},
      {"zero_force_ds_cpu_optimizer", {nullptr, true}},
      {"prescale_gradients", {false}},
      {"gradient_predivide_factor", {1.0}},
      {"sparse_gradients", {false}},
      {"communication_data_type", {nullptr}},
      {"seq_parallel_communication_data_type", {nullptr}},
      {"data_types", {nullptr}},
      {"activation_checkpointing", {nullptr}},
      {"amp", {nullptr}},
      {"aio", {nullptr}},
      {"pipeline", {nullptr}},
      {"elasticity", {nullptr}},
      {"autotuning", {nullptr}},
      {"compression_training", {nullptr}},
      {"data_efficiency", {nullptr}},
      {"curriculum_learning", {nullptr}},
      {"sparse_attention", {nullptr}},
      {"compile", {nullptr}},
      {"nebula", {nullptr}},
      {"weight_quantization", {nullptr}},
      {"tensor_parallel", {nullptr}},
      {"hybrid_engine", {nullptr}},
      {"eigenvalue", {nullptr}},
      {"progressive_layer_drop", {nullptr}},
      {"quantize_training", {nullptr}},
      {"vocabulary_size", {nullptr, true}},
      {"disable_allgather", {false}},
      {"dataloader_drop_last", {nullptr, true}},
  };
  return t;
}

// zero_optimization: deepspeed/runtime/zero/config.py DeepSpeedZeroConfig.
const UnmodelledTable& zero_unmodelled() {
  static const UnmodelledTable t = {
      {"reduce_scatter", {true}},
      {"allgather_partitions", {true}},
      {"use_multi_rank_bucket_allreduce", {true}},
      {"load_from_fp32_weights", {true, true}},
      {"elastic_checkpoint", {false, true}},
      {"ignore_unused_parameters", {true, true}},
      {"legacy_stage1", {false}},
      {"round_robin_gradients", {false}},
      {"zero_hpz_partition_size", {1}},
      {"zero_quantized_weights", {false}},
      {"zero_quantized_nontrainable_weights", {false}},
      {"zero_quantized_gradients", {false}},
      {"zeropp_loco_param", {nullptr}},
      {"zenflow", {nullptr}},
      {"leaf_module", {nullptr}},
      {"mics_shard_size", {-1}},
      {"mics_hierarchical_params_gather", {false}},
      {"memory_efficient_linear", {true}},
      {"override_module_apply", {true, true}},
      {"stage3_module_granularity_threshold", {0}},
      {"module_granularity_threshold", {0}},
      {"stage3_model_persistence_threshold", {std::numeric_limits<std::int64_t>::max()}},
      {"model_persistence_threshold", {std::numeric_limits<std::int64_t>::max()}},
      {"stage3_use_all_reduce_for_fetch_params", {false}},
      {"use_all_reduce_for_fetch_params", {false}},
      {"stage3_allgather_sequential", {false}},
      {"allgather_sequential", {false}},
      {"stage3_partition_stream_chunk_size", {0}},
      {"partition_stream_chunk_size", {0}},
      {"stage3_gather_16bit_weights_on_model_save", {false, true}},
      {"gather_16bit_weights_on_model_save", {false, true}},
      {"stage3_gather_fp16_weights_on_model_save", {false, true}},
      {"log_trace_cache_warnings", {false, true}},
      {"enable_sanity_checks", {false, true}},
      {"pipeline_loading_checkpoint", {false, true}},
      {"save_muon_momentum_buffer_in_memory", {false, true}},
  };
  return t;
}

class Reader {
 public:
  Reader(std::string_view source, std::vector<std::string>& warnings) : source_(source), warnings_(warnings) {}

  [[noreturn]] void fail(const std::string& path, std::string_view problem, const json& got) const {
    throw input_error(source_, path, problem, got.dump());
  }
  [[noreturn]] void fail(const std::string& path, std::string_view problem) const {
    throw input_error(source_, path, problem);
  }
  void warn(const std::string& path, std::string_view what) {
    warnings_.push_back(fmt::format("{}: {} {}", source_, path, what));
  }

  const json& object(const json& v, const std::string& path) const {
    if (!v.is_object()) fail(path, "must be a JSON object", v);
    return v;
  }

  // Values by their path in the config (common/json_fields.h checks them). Integers may be
  // written as integral floats (5e8), as DeepSpeed's own configs write sizes.
  std::int64_t integer(const json& v, const std::string& path, std::string_view what = {}) const {
    return json_fields::as_integer(v, source_, path, std::numeric_limits<std::int64_t>::min(), std::numeric_limits<std::int64_t>::max(),
                                   true, what);
  }
  std::int64_t size(const json& v, const std::string& path) const {
    return json_fields::as_integer(v, source_, path, 0, std::numeric_limits<std::int64_t>::max(), true);
  }
  double number(const json& v, const std::string& path) const { return json_fields::as_number(v, source_, path); }
  bool boolean(const json& v, const std::string& path) const { return json_fields::as_boolean(v, source_, path); }
  std::string string(const json& v, const std::string& path) const { return json_fields::as_string(v, source_, path); }

  // A key DeepSpeed accepts that we do not model: warn when it is away from DeepSpeed's default.
  void unmodelled(const Unmodelled& u, const std::string& path, const json& v) {
    if (u.silent) return;
    if (!u.default_value.is_null() && v == u.default_value) return;
    if (u.default_value.is_null() && (v.is_null() || (v.is_object() && (v.empty() || v == json{{"enabled", false}}))))
      return;
    warn(path, fmt::format("= {} is not modelled by peftplan; planned as DeepSpeed's default{}", v.dump(),
                           u.default_value.is_null() ? "" : fmt::format(" ({})", u.default_value.dump())));
  }
  void unknown(const std::string& path) { warn(path, "is not a DeepSpeed config key; ignored"); }

 private:
  std::string_view source_;
  std::vector<std::string>& warnings_;
};

// --- batch sizes: deepspeed/runtime/config.py _set_batch_related_parameters + _batch_assertion.
void read_batch(Reader& r, const json& j, const DsConfigInputs& in, DsConfig& out) {
  const std::int64_t ws = in.world_size;
  auto get = [&](const char* key, std::int64_t auto_value) -> std::optional<std::int64_t> {
    if (!j.contains(key)) return std::nullopt;
    const json& v = j.at(key);
    if (is_auto(v)) return auto_value;  // HfTrainerDeepSpeedConfig.trainer_config_process fill_match
    const std::int64_t x = r.integer(v, key, "must be a positive integer or \"auto\"");
    // The planner's bounds (specs.h), named by the file's key: train_batch_size is at most their
    // product over kMaxRanks ranks, which keeps DeepSpeed's checks below inside 64 bits.
    const std::int64_t most = key == std::string_view("train_micro_batch_size_per_gpu") ? kMaxMicroBatch
                              : key == std::string_view("gradient_accumulation_steps") ? kMaxGradAccum
                                                                                         : kMaxMicroBatch * kMaxGradAccum * kMaxRanks;
    if (x > most) r.fail(key, fmt::format("must be at most {} (the largest the planner plans)", most), v);
    return x;
  };
  // transformers: train_batch_size = world_size * per_device_train_batch_size * gradient_accumulation_steps
  std::optional<std::int64_t> train_batch = get("train_batch_size", ws * in.training.micro_batch * in.training.grad_accum);
  std::optional<std::int64_t> micro_batch = get("train_micro_batch_size_per_gpu", in.training.micro_batch);
  std::optional<std::int64_t> grad_acc = get("gradient_accumulation_steps", in.training.grad_accum);

  // _set_batch_related_parameters: Python floor division on the given values.
  auto floordiv = [](std::int64_t a, std::int64_t b) {
    std::int64_t q = a / b;
    if ((a % b != 0) && ((a < 0) != (b < 0))) --q;
    return q;
  };
  if (train_batch && micro_batch && grad_acc) {
  } else if (train_batch && micro_batch) {
    if (*micro_batch == 0) r.fail("train_micro_batch_size_per_gpu", "must be a positive integer", json(*micro_batch));
    grad_acc = floordiv(floordiv(*train_batch, *micro_batch), ws);
  } else if (train_batch && grad_acc) {
    if (*grad_acc == 0) r.fail("gradient_accumulation_steps", "must be a positive integer", json(*grad_acc));
    micro_batch = floordiv(floordiv(*train_batch, ws), *grad_acc);
  } else if (micro_batch && grad_acc) {
    train_batch = *micro_batch * *grad_acc * ws;
  } else if (train_batch) {
    grad_acc = 1;
    micro_batch = floordiv(*train_batch, ws);
  } else if (micro_batch) {
    train_batch = *micro_batch * ws;
    grad_acc = 1;
  } else {
    r.fail("train_batch_size",
           "is missing: DeepSpeed says \"Either train_batch_size or train_micro_batch_size_per_gpu needs to be "
           "provided\" (give one, or \"auto\" to take it from the flags)");
  }
  // _batch_assertion, DeepSpeed's messages verbatim.
  if (*train_batch <= 0)
    r.fail("train_batch_size", fmt::format("is invalid: DeepSpeed says \"Train batch size: {} has to be greater than 0\"",
                                           *train_batch));
  if (*micro_batch <= 0)
    r.fail("train_micro_batch_size_per_gpu",
           fmt::format("is invalid: DeepSpeed says \"Micro batch size per gpu: {} has to be greater than 0\"",
                       *micro_batch));
  if (*grad_acc <= 0)
    r.fail("gradient_accumulation_steps",
           fmt::format("is invalid: DeepSpeed says \"Gradient accumulation steps: {} has to be greater than 0\"",
                       *grad_acc));
  if (*train_batch != *micro_batch * *grad_acc * ws)
    r.fail("train_batch_size",
           fmt::format("does not match: DeepSpeed says \"Check batch related parameters. train_batch_size is not "
                       "equal to micro_batch_per_gpu * gradient_acc_step * world_size {} != {} * {} * {}\"",
                       *train_batch, *micro_batch, *grad_acc, ws));
  if (*micro_batch > kMaxMicroBatch)
    r.fail("train_batch_size", fmt::format("gives a micro-batch of {} per GPU (train_batch_size / (gradient_accumulation_steps × {} "
                                           "ranks)), more than the {} sequences the planner plans",
                                           *micro_batch, ws, kMaxMicroBatch),
           json(*train_batch));
  if (*grad_acc > kMaxGradAccum)
    r.fail("train_batch_size", fmt::format("gives {} accumulation steps, more than the {} the planner plans", *grad_acc, kMaxGradAccum),
           json(*train_batch));
  out.train_batch_size = *train_batch;
  out.training.micro_batch = *micro_batch;
  out.training.grad_accum = *grad_acc;
}

}  // namespace

std::string ds_precision_keys(Precision p) {
  switch (p) {
    case Precision::fp16_mixed: return "fp16.enabled true: fp16";
    case Precision::bf16_mixed: return "bf16.enabled true with fp32 master weights: bf16";
    case Precision::bf16_pure: return "bf16.enabled with bf16_master_weights_and_grads and bf16_optimizer_states: bf16-pure";
    case Precision::fp32: break;
  }
  return "neither fp16 nor bf16 enabled: fp32";
}

namespace {

// --- fp16 / bf16: deepspeed/runtime/constants.py, runtime/precision_config.py. With the Trainer's
// own precision given (in.precision_given), a section the file leaves out counts as "auto":
// accelerate adds it, enabled, for the Trainer's fp16 or bf16 (utils/dataclasses.py
// DeepSpeedPlugin.set_mixed_precision: `if "bf16" not in ds_config: ds_config["bf16"] =
// {"enabled": True}`). Otherwise a missing section is off, DeepSpeed's default.
void read_precision(Reader& r, const json& j, const DsConfigInputs& in, DsConfig& out) {
  const Precision given = in.training.precision;
  const bool trainer = in.precision_given;
  const bool fp16_implied = trainer && given == Precision::fp16_mixed && !j.contains("fp16");
  const bool bf16_implied =
      trainer && (given == Precision::bf16_mixed || given == Precision::bf16_pure) && !j.contains("bf16") && !j.contains("bfloat16");
  bool fp16 = fp16_implied, bf16 = bf16_implied;
  bool bf16_master = false, bf16_states = false;
  LossScaling& ls = out.extras.loss_scaling;
  if (j.contains("fp16")) {
    const json& s = r.object(j.at("fp16"), "fp16");
    for (const auto& [key, v] : s.items()) {
      const std::string path = join("fp16", key);
      if (key == "enabled") fp16 = is_auto(v) ? given == Precision::fp16_mixed : r.boolean(v, path);
      else if (key == "loss_scale") {
        ls.loss_scale = r.number(v, path);
        if (ls.loss_scale < 0) r.fail(path, "must be >= 0 (0 = dynamic)", v);
      } else if (key == "initial_scale_power") ls.initial_scale_power = r.size(v, path);
      else if (key == "loss_scale_window") ls.loss_scale_window = r.size(v, path);
      else if (key == "hysteresis") ls.hysteresis = r.size(v, path);
      else if (key == "consecutive_hysteresis") ls.consecutive_hysteresis = r.boolean(v, path);
      else if (key == "min_loss_scale") {
        ls.min_loss_scale = r.number(v, path);
        if (ls.min_loss_scale < 0) r.fail(path, "must be >= 0", v);
      } else if (key == "auto_cast") r.unmodelled({false}, path, v);
      else if (key == "fp16_master_weights_and_grads") r.unmodelled({false}, path, v);
      else r.unknown(path);
    }
  }
  for (const char* section : {"bf16", "bfloat16"}) {  // "bfloat16": DeepSpeed's older spelling
    if (!j.contains(section)) continue;
    const json& s = r.object(j.at(section), section);
    for (const auto& [key, v] : s.items()) {
      const std::string path = join(section, key);
      if (key == "enabled")
        bf16 = is_auto(v) ? (given == Precision::bf16_mixed || given == Precision::bf16_pure) : r.boolean(v, path);
      else if (key == "bf16_master_weights_and_grads") bf16_master = r.boolean(v, path);
      else if (key == "bf16_optimizer_states") bf16_states = r.boolean(v, path);
      else if (key == "immediate_grad_update" || key == "check_grad_overflow") r.boolean(v, path);
      else r.unknown(path);
    }
  }
  if (fp16 && (bf16_implied || fp16_implied) && bf16) {
    const char* set = fp16_implied ? "bf16" : "fp16";
    const char* trainers = fp16_implied ? "fp16" : "bf16";
    r.fail(std::string(set) + ".enabled",
           fmt::format("is true, and the Trainer's own {} (training.precision) would enable {} beside it: accelerate says "
                       "\"`--mixed_precision` arg cannot be set to `{}` when `{}` is set in the DeepSpeed config file.\"; give one",
                       trainers, trainers, trainers, set));
  }
  if (fp16 && bf16)
    r.fail("fp16.enabled",
           "and bf16.enabled are both true: DeepSpeed says \"bfloat16 and fp16 modes cannot be simultaneously "
           "enabled\"; enable one");
  if (bf16_states && !bf16_master)
    r.fail("bf16.bf16_optimizer_states",
           "is true without bf16_master_weights_and_grads: DeepSpeed says \"bf16_optimizer_states requires "
           "bf16_master_weights_and_grads to be enabled.\"");
  if (fp16) out.training.precision = Precision::fp16_mixed;
  else if (bf16 && bf16_master && bf16_states) out.training.precision = Precision::bf16_pure;
  else if (bf16) {
    out.training.precision = Precision::bf16_mixed;
    if (bf16_master)
      r.warn("bf16.bf16_master_weights_and_grads",
             "= true with fp32 optimizer states is not modelled; planned as bf16 mixed precision");
  } else {
    out.training.precision = Precision::fp32;
    if (given != Precision::fp32 && !trainer && !j.contains("fp16") && !j.contains("bf16") && !j.contains("bfloat16"))
      r.warn("fp16", "and bf16 sections are absent: DeepSpeed trains in fp32, so the plan uses fp32 (give --precision for the "
                     "Trainer's bf16 or fp16, which accelerate adds)");
  }
}

// --- optimizer: deepspeed/runtime/config.py get_optimizer_name/params (type matched lower-case).
void read_optimizer(Reader& r, const json& j, DsExtras& extras, TrainingSpec& t) {
  const json& s = r.object(j, "optimizer");
  std::string type;
  for (const auto& [key, v] : s.items()) {
    if (key == "type") type = r.string(v, "optimizer.type");
    else if (key != "params") r.unknown(join("optimizer", key));
  }
  if (!s.contains("type")) r.fail("optimizer.type", "is required when an optimizer section is given");
  const std::string lt = lower(type);
  if (lt == "adam" || lt == "adamw") t.optimizer = Optimizer::adamw;
  else if (lt == "sgd") t.optimizer = Optimizer::sgd_momentum;
  else {
    r.warn("optimizer.type", fmt::format("= \"{}\" is not modelled; planned as AdamW (two fp32 moments)", type));
    t.optimizer = Optimizer::adamw;
  }
  if (!s.contains("params")) return;
  const json& p = r.object(s.at("params"), "optimizer.params");
  for (const auto& [key, v] : p.items()) {
    const std::string path = join("optimizer.params", key);
    const bool a = is_auto(v);  // HfTrainerDeepSpeedConfig fills these from TrainingArguments
    if (key == "lr") {
      if (!a) t.lr = r.number(v, path);
      if (t.lr < 0) r.fail(path, "must be >= 0", v);
    } else if (key == "betas") {
      if (a) continue;
      if (!v.is_array() || v.size() != 2 || !v[0].is_number() || !v[1].is_number())
        r.fail(path, "must be a list of two numbers [beta1, beta2]", v);
      t.adam_beta1 = v[0].get<double>();
      t.adam_beta2 = v[1].get<double>();
    } else if (key == "eps") {
      if (!a) t.adam_eps = r.number(v, path);
    } else if (key == "weight_decay") {
      if (!a) t.weight_decay = r.number(v, path);
    } else if (key == "momentum" && t.optimizer == Optimizer::sgd_momentum) {
      extras.sgd_momentum = r.number(v, path);
    } else if (key == "adam_w_mode") {
      r.unmodelled({true}, path, v);
    } else if (key == "torch_adam" || key == "bias_correction" || key == "fused" || key == "foreach") {
      // implementation choices with the same states
    } else if (key == "amsgrad") {
      r.unmodelled({false}, path, v);
    } else {
      r.warn(path, "is not modelled; ignored");
    }
  }
}

// --- scheduler: deepspeed/runtime/lr_schedules.py (WarmupLR, WarmupDecayLR, WarmupCosineLR).
void read_scheduler(Reader& r, const json& j, const DsConfigInputs& in, DsExtras& extras, const TrainingSpec& t) {
  const json& s = r.object(j, "scheduler");
  std::string type;
  for (const auto& [key, v] : s.items()) {
    if (key == "type") type = r.string(v, "scheduler.type");
    else if (key != "params") r.unknown(join("scheduler", key));
  }
  SchedulerSpec sc;
  if (type == "WarmupLR") sc.type = SchedulerType::warmup_lr;
  else if (type == "WarmupDecayLR") sc.type = SchedulerType::warmup_decay_lr;
  else if (type == "WarmupCosineLR") sc.type = SchedulerType::warmup_cosine_lr;
  else {
    r.warn("scheduler.type", fmt::format("= \"{}\" is not modelled (WarmupLR, WarmupDecayLR, WarmupCosineLR "
                                         "are); the plan uses a constant learning rate",
                                         type));
    return;
  }
  const json empty = json::object();
  const json& p = s.contains("params") ? r.object(s.at("params"), "scheduler.params") : empty;
  const bool cosine = sc.type == SchedulerType::warmup_cosine_lr;
  for (const auto& [key, v] : p.items()) {
    const std::string path = join("scheduler.params", key);
    const bool a = is_auto(v);
    if (key == "warmup_min_lr" && !cosine) sc.warmup_min_lr = a ? 0.0 : r.number(v, path);  // fill_only(..., 0)
    else if (key == "warmup_max_lr" && !cosine) sc.warmup_max_lr = a ? t.lr : r.number(v, path);
    else if (key == "warmup_num_steps") {
      if (a) {
        if (!in.warmup_steps) r.fail(path, "is \"auto\" but the number of warmup steps is not known; give a number", v);
        sc.warmup_num_steps = *in.warmup_steps;
      } else {
        sc.warmup_num_steps = r.size(v, path);
      }
    } else if (key == "warmup_type") {
      sc.warmup_type = r.string(v, path);
      if (sc.warmup_type != "log" && sc.warmup_type != "linear") r.fail(path, "must be \"log\" or \"linear\"", v);
    } else if (key == "total_num_steps" && sc.type != SchedulerType::warmup_lr) {
      if (a) {
        if (!in.total_steps) r.fail(path, "is \"auto\" but the number of training steps is not known; give a number", v);
        sc.total_num_steps = *in.total_steps;
      } else {
        sc.total_num_steps = r.size(v, path);
      }
    } else if (key == "warmup_min_ratio" && cosine) sc.warmup_min_ratio = r.number(v, path);
    else if (key == "cos_min_ratio" && cosine) sc.cos_min_ratio = r.number(v, path);
    else if (key == "last_batch_iteration") {
      // resume position; not a property of the plan
    } else r.unknown(path);
  }
  if (sc.type != SchedulerType::warmup_lr && !sc.total_num_steps)
    r.fail("scheduler.params.total_num_steps", fmt::format("is required by {}", type));
  extras.scheduler = sc;
}

OffloadDevice offload_device(Reader& r, const json& v, const std::string& path) {
  const std::string d = lower(r.string(v, path));
  if (d == "none") return OffloadDevice::none;
  if (d == "cpu") return OffloadDevice::cpu;
  if (d == "nvme") r.fail(path, "\"nvme\" is not supported, use cpu or none", v);
  r.fail(path, "must be \"cpu\" or \"none\"", v);
}

// --- zero_optimization: deepspeed/runtime/zero/config.py and offload_config.py.
void read_zero(Reader& r, const json& z, const DsConfigInputs& in, DsConfig& out) {
  Strategy& st = out.strategy;
  DeepSpeedKnobs& k = st.ds;
  if (z.is_boolean()) {  // read_zero_config_deprecated: true => stage 1
    r.warn("zero_optimization", "as a boolean is DeepSpeed's deprecated format; read as stage 1 (true) or 0");
    st.stage = z.get<bool>() ? Stage::zero1 : Stage::ddp;
    return;
  }
  r.object(z, "zero_optimization");
  const std::string zp = "zero_optimization";

  std::int64_t stage = 0;
  if (z.contains("stage")) {
    const json& v = z.at("stage");
    stage = r.integer(v, zp + ".stage", "must be 0, 1, 2 or 3");
    if (stage < 0 || stage > 3) r.fail(zp + ".stage", "must be 0, 1, 2 or 3", v);
  }
  st.stage = stage == 0 ? Stage::ddp : stage == 1 ? Stage::zero1 : stage == 2 ? Stage::zero2 : Stage::zero3;

  // "auto" entries transformers fills from the model's hidden size (trainer_config_finalize).
  auto hidden_auto = [&](const std::string& path, const json& v, std::int64_t value_if_known) -> std::int64_t {
    if (!in.hidden) r.fail(path, "is \"auto\" but the model hidden size is not known; give a number", v);
    return value_if_known;
  };
  const std::int64_t H = in.hidden.value_or(0);

  std::optional<OffloadDevice> opt_dev, param_dev;
  std::optional<bool> opt_pin, param_pin;
  std::optional<double> ratio;
  bool legacy_opt = false, legacy_param = false;

  for (const auto& [key, v] : z.items()) {
    const std::string path = join(zp, key);
    if (key == "stage") continue;
    if (key == "reduce_bucket_size") {
      k.reduce_bucket_size = is_auto(v) ? hidden_auto(path, v, H * H) : r.size(v, path);  // h*h
    } else if (key == "allgather_bucket_size") {
      k.allgather_bucket_size = r.size(v, path);
    } else if (key == "overlap_comm") {
      k.overlap_comm = v.is_null() ? std::nullopt : std::optional<bool>(r.boolean(v, path));
    } else if (key == "contiguous_gradients") {
      k.contiguous_gradients = r.boolean(v, path);
    } else if (key == "stage3_prefetch_bucket_size" || key == "prefetch_bucket_size") {
      // int(0.9 * hidden_size * hidden_size)
      k.stage3_prefetch_bucket_size =
          is_auto(v) ? hidden_auto(path, v, static_cast<std::int64_t>(0.9 * static_cast<double>(H) * static_cast<double>(H)))
                     : r.size(v, path);
    } else if (key == "stage3_param_persistence_threshold" || key == "param_persistence_threshold") {
      k.stage3_param_persistence_threshold = is_auto(v) ? hidden_auto(path, v, 10 * H) : r.size(v, path);  // 10*h
    } else if (key == "stage3_max_live_parameters" || key == "max_live_parameters") {
      k.stage3_max_live_parameters = r.size(v, path);
    } else if (key == "stage3_max_reuse_distance" || key == "max_reuse_distance") {
      k.stage3_max_reuse_distance = r.size(v, path);
    } else if (key == "sub_group_size") {
      k.sub_group_size = r.size(v, path);
    } else if (key == "offload_optimizer" || key == "offload_param") {
      if (v.is_null()) continue;
      const bool is_opt = key == "offload_optimizer";
      for (const auto& [ok, ov] : r.object(v, path).items()) {
        const std::string op = join(path, ok);
        if (ok == "device") (is_opt ? opt_dev : param_dev) = offload_device(r, ov, op);
        else if (ok == "pin_memory") (is_opt ? opt_pin : param_pin) = r.boolean(ov, op);
        else if (is_opt && ok == "ratio") {
          ratio = r.number(ov, op);
          if (*ratio < 0.0 || *ratio > 1.0) r.fail(op, "must be between 0 and 1", ov);
        } else if (ok == "nvme_path" || ok == "buffer_count" || ok == "buffer_size" || ok == "max_in_cpu" ||
                   (is_opt && (ok == "fast_init" || ok == "pipeline_read" || ok == "pipeline_write" ||
                               ok == "pipeline" || ok == "convert_grad_on_cpu" || ok == "cpuadam_cores_perc"))) {
          // NVMe buffers and CPU-Adam implementation details: no effect on the plan
        } else if (is_opt && ok == "super_offload") {
          r.unmodelled({false}, op, ov);
        } else {
          r.unknown(op);
        }
      }
    } else if (key == "cpu_offload") {  // deprecated: new_param offload_optimizer {device: cpu}
      legacy_opt = r.boolean(v, path);
      r.warn(path, "is deprecated in DeepSpeed; use offload_optimizer: {\"device\": \"cpu\"}");
    } else if (key == "cpu_offload_param") {  // deprecated: new_param offload_param {device: cpu}
      legacy_param = r.boolean(v, path);
      r.warn(path, "is deprecated in DeepSpeed; use offload_param: {\"device\": \"cpu\"}");
    } else if (key == "cpu_offload_use_pin_memory") {  // deprecated with set_new_param=False
      r.boolean(v, path);
      r.warn(path, "is deprecated and ignored by DeepSpeed; use offload_optimizer/offload_param pin_memory");
    } else if (auto it = zero_unmodelled().find(key); it != zero_unmodelled().end()) {
      r.unmodelled(it->second, path, v);
    } else {
      r.unknown(path);
    }
  }
  if (legacy_opt) {
    if (opt_dev) r.fail(zp + ".cpu_offload", "and offload_optimizer cannot both be given (DeepSpeed rejects it)");
    opt_dev = OffloadDevice::cpu;
  }
  if (legacy_param) {
    if (param_dev) r.fail(zp + ".cpu_offload_param", "and offload_param cannot both be given (DeepSpeed rejects it)");
    param_dev = OffloadDevice::cpu;
  }
  st.offload_optimizer = opt_dev.value_or(OffloadDevice::none);
  st.offload_param = param_dev.value_or(OffloadDevice::none);
  if (st.offload_param == OffloadDevice::cpu && !can_offload_params(st.stage))
    r.fail(zp + ".offload_param.device",
           fmt::format("\"cpu\" needs ZeRO stage 3 (parameter offload is stage 3 only), got stage {}", stage));
  if (st.offload_optimizer == OffloadDevice::cpu && !can_offload_optimizer(st.stage))
    r.fail(zp + ".offload_optimizer.device", "\"cpu\" needs ZeRO stage 1, 2 or 3, got stage 0");
  if (ratio && *ratio < 1.0) {
    if (st.stage != Stage::zero3)
      r.fail(zp + ".offload_optimizer.ratio",
             "< 1 is rejected by DeepSpeed: \"Partial offloading only supported for ZeRO Stage 3.\"", json(*ratio));
    r.warn(zp + ".offload_optimizer.ratio", fmt::format("= {} (partial offload) is not modelled; planned as 1.0", *ratio));
  }
  if (opt_pin && param_pin && *opt_pin != *param_pin)
    r.warn(zp + ".offload_param.pin_memory",
           "differs from offload_optimizer.pin_memory; peftplan models one pin_memory and uses offload_optimizer's");
  k.offload_pin_memory = opt_pin ? *opt_pin : param_pin.value_or(false);
}

}  // namespace

DsConfig read_ds_config(const json& config, std::string_view source, const DsConfigInputs& inputs) {
  if (inputs.world_size < 1) throw input_error(source, "world size", "must be at least 1", fmt::format("{}", inputs.world_size));
  DsConfig out;
  out.training = inputs.training;
  out.strategy.ranks = inputs.world_size;
  Reader r(source, out.warnings);
  r.object(config, "(top level)");

  static const std::set<std::string, std::less<>> handled = {
      "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "fp16", "bf16",
      "bfloat16", "optimizer", "scheduler", "gradient_clipping", "zero_optimization"};
  for (const auto& [key, v] : config.items()) {
    if (handled.contains(key)) continue;
    if (auto it = top_unmodelled().find(key); it != top_unmodelled().end()) r.unmodelled(it->second, key, v);
    else r.unknown(key);
  }

  read_batch(r, config, inputs, out);
  read_precision(r, config, inputs, out);
  if (config.contains("optimizer") && !config.at("optimizer").is_null())
    read_optimizer(r, config.at("optimizer"), out.extras, out.training);
  if (config.contains("scheduler") && !config.at("scheduler").is_null())
    read_scheduler(r, config.at("scheduler"), inputs, out.extras, out.training);

  // gradient_clipping: runtime/constants.py GRADIENT_CLIPPING_DEFAULT = 0. ("auto" <- max_grad_norm)
  out.training.grad_clip = 0.0;
  if (config.contains("gradient_clipping")) {
    const json& v = config.at("gradient_clipping");
    out.training.grad_clip = is_auto(v) ? inputs.training.grad_clip : r.number(v, "gradient_clipping");
    if (out.training.grad_clip < 0) r.fail("gradient_clipping", "must be >= 0 (0 = off)", v);
  }

  if (config.contains("zero_optimization")) read_zero(r, config.at("zero_optimization"), inputs, out);

  if (out.training.precision == Precision::bf16_pure && out.strategy.stage == Stage::ddp)
    r.fail("bf16.bf16_master_weights_and_grads",
           "needs ZeRO: DeepSpeed says \"Bf16_master_weights_and_grads is only supported with ZeRO Stage 1, 2, or "
           "3.\"");
  return out;
}

nlohmann::json write_ds_config(const Strategy& s, const TrainingSpec& t, const DsExtras& x) {
  const std::string where = "ds_config.json";
  if (s.ranks < 1) throw input_error(where, "world size", "must be at least 1", fmt::format("{}", s.ranks));
  if (is_fsdp(s.stage))
    throw input_error(where, "zero_optimization.stage", "has no FSDP sharding strategy: DeepSpeed runs ZeRO (ddp, zero1-3)",
                      fmt::format("strategy.stage {}", name_of(s.stage)));
  if (t.micro_batch < 1) throw input_error(where, "train_micro_batch_size_per_gpu", "must be a positive integer", fmt::format("{}", t.micro_batch));
  if (t.grad_accum < 1) throw input_error(where, "gradient_accumulation_steps", "must be a positive integer", fmt::format("{}", t.grad_accum));
  if (s.offload_param != OffloadDevice::none && !can_offload_params(s.stage))
    throw input_error(where, "zero_optimization.offload_param", "needs ZeRO stage 3");
  if (s.offload_optimizer != OffloadDevice::none && !can_offload_optimizer(s.stage))
    throw input_error(where, "zero_optimization.offload_optimizer", "needs ZeRO stage 1, 2 or 3");
  if (t.precision == Precision::bf16_pure && s.stage == Stage::ddp)
    throw input_error(where, "bf16.bf16_master_weights_and_grads",
                      "(pure bf16) needs ZeRO stage 1, 2 or 3 in DeepSpeed");

  json j = json::object();
  // DeepSpeed's rule: train_batch_size = micro_batch_per_gpu * gradient_acc_step * world_size.
  j["train_batch_size"] = t.micro_batch * t.grad_accum * s.ranks;
  j["train_micro_batch_size_per_gpu"] = t.micro_batch;
  j["gradient_accumulation_steps"] = t.grad_accum;
  j["gradient_clipping"] = t.grad_clip;

  const LossScaling& ls = x.loss_scaling;
  const bool fp16 = t.precision == Precision::fp16_mixed;
  if (fp16 || ls != LossScaling{}) {
    j["fp16"] = {{"enabled", fp16},
                 {"loss_scale", ls.loss_scale},
                 {"initial_scale_power", ls.initial_scale_power},
                 {"loss_scale_window", ls.loss_scale_window},
                 {"hysteresis", ls.hysteresis},
                 {"consecutive_hysteresis", ls.consecutive_hysteresis},
                 {"min_loss_scale", ls.min_loss_scale}};
  }
  // fp32 says so: a missing section would be enabled for a Trainer run in bf16 or fp16.
  if (t.precision == Precision::fp32) {
    if (!j.contains("fp16")) j["fp16"] = {{"enabled", false}};
    j["bf16"] = {{"enabled", false}};
  }
  if (t.precision == Precision::bf16_mixed) j["bf16"] = {{"enabled", true}};
  if (t.precision == Precision::bf16_pure)
    j["bf16"] = {{"enabled", true}, {"bf16_master_weights_and_grads", true}, {"bf16_optimizer_states", true}};

  switch (t.optimizer) {
    case Optimizer::adamw:
      j["optimizer"] = {{"type", "AdamW"},
                        {"params",
                         {{"lr", t.lr},
                          {"betas", {t.adam_beta1, t.adam_beta2}},
                          {"eps", t.adam_eps},
                          {"weight_decay", t.weight_decay}}}};
      break;
    case Optimizer::sgd_momentum:
      j["optimizer"] = {{"type", "SGD"},
                        {"params", {{"lr", t.lr}, {"momentum", x.sgd_momentum}, {"weight_decay", t.weight_decay}}}};
      // ZeRO refuses an optimizer outside its tested list (Adam, AdamW, Adagrad, Lion and their
      // DeepSpeed kernels) unless told otherwise: deepspeed/runtime/engine.py,
      // _configure_zero_optimizer, zero_allow_untested_optimizer.
      if (s.stage != Stage::ddp) j["zero_allow_untested_optimizer"] = true;
      break;
    case Optimizer::adamw_8bit:
      // bitsandbytes AdamW8bit is not constructible from ds_config: the client passes it in.
      if (s.stage != Stage::ddp) j["zero_allow_untested_optimizer"] = true;
      break;
  }

  if (x.scheduler) {
    const SchedulerSpec& sc = *x.scheduler;
    json p = json::object();
    if (sc.type == SchedulerType::warmup_cosine_lr) {
      p["warmup_min_ratio"] = sc.warmup_min_ratio;
      p["cos_min_ratio"] = sc.cos_min_ratio;
    } else {
      p["warmup_min_lr"] = sc.warmup_min_lr;
      p["warmup_max_lr"] = sc.warmup_max_lr;
    }
    p["warmup_num_steps"] = sc.warmup_num_steps;
    p["warmup_type"] = sc.warmup_type;
    if (sc.type != SchedulerType::warmup_lr) {
      if (!sc.total_num_steps)
        throw input_error(where, "scheduler.params.total_num_steps", fmt::format("is required by {}", name_of(sc.type)));
      p["total_num_steps"] = *sc.total_num_steps;
    }
    j["scheduler"] = {{"type", name_of(sc.type)}, {"params", p}};
  }

  const DeepSpeedKnobs& k = s.ds;
  auto device = [](OffloadDevice d) { return d == OffloadDevice::cpu ? "cpu" : "none"; };
  json z = {{"stage", static_cast<int>(s.stage)},
            {"offload_optimizer", {{"device", device(s.offload_optimizer)}, {"pin_memory", k.offload_pin_memory}}},
            {"reduce_bucket_size", k.reduce_bucket_size},
            {"allgather_bucket_size", k.allgather_bucket_size},
            {"contiguous_gradients", k.contiguous_gradients},
            {"stage3_prefetch_bucket_size", k.stage3_prefetch_bucket_size},
            {"stage3_param_persistence_threshold", k.stage3_param_persistence_threshold},
            {"stage3_max_live_parameters", k.stage3_max_live_parameters},
            {"stage3_max_reuse_distance", k.stage3_max_reuse_distance},
            {"sub_group_size", k.sub_group_size}};
  if (s.stage == Stage::zero3)
    z["offload_param"] = {{"device", device(s.offload_param)}, {"pin_memory", k.offload_pin_memory}};
  if (k.overlap_comm) z["overlap_comm"] = *k.overlap_comm;
  j["zero_optimization"] = z;
  return j;
}

}  // namespace peftplan::planner
