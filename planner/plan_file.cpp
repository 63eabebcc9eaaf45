// plan.json in and out (see plan_file.h).
#include "peftplan/planner/plan_file.h"

#include <cmath>
#include <filesystem>

#include <fmt/format.h>

#include "peftplan/common/atomic_file.h"
#include "peftplan/common/error.h"
#include "peftplan/common/json_fields.h"
#include "peftplan/models/config.h"
#include "peftplan/planner/accelerate_config.h"
#include "peftplan/planner/launcher_config.h"
#include "peftplan/sim/program_hash.h"

namespace peftplan::planner {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

// The enumerator whose name_of() is `v`, or an InputError listing the valid names.
template <typename E, std::size_t N>
E parse_enum(const json& v, std::string_view source, std::string_view field, const std::array<E, N>& values) {
  const std::optional<E> e = v.is_string() ? from_name(v.get<std::string>(), values) : std::nullopt;
  if (!e) throw input_error(source, field, "must be one of " + names_of(values), v.dump());
  return *e;
}

// One field of plan.json by its C++ type, through the shared reader (common/json_fields.h).
template <typename T>
T get(const json& obj, const char* key, std::string_view source, std::string_view prefix, T fallback) {
  namespace jf = json_fields;
  if constexpr (std::is_same_v<T, bool>) return jf::boolean(obj, key, source, fallback, prefix);
  else if constexpr (std::is_same_v<T, std::string>) return jf::string(obj, key, source, std::move(fallback), prefix);
  else if constexpr (std::is_same_v<T, double>) return jf::number(obj, key, source, fallback, prefix);
  else if constexpr (std::is_same_v<T, std::uint64_t>) return jf::unsigned_integer(obj, key, source, fallback, prefix);
  else {
    static_assert(std::is_same_v<T, std::int64_t>, "plan.json fields are bool, string, double or 64-bit integers");
    return jf::integer(obj, key, source, fallback, prefix);
  }
}

std::int64_t positive(const json& obj, const char* key, std::string_view source, std::string_view prefix, std::int64_t fallback) {
  return json_fields::positive_integer(obj, key, source, fallback, prefix);
}

// The hash of the program make_plan builds for this input on this cluster (it takes the GPU's
// compute capability from the cluster, which picks cuBLAS's workspace size).
std::string planned_program_hash(PlanInput in, const std::optional<sim::Cluster>& cluster) {
  if (in.device_sm == 0 && cluster) in.device_sm = cluster->gpu.compute_capability;
  in.inventory = nullptr;
  return sim::program_hash_hex(build_program(in, {.names = false}).program);
}

}  // namespace

json model_source_for(const std::string& name_or_path) {
  if (models::zoo_config_text(name_or_path) != nullptr) return name_or_path;
  fs::path p(name_or_path);
  if (fs::is_directory(p)) p /= "config.json";
  return models::read_json_file(p.string());
}

json plan_file_to_json(const PlanFile& pf) {
  const PlanInput& in = pf.input;
  const TrainingSpec& t = in.training;
  json adapters = json::array();
  for (const auto& a : in.peft.adapters) {
    if (a.type != models::PeftType::lora)
      throw InputError(fmt::format("plan.json: only LoRA adapters can be written, got {}", name_of(a.type)));
    json c = models::lora_adapter_config(a, in.model.name);
    c["adapter_name"] = a.name;
    adapters.push_back(std::move(c));
  }
  json training = {{"micro_batch", t.micro_batch},
                   {"seq_len", t.seq_len},
                   {"grad_accum", t.grad_accum},
                   {"precision", name_of(t.precision)},
                   {"checkpointing", name_of(t.checkpointing)},
                   {"checkpoint_every", t.checkpoint_every},
                   {"attention", name_of(t.attention)},
                   {"cross_entropy", name_of(t.cross_entropy)},
                   {"optimizer", name_of(t.optimizer)},
                   {"checkpoint_reentrant", t.checkpoint_reentrant},
                   {"full_finetune", t.full_finetune},
                   {"base_storage", t.base_storage ? json(name_of(*t.base_storage)) : json(nullptr)}};
  // The strategy as its launcher's own file: DeepSpeed's ds_config, or accelerate's YAML where the
  // job runs without DeepSpeed (FSDP, DDP under the hf profile, DDP in pure bf16), as the launch
  // files have it.
  const bool accelerate = !launches_with_deepspeed(in);
  json ds = accelerate ? json(nullptr) : write_ds_config(in.strategy, t, pf.extras);
  const RunOptions& r = pf.run;
  json run = {{"steps", r.steps},
              {"data", r.data},
              {"data_format", r.data_format},
              {"lr", t.lr},
              {"weight_decay", t.weight_decay},
              {"clip", t.grad_clip},
              {"seed", r.seed},
              {"weights", r.weights},
              {"adapter_init", r.adapter_init},
              {"save_adapter", r.save_adapter},
              {"checkpoint_every", r.checkpoint_every},
              {"checkpoint_dir", r.checkpoint_dir},
              {"resume", r.resume},
              {"on_nonfinite", r.on_nonfinite},
              {"scheduler", !accelerate && ds.contains("scheduler") ? ds["scheduler"] : json(nullptr)}};
  json j = {{"schema", kPlanSchema},
            {"model", pf.model_source.is_null() ? json(in.model.name) : pf.model_source},
            {"model_name", in.model.name},
            {"adapters", adapters},
            {"training", training},
            {"ranks", in.strategy.ranks},
            {"profile", name_of(in.profile)},
            {"run", run}};
  if (accelerate) {
    j["accelerate_config"] = write_accelerate_config(in.strategy, t, 1);
    if (in.strategy.shard_group > 0) j["shard_group"] = in.strategy.shard_group;
  } else {
    j["ds_config"] = ds;
  }
  // bitsandbytes' quantisation of the base (QLoRA), which no adapter_config.json carries.
  if (const auto& q = in.peft.quantization)
    j["quantization"] = {{"dtype", name_of(q->dtype)}, {"double_quant", q->double_quant}, {"block_size", q->block_size}};
  if (pf.cluster) j["cluster"] = sim::cluster_to_json(*pf.cluster);
  j["program"] = {{"contract_version", sim::kProgramContractVersion}, {"hash", planned_program_hash(in, pf.cluster)}};
  return j;
}

