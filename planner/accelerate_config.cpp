// accelerate config YAML reader and writer (see accelerate_config.h), on yaml-cpp.
#include "peftplan/planner/accelerate_config.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include "peftplan/common/error.h"
#include "peftplan/common/json_fields.h"
#include "peftplan/common/json_file.h"

namespace peftplan::planner {
namespace {

// accelerate utils/constants.py FSDP_SHARDING_STRATEGY; its position + 1 is torch's
// ShardingStrategy value, the number `accelerate config` writes (fsdp_sharding_strategy: 1).
constexpr std::array<std::string_view, 5> kShardingNames = {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD",
                                                            "HYBRID_SHARD_ZERO2"};
constexpr std::array<Stage, 4> kShardingStages = {Stage::fsdp_full_shard, Stage::fsdp_shard_grad_op, Stage::fsdp_no_shard,
                                                  Stage::fsdp_hybrid_shard};

std::string_view sharding_name(Stage s) {
  for (std::size_t i = 0; i < kShardingStages.size(); ++i)
    if (kShardingStages[i] == s) return kShardingNames[i];
  return "?";
}

// Top-level keys that change neither memory nor time.
const std::set<std::string, std::less<>>& silent_keys() {
  static const std::set<std::string, std::less<>> k = {
      "compute_environment", "machine_rank",   "main_training_function", "rdzv_backend", "same_network",
      "main_process_ip",     "main_process_port", "gpu_ids",             "tpu_env",      "tpu_use_cluster",
      "tpu_use_sudo",        "debug",          "enable_cpu_affinity",    "dynamo_config", "use_cpu",
      "downcast_bf16",       "megatron_lm_config", "ipex_config",        "mpirun_config", "commands",
      "command_file",        "tpu_name",       "tpu_zone",               "deepspeed_config"};
  return k;
}

struct Reader {
  std::string_view source;
  std::vector<std::string>* warnings;