PlanFile plan_file_from_json(const json& j, std::string_view source) {
  if (!j.is_object()) throw input_error(source, "", "must be a JSON object", j.type_name());
  const std::string schema = get<std::string>(j, "schema", source, "", "");
  if (schema != kPlanSchema)
    throw input_error(source, "schema", fmt::format("must be \"{}\"", kPlanSchema), "\"" + schema + "\"");
  PlanFile pf;
  PlanInput& in = pf.input;
  // Model: a zoo name (or a path) or an embedded config.json object.
  if (!j.contains("model")) throw input_error(source, "model", "is missing (a zoo name or a config.json object)");
  pf.model_source = j["model"];
  const std::string model_name = get<std::string>(j, "model_name", source, "", "");
  if (pf.model_source.is_string()) {
    try {  // its words, under this file's name
      in.model = models::load_model(pf.model_source.get<std::string>());
    } catch (const InputError& e) {
      throw InputError(fmt::format("{}: {}", source, e.what()));
    }
  } else if (pf.model_source.is_object()) {
    in.model = models::model_from_config(pf.model_source, fmt::format("{}: model", source), model_name.empty() ? "model" : model_name);
  } else {
    throw input_error(source, "model", "must be a zoo name or a config.json object", pf.model_source.dump());
  }
  // Adapters.
  if (auto it = j.find("adapters"); it != j.end() && !it->is_null()) {
    if (!it->is_array()) throw input_error(source, "adapters", "must be an array of adapter_config.json objects", it->dump());
    for (std::size_t i = 0; i < it->size(); ++i) {
      const json& c = (*it)[i];
      models::AdapterSpec a = models::adapter_from_config(c, fmt::format("{}: adapters[{}]", source, i));
      if (c.contains("adapter_name") && c["adapter_name"].is_string()) a.name = c["adapter_name"].get<std::string>();
      in.peft.adapters.push_back(std::move(a));
    }
  }
  // Training fields ds_config does not carry.
  const json tr = j.value("training", json::object());
  if (!tr.is_object()) throw input_error(source, "training", "must be an object", tr.dump());
  TrainingSpec& t = in.training;
  t.micro_batch = positive(tr, "micro_batch", source, "training.", t.micro_batch);
  t.seq_len = positive(tr, "seq_len", source, "training.", t.seq_len);
  t.grad_accum = positive(tr, "grad_accum", source, "training.", t.grad_accum);
  t.checkpoint_every = positive(tr, "checkpoint_every", source, "training.", t.checkpoint_every);
  if (tr.contains("precision"))
    t.precision = parse_enum(tr["precision"], source, "training.precision", kPrecisions);
  if (tr.contains("checkpointing"))
    t.checkpointing = parse_enum(tr["checkpointing"], source, "training.checkpointing", kCheckpointings);
  if (tr.contains("attention"))
    t.attention = parse_enum(tr["attention"], source, "training.attention", kAttentions);
  if (tr.contains("cross_entropy"))
    t.cross_entropy = parse_enum(tr["cross_entropy"], source, "training.cross_entropy", kCrossEntropies);
  if (tr.contains("optimizer"))
    t.optimizer = parse_enum(tr["optimizer"], source, "training.optimizer", kOptimizers);
  t.full_finetune = get<bool>(tr, "full_finetune", source, "training.", false);
  t.checkpoint_reentrant = get<bool>(tr, "checkpoint_reentrant", source, "training.", true);
  if (auto it = j.find("quantization"); it != j.end() && !it->is_null()) {
    if (!it->is_object()) throw input_error(source, "quantization", "must be an object (dtype, double_quant, block_size) or null", it->dump());
    models::Quantization q;
    const std::string d = get<std::string>(*it, "dtype", source, "quantization.", std::string(name_of(q.dtype)));
    const auto dt = parse_dtype(d);
    if (!dt || (*dt != DType::nf4 && *dt != DType::fp4 && *dt != DType::int8))
      throw input_error(source, "quantization.dtype", "must be nf4, fp4 or int8", "\"" + d + "\"");
    q.dtype = *dt;
    q.double_quant = get<bool>(*it, "double_quant", source, "quantization.", q.double_quant);
    q.block_size = positive(*it, "block_size", source, "quantization.", q.block_size);
    in.peft.quantization = q;
  }
  // A checkpoint saved quantised loads as saved (models::apply_checkpoint_quantization): a plan
  // file that says otherwise was not written by `plan`.
  if (const auto& cq = in.model.checkpoint_quantization; cq && in.peft.quantization != cq)
    throw input_error(source, "quantization",
                      fmt::format("must be the model's own ({}, its config.json's quantization_config): the checkpoint loads quantised as saved",
                                  models::describe(*cq)),
                      j.contains("quantization") ? j["quantization"].dump() : std::string("absent"));
  if (in.model.checkpoint_quantization && in.peft.adapters.empty())
    throw input_error(source, "adapters",
                      fmt::format("must hold an adapter: the model was saved quantised ({}) and transformers' Trainer refuses to fine-tune a "
                                  "purely quantised model", models::describe(*in.model.checkpoint_quantization)),
                      "none");
  if (auto it = tr.find("base_storage"); it != tr.end() && !it->is_null()) {
    auto d = it->is_string() ? parse_dtype(it->get<std::string>()) : std::nullopt;
    if (!d) throw input_error(source, "training.base_storage", "must be fp32, bf16, fp16, int8 or nf4", it->dump());
    t.base_storage = *d;
  }
  const auto ranks = static_cast<std::int32_t>(positive(j, "ranks", source, "", 1));
  // "pytorch": the `hf` profile's name in plan files written before it was renamed.
  if (j.contains("profile"))
    in.profile = j["profile"] == "pytorch" ? RuntimeProfile::hf
                                           : parse_enum(j["profile"], source, "profile", kRuntimeProfiles);
  // The run object; its scheduler replaces ds_config's.
  const json run = j.value("run", json::object());
  if (!run.is_object()) throw input_error(source, "run", "must be an object", run.dump());
  json ds = j.value("ds_config", json::object());
  if (!ds.is_object()) throw input_error(source, "ds_config", "must be a ds_config.json object", ds.dump());
  if (auto it = run.find("scheduler"); it != run.end()) {
    if (it->is_null()) ds.erase("scheduler");
    else ds["scheduler"] = *it;
  }
  RunOptions& r = pf.run;
  r.steps = positive(run, "steps", source, "run.", r.steps);
  if (auto it = j.find("accelerate_config"); it != j.end() && !it->is_null()) {
    // A plan DeepSpeed cannot run (FSDP; DDP in pure bf16): the strategy from accelerate's YAML; the training object has the rest.
    if (!it->is_string()) throw input_error(source, "accelerate_config", "must be accelerate's launch config YAML, as a string", it->dump());
    if (j.contains("ds_config")) throw input_error(source, "ds_config", "and accelerate_config cannot both be given (one launcher per plan)");
    const AccelerateConfig ac = read_accelerate_config(it->get<std::string>(), fmt::format("{}: accelerate_config", source));
    in.strategy = ac.strategy;
    in.strategy.ranks = ranks;
    in.strategy.shard_group = static_cast<std::int32_t>(get<std::int64_t>(j, "shard_group", source, "", 0));
  } else {
    DsConfigInputs dsi;
    dsi.world_size = ranks;
    dsi.training = t;
    dsi.hidden = in.model.hidden;
    dsi.total_steps = r.steps;
    DsConfig dc = read_ds_config(ds, fmt::format("{}: ds_config", source), dsi);
    in.strategy = dc.strategy;
    in.strategy.ranks = ranks;
    // ds_config carries batch sizes, optimizer hyper-parameters and clipping; fields it lacks stay.
    const TrainingSpec before = t;
    t = dc.training;
    t.seq_len = before.seq_len;
    t.checkpointing = before.checkpointing;
    t.checkpoint_every = before.checkpoint_every;
    t.checkpoint_reentrant = before.checkpoint_reentrant;
    t.attention = before.attention;
    t.base_storage = before.base_storage;
    t.full_finetune = before.full_finetune;
    pf.extras = dc.extras;
  }
  r.data = get<std::string>(run, "data", source, "run.", r.data);
  r.data_format = get<std::string>(run, "data_format", source, "run.", r.data_format);
  if (r.data_format != "u32" && r.data_format != "u16" && r.data_format != "bytes")
    throw input_error(source, "run.data_format", "must be one of u32, u16, bytes", "\"" + r.data_format + "\"");
  t.lr = get<double>(run, "lr", source, "run.", t.lr);
  t.weight_decay = get<double>(run, "weight_decay", source, "run.", t.weight_decay);
  t.grad_clip = get<double>(run, "clip", source, "run.", t.grad_clip);
  if (!(t.lr >= 0) || !std::isfinite(t.lr)) throw input_error(source, "run.lr", "must be a finite number >= 0", fmt::format("{}", t.lr));
  if (!(t.weight_decay >= 0) || !std::isfinite(t.weight_decay))
    throw input_error(source, "run.weight_decay", "must be a finite number >= 0", fmt::format("{}", t.weight_decay));
  if (!(t.grad_clip >= 0) || !std::isfinite(t.grad_clip))
    throw input_error(source, "run.clip", "must be a finite number >= 0 (0 = off)", fmt::format("{}", t.grad_clip));
  r.seed = get<std::uint64_t>(run, "seed", source, "run.", r.seed);
  r.weights = get<std::string>(run, "weights", source, "run.", r.weights);
  r.adapter_init = get<std::string>(run, "adapter_init", source, "run.", r.adapter_init);
  if (r.adapter_init.empty()) r.adapter_init = "peft";
  r.save_adapter = get<std::string>(run, "save_adapter", source, "run.", r.save_adapter);
  r.checkpoint_every = get<std::int64_t>(run, "checkpoint_every", source, "run.", r.checkpoint_every);
  if (r.checkpoint_every < 0)
    throw input_error(source, "run.checkpoint_every", "must be >= 0 (0 = no checkpoints)", std::to_string(r.checkpoint_every));
  r.checkpoint_dir = get<std::string>(run, "checkpoint_dir", source, "run.", r.checkpoint_dir);
  if (r.checkpoint_every > 0 && r.checkpoint_dir.empty())
    throw input_error(source, "run.checkpoint_dir", "must name a folder when run.checkpoint_every > 0", "\"\"");
  r.resume = get<std::string>(run, "resume", source, "run.", r.resume);
  r.on_nonfinite = get<std::string>(run, "on_nonfinite", source, "run.", r.on_nonfinite);
  if (r.on_nonfinite != "stop" && r.on_nonfinite != "skip")
    throw input_error(source, "run.on_nonfinite", "must be stop or skip", "\"" + r.on_nonfinite + "\"");
  if (auto it = j.find("cluster"); it != j.end() && !it->is_null())
    pf.cluster = sim::cluster_from_json(*it, fmt::format("{}: cluster", source));
  if (auto it = j.find("program"); it != j.end() && !it->is_null()) {
    if (!it->is_object()) throw input_error(source, "program", "must be an object", it->dump());
    const auto version = get<std::int64_t>(*it, "contract_version", source, "program.", -1);
    if (version != sim::kProgramContractVersion)
      throw input_error(source, "program.contract_version",
                        fmt::format("must be {} (the step-program contract this build reads; the plan was written by another "
                                    "version of peftplan: write it again)", sim::kProgramContractVersion),
                        std::to_string(version));
    pf.program_hash = get<std::string>(*it, "hash", source, "program.", "");
    if (pf.program_hash.size() != 16 || pf.program_hash.find_first_not_of("0123456789abcdef") != std::string::npos)
      throw input_error(source, "program.hash", "must be 16 lower-case hex digits", "\"" + pf.program_hash + "\"");
  }
  return pf;
}

void check_program_hash(const PlanFile& plan, std::string_view source) {
  if (plan.program_hash.empty()) return;
  const std::string built = planned_program_hash(plan.input, plan.cluster);
  if (built != plan.program_hash)
    throw input_error(source, "program.hash",
                      fmt::format("names the program the writer built, but this build of peftplan makes {} from the same plan: "
                                  "the two binaries disagree (rebuild both: make build), or the file was edited since (leave out its program "
                                  "section to take the plan as it reads now)", built),
                      "\"" + plan.program_hash + "\"");
}

PlanFile read_plan_file(const fs::path& path) {
  return plan_file_from_json(models::read_json_file(path.string()), path.string());
}

void write_plan_file(const fs::path& path, const PlanFile& plan) {
  write_text_atomic(path, plan_file_to_json(plan).dump(2) + "\n");
}

}  // namespace peftplan::planner