  std::string scalar(const YAML::Node& n, std::string_view key) const {
    if (!n.IsScalar()) throw input_error(source, key, "must be a scalar value");
    return n.Scalar();
  }
  // YAML booleans, and the strings 'true' / 'false' accelerate writes for environment variables.
  bool boolean(const YAML::Node& n, std::string_view key) const {
    std::string v = scalar(n, key);
    std::transform(v.begin(), v.end(), v.begin(), [](unsigned char c) { return std::tolower(c); });
    if (v == "true" || v == "yes" || v == "on") return true;
    if (v == "false" || v == "no" || v == "off") return false;
    throw input_error(source, key, "must be true or false", fmt::format("\"{}\"", n.Scalar()));
  }
  std::int64_t integer(const YAML::Node& n, std::string_view key, std::int64_t lo, std::int64_t hi) const {
    const std::string v = scalar(n, key);
    std::int64_t x = 0;
    std::size_t used = 0;
    try {
      x = std::stoll(v, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != v.size() || v.empty() || x < lo || x > hi)
      throw input_error(source, key, json_fields::valid_integer(lo, hi), fmt::format("\"{}\"", v));
    return x;
  }
  std::string one_of(const YAML::Node& n, std::string_view key, std::initializer_list<std::string_view> valid) const {
    const std::string v = scalar(n, key);
    for (std::string_view x : valid)
      if (v == x) return v;
    std::string list;
    for (std::string_view x : valid) list += (list.empty() ? "" : ", ") + std::string(x);
    throw input_error(source, key, "must be one of " + list, fmt::format("\"{}\"", v));
  }
  void warn(std::string msg) const { warnings->push_back(std::move(msg)); }
};

void read_fsdp(const YAML::Node& f, const Reader& r, AccelerateConfig& out) {
  if (!f.IsMap()) throw input_error(r.source, "fsdp_config", "must be a mapping of fsdp_* keys");
  Strategy& s = out.strategy;
  s.stage = Stage::fsdp_full_shard;  // FullyShardedDataParallelPlugin's default
  // The version first: it decides what the other keys mean.
  if (const YAML::Node v = f["fsdp_version"]) s.fsdp.version = static_cast<std::int32_t>(r.integer(v, "fsdp_config.fsdp_version", 1, 2));
  const bool v2 = s.fsdp.version == 2;
  for (const auto& kv : f) {
    if (!kv.first.IsScalar()) throw input_error(r.source, "fsdp_config", "has a key that is not a plain name");
    const std::string key = kv.first.as<std::string>();
    const std::string path = "fsdp_config." + key;
    const YAML::Node& v = kv.second;
    // accelerate (utils/dataclasses.py FullyShardedDataParallelPlugin, >= 1.6): under FSDP2 these
    // FSDP1 options are set to None with a warning (fsdp_sharding_strategy is read only for
    // version 1; fsdp_reshard_after_forward is FSDP2's).
    if (v2 && (key == "fsdp_sharding_strategy" || key == "fsdp_backward_prefetch" || key == "fsdp_backward_prefetch_policy" ||
               key == "fsdp_forward_prefetch" || key == "fsdp_use_orig_params" || key == "fsdp_sync_module_states")) {
      r.warn(fmt::format("{}: {} is an FSDP1 option; accelerate ignores it with fsdp_version 2", r.source, path));
      continue;
    }
    if (key == "fsdp_reshard_after_forward" && v2) {
      // FSDP2: a boolean (str_to_bool): true = FULL_SHARD, false = SHARD_GRAD_OP.
      s.stage = r.boolean(v, path) ? Stage::fsdp_full_shard : Stage::fsdp_shard_grad_op;
      continue;
    }
    if (key == "fsdp_sharding_strategy" || key == "fsdp_reshard_after_forward") {  // FSDP1 (newer accelerate: the second name)
      const std::string x = r.scalar(v, path);
      bool found = false;
      for (std::size_t i = 0; i < kShardingNames.size(); ++i)
        if (x == kShardingNames[i] || x == std::to_string(i + 1)) {
          if (i == 4)
            throw input_error(r.source, path, "HYBRID_SHARD_ZERO2 (5) is not planned; use FULL_SHARD (1), SHARD_GRAD_OP (2), "
                                              "NO_SHARD (3) or HYBRID_SHARD (4)", fmt::format("\"{}\"", x));
          s.stage = kShardingStages[i];
          found = true;
        }
      if (!found)
        throw input_error(r.source, path, "must be FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD or their numbers 1-4",
                          fmt::format("\"{}\"", x));
    } else if (key == "fsdp_offload_params") {
      s.offload_param = r.boolean(v, path) ? OffloadDevice::cpu : OffloadDevice::none;
    } else if (key == "fsdp_backward_prefetch" || key == "fsdp_backward_prefetch_policy") {
      // fsdp_backward_prefetch_policy: the key's name before accelerate 0.27 (still read, with
      // a deprecation warning, by FullyShardedDataParallelPlugin).
      const std::string x = r.one_of(v, path, {"BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH"});
      s.fsdp.backward_prefetch = x == "BACKWARD_PRE" ? FsdpPrefetch::backward_pre : x == "BACKWARD_POST" ? FsdpPrefetch::backward_post : FsdpPrefetch::none;
      if (key == "fsdp_backward_prefetch_policy") r.warn(fmt::format("{}: {} is the deprecated name of fsdp_config.fsdp_backward_prefetch", r.source, path));
    } else if (key == "fsdp_forward_prefetch") {
      s.fsdp.forward_prefetch = r.boolean(v, path);
    } else if (key == "fsdp_use_orig_params") {
      s.fsdp.use_orig_params = r.boolean(v, path);
      if (!s.fsdp.use_orig_params) r.warn(fmt::format("{}: {} false is planned as true (flat-parameter gradients are not kept across zero_grad)", r.source, path));
    } else if (key == "fsdp_cpu_ram_efficient_loading") {
      s.fsdp.cpu_ram_efficient_loading = r.boolean(v, path);
    } else if (key == "fsdp_sync_module_states") {
      s.fsdp.sync_module_states = r.boolean(v, path);
    } else if (key == "fsdp_activation_checkpointing") {
      s.fsdp.activation_checkpointing = r.boolean(v, path);
    } else if (key == "fsdp_auto_wrap_policy") {
      s.fsdp.auto_wrap_policy = r.one_of(v, path, {"TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP"});
      if (s.fsdp.auto_wrap_policy != "TRANSFORMER_BASED_WRAP")
        r.warn(fmt::format("{}: {} {} is planned as TRANSFORMER_BASED_WRAP (a unit per decoder layer)", r.source, path, s.fsdp.auto_wrap_policy));
    } else if (key == "fsdp_state_dict_type") {
      s.fsdp.state_dict_type = r.one_of(v, path, {"FULL_STATE_DICT", "LOCAL_STATE_DICT", "SHARDED_STATE_DICT"});
    } else if (key == "fsdp_version") {
      // read above
    } else if (key == "fsdp_transformer_layer_cls_to_wrap" || key == "fsdp_min_num_params") {
      // The unit is the model's decoder layer (_no_split_modules) whatever class it names.
    } else {
      r.warn(fmt::format("{}: {} is not an FSDP option peftplan models; ignored", r.source, path));
    }
  }
}

// What yaml-cpp reads and accelerate's yaml.safe_load refuses or reads otherwise, refused here
// naming the line: a key given twice (PyYAML keeps the last, yaml-cpp's lookup the first), a
// line with no "key:" (a file cut short: PyYAML "could not find expected ':'"), and a Python
// object tag (safe_load's ConstructorError).
void check_structure(const YAML::Node& node, std::string_view yaml, std::string_view source, const std::string& prefix) {
  if (node.Tag().find("python/") != std::string::npos)
    throw input_error(source, prefix, fmt::format("line {}: the tag {} makes a Python object, which accelerate's yaml.safe_load refuses",
                                                  node.Mark().line + 1, node.Tag()));
  if (node.IsSequence())
    for (const YAML::Node& e : node) check_structure(e, yaml, source, prefix);
  if (!node.IsMap()) return;
  std::set<std::string> seen;
  for (const auto& kv : node) {
    if (!kv.first.IsScalar()) continue;  // the readers refuse it, naming the map
    const std::string key = kv.first.as<std::string>();
    const std::string field = prefix.empty() ? key : prefix + "." + key;
    const YAML::Mark mark = kv.first.Mark();
    // The same key as PyYAML resolves it: a plain 1 (an int) is not a quoted "1" (a str).
    if (!seen.insert(kv.first.Tag() + '\0' + key).second)
      throw input_error(source, field, fmt::format("line {}: given twice in one mapping (accelerate would keep the last, "
                                                   "this reader the first: keep one)", mark.line + 1));
    // A block key alone on its line with no colon after it: yaml-cpp reads a null value, PyYAML
    // refuses it. (An explicit "? key" and a flow mapping's "{key}" are valid nulls.)
    if (kv.second.IsNull() && mark.pos >= 0 && static_cast<std::size_t>(mark.pos) < yaml.size()) {
      const std::size_t pos = static_cast<std::size_t>(mark.pos);
      const std::size_t bol = yaml.rfind('\n', pos) == std::string_view::npos ? 0 : yaml.rfind('\n', pos) + 1;
      const std::string_view before = yaml.substr(bol, pos - bol), after = yaml.substr(pos, yaml.find('\n', pos) - pos);
      if (before.find_first_not_of(" ") == std::string_view::npos && after.find(':') == std::string_view::npos)
        throw input_error(source, field, fmt::format("line {}: is not a \"key: value\" pair (a file cut short?)", mark.line + 1));
    }
    check_structure(kv.second, yaml, source, field);
  }
}

}  // namespace

AccelerateConfig read_accelerate_config(std::string_view yaml, std::string_view source) {
  // A YAML stream is UTF-8 of printable characters (YAML 1.2 §5.1, c-printable: no C0 control
  // but tab, line feed and carriage return); yaml-cpp does not check, so a binary or Latin-1
  // file would be read as text.
  if (const std::size_t at = first_unprintable(yaml, true); at != std::string_view::npos)
    throw input_error(source, "", fmt::format("is not YAML text: byte {} is 0x{:02x} (a YAML file is UTF-8 without control characters)", at,
                                              static_cast<unsigned char>(yaml[at])));
  YAML::Node root;
  try {
    const std::vector<YAML::Node> documents = YAML::LoadAll(std::string(yaml));
    if (documents.size() > 1)
      throw input_error(source, "", fmt::format("holds {} YAML documents; accelerate reads one (yaml.safe_load: \"expected a single "
                                                "document in the stream\")", documents.size()));
    if (!documents.empty()) root = documents.front();
  } catch (const YAML::Exception& e) {
    throw InputError(fmt::format("{}: not a valid YAML file: {} (line {}, column {})", source, e.msg, e.mark.line + 1, e.mark.column + 1));
  }
  if (!root.IsMap()) throw input_error(source, "", "must be a YAML mapping (an accelerate config file)");
  check_structure(root, yaml, source, "");
  AccelerateConfig out;
  Reader r{source, &out.warnings};
  const YAML::Node dt = root["distributed_type"];
  if (!dt) throw input_error(source, "distributed_type", "is missing (FSDP, MULTI_GPU or NO)");
  const std::string type = r.one_of(dt, "distributed_type", {"FSDP", "MULTI_GPU", "NO", "DEEPSPEED"});
  if (type == "DEEPSPEED")
    throw input_error(source, "distributed_type", "DEEPSPEED: give DeepSpeed's own config (ds_config.json) instead", "\"DEEPSPEED\"");
  out.strategy.stage = Stage::ddp;
  for (const auto& kv : root) {
    if (!kv.first.IsScalar()) throw input_error(source, "", "has a top-level key that is not a plain name");
    const std::string key = kv.first.as<std::string>();
    const YAML::Node& v = kv.second;
    if (key == "distributed_type") continue;
    if (key == "fsdp_config") {
      if (type != "FSDP") {
        r.warn(fmt::format("{}: fsdp_config is ignored with distributed_type {}", source, type));
        continue;
      }
      read_fsdp(v, r, out);
    } else if (key == "num_processes") {
      out.strategy.ranks = static_cast<std::int32_t>(r.integer(v, key, 1, kMaxRanks));
    } else if (key == "num_machines") {
      out.num_machines = static_cast<std::int32_t>(r.integer(v, key, 1, 100'000));
    } else if (key == "mixed_precision") {
      const std::string x = r.one_of(v, key, {"no", "bf16", "fp16", "fp8"});
      if (x == "fp8") throw input_error(source, key, "fp8 is not planned; use no, bf16 or fp16", "\"fp8\"");
      if (x == "bf16") out.precision = Precision::bf16_mixed;
      if (x == "fp16") out.precision = Precision::fp16_mixed;
      out.no_mixed_precision = x == "no";
    } else if (silent_keys().count(key) == 0) {
      r.warn(fmt::format("{}: {} is not an accelerate option peftplan models; ignored", source, key));
    }
  }
  if (type == "FSDP" && !root["fsdp_config"]) out.strategy.stage = Stage::fsdp_full_shard;
  if (out.strategy.ranks > 0 && out.strategy.ranks % out.num_machines != 0)
    throw input_error(source, "num_processes", fmt::format("must be a multiple of num_machines ({})", out.num_machines),
                      std::to_string(out.strategy.ranks));
  if (out.strategy.stage == Stage::fsdp_hybrid_shard && out.strategy.ranks > 0)
    out.strategy.shard_group = out.strategy.ranks / out.num_machines;
  return out;
}

AccelerateConfig read_accelerate_config_file(const std::string& path) { return read_accelerate_config(read_text_file(path), path); }

std::string write_accelerate_config(const Strategy& s, const TrainingSpec& t, std::int32_t num_machines) {
  const std::string where = "accelerate config";
  if (!is_fsdp(s.stage) && s.stage != Stage::ddp)
    throw input_error(where, "distributed_type", fmt::format("strategy.stage {} is DeepSpeed's: write its ds_config.json instead", name_of(s.stage)));
  if (s.offload_optimizer != OffloadDevice::none)
    throw input_error(where, "fsdp_config.fsdp_offload_params", "accelerate has no optimizer-only offload (strategy.offload_optimizer)");
  YAML::Emitter y;
  y << YAML::BeginMap;
  y << YAML::Key << "compute_environment" << YAML::Value << "LOCAL_MACHINE";
  y << YAML::Key << "distributed_type" << YAML::Value << (is_fsdp(s.stage) ? "FSDP" : s.ranks > 1 ? "MULTI_GPU" : "NO");
  y << YAML::Key << "downcast_bf16" << YAML::Value << YAML::SingleQuoted << "no";
  if (is_fsdp(s.stage)) {
    const FsdpKnobs& k = s.fsdp;
    y << YAML::Key << "fsdp_config" << YAML::Value << YAML::BeginMap;
    if (k.version == 2) {  // accelerate's FSDP2 keys (commands/config/cluster.py asks only these)
      if (s.stage != Stage::fsdp_full_shard && s.stage != Stage::fsdp_shard_grad_op)
        throw input_error(where, "fsdp_config.fsdp_reshard_after_forward",
                          fmt::format("FSDP2 has fsdp-full-shard and fsdp-shard-grad-op, not strategy.stage {}", name_of(s.stage)));
      y << YAML::Key << "fsdp_activation_checkpointing" << YAML::Value << fsdp_checkpoints_layers(s, t);
      y << YAML::Key << "fsdp_auto_wrap_policy" << YAML::Value << k.auto_wrap_policy;
      y << YAML::Key << "fsdp_cpu_ram_efficient_loading" << YAML::Value << k.cpu_ram_efficient_loading;
      y << YAML::Key << "fsdp_offload_params" << YAML::Value << (s.offload_param == OffloadDevice::cpu);
      y << YAML::Key << "fsdp_reshard_after_forward" << YAML::Value << (s.stage == Stage::fsdp_full_shard);
      y << YAML::Key << "fsdp_state_dict_type" << YAML::Value << k.state_dict_type;
      y << YAML::Key << "fsdp_version" << YAML::Value << 2;
      y << YAML::EndMap;
    } else {
      y << YAML::Key << "fsdp_activation_checkpointing" << YAML::Value << fsdp_checkpoints_layers(s, t);
      y << YAML::Key << "fsdp_auto_wrap_policy" << YAML::Value << k.auto_wrap_policy;
      y << YAML::Key << "fsdp_backward_prefetch" << YAML::Value
        << (k.backward_prefetch == FsdpPrefetch::backward_pre ? "BACKWARD_PRE" : k.backward_prefetch == FsdpPrefetch::backward_post ? "BACKWARD_POST" : "NO_PREFETCH");
      y << YAML::Key << "fsdp_cpu_ram_efficient_loading" << YAML::Value << k.cpu_ram_efficient_loading;
      y << YAML::Key << "fsdp_forward_prefetch" << YAML::Value << k.forward_prefetch;
      y << YAML::Key << "fsdp_offload_params" << YAML::Value << (s.offload_param == OffloadDevice::cpu);
      y << YAML::Key << "fsdp_sharding_strategy" << YAML::Value << std::string(sharding_name(s.stage));
      y << YAML::Key << "fsdp_state_dict_type" << YAML::Value << k.state_dict_type;
      y << YAML::Key << "fsdp_sync_module_states" << YAML::Value << k.sync_module_states;
      y << YAML::Key << "fsdp_use_orig_params" << YAML::Value << k.use_orig_params;
      y << YAML::Key << "fsdp_version" << YAML::Value << 1;
      y << YAML::EndMap;
    }
  }
  y << YAML::Key << "machine_rank" << YAML::Value << 0;
  y << YAML::Key << "main_training_function" << YAML::Value << "main";
  y << YAML::Key << "mixed_precision" << YAML::Value << YAML::SingleQuoted
    << (t.precision == Precision::bf16_mixed ? "bf16" : t.precision == Precision::fp16_mixed ? "fp16" : "no");
  y << YAML::Key << "num_machines" << YAML::Value << num_machines;
  y << YAML::Key << "num_processes" << YAML::Value << s.ranks;
  y << YAML::Key << "rdzv_backend" << YAML::Value << "static";
  y << YAML::Key << "same_network" << YAML::Value << true;
  y << YAML::Key << "use_cpu" << YAML::Value << false;
  y << YAML::EndMap;
  return std::string(y.c_str()) + "\n";
}

}  // namespace peftplan::planner
