// PEFT adapters: adapter_config.json parsing, target-module resolution with PEFT's matching rules
// (peft/tuners/tuners_utils.py check_target_module_exists, _maybe_include_all_linear_layers) and
// the trainable inventory with the tensor names PEFT saves (get_peft_model_state_dict drops the
// adapter name: "...q_proj.lora_A.default.weight" is saved as "...q_proj.lora_A.weight").
#include "peftplan/models/peft.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <re2/re2.h>

#include "peftplan/common/error.h"
#include "peftplan/common/json_fields.h"
#include "peftplan/common/units.h"

namespace peftplan::models {
namespace {

using nlohmann::json;

constexpr const char* kPrefix = "base_model.model.";

// TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING (peft/utils/constants.py).
std::vector<std::string> default_lora_targets(Arch a) {
  switch (a) {
    case Arch::phi3: return {"qkv_proj"};
    case Arch::gpt2: return {"c_attn"};
    case Arch::gpt_neox:
    case Arch::falcon: return {"query_key_value"};
    default: return {"q_proj", "v_proj"};
  }
}

// TRANSFORMERS_MODELS_TO_IA3_TARGET_MODULES_MAPPING and ..._FEEDFORWARD_MODULES_MAPPING.
std::pair<std::vector<std::string>, std::vector<std::string>> default_ia3(Arch a, std::string_view src) {
  switch (a) {
    case Arch::llama:
    case Arch::mistral:
    case Arch::qwen2: return {{"k_proj", "v_proj", "down_proj"}, {"down_proj"}};
    case Arch::gpt2: return {{"c_attn", "mlp.c_proj"}, {"mlp.c_proj"}};
    case Arch::gpt_neox:
    case Arch::falcon: return {{"query_key_value", "dense_4h_to_h"}, {"dense_4h_to_h"}};
    case Arch::opt: return {{"q_proj", "v_proj", "fc2"}, {"fc2"}};
    default:
      throw input_error(src, "target_modules", fmt::format("must be given for IA3 on model_type {} "
                                                           "(PEFT has no default for it)", name_of(a)));
  }
}

// PEFT matches module paths with Python's re (re.fullmatch for a target_modules string;
// re.match of "(.*\.)?(p)$" for a rank_pattern or alpha_pattern key: tuners_utils.py
// check_target_module_exists, utils/other.py get_pattern_key). A backtracking engine takes time
// exponential in the path for patterns such as "(.*.*)*xq" — std::regex spent over a minute on
// one adapter config — so peftplan compiles every pattern with RE2, whose matching is linear in
// the path and never recurses (github.com/google/re2/wiki/WhyRE2). RE2 has no lookaround and no
// backreferences; such a pattern is refused by module_regex's caller with RE2's reason.
// Compiled once per pattern text and kept (sweep and the explorer plan from several threads);
// the cache forgets everything past kRegexCache patterns, so a long fuzzing run or a sweep over
// generated adapters does not grow it without bound.
struct CompiledRegex {
  std::unique_ptr<re2::RE2> re;  // null when the pattern is invalid
  std::string error;             // RE2's reason when it is
};

std::shared_ptr<const CompiledRegex> module_regex(const std::string& pattern) {
  constexpr std::size_t kRegexCache = 1024;
  static std::mutex mu;
  static std::map<std::string, std::shared_ptr<const CompiledRegex>> cache;
  {
    const std::lock_guard<std::mutex> lock(mu);
    if (auto it = cache.find(pattern); it != cache.end()) return it->second;
  }
  re2::RE2::Options o;
  o.set_log_errors(false);
  auto c = std::make_shared<CompiledRegex>();
  c->re = std::make_unique<re2::RE2>(pattern, o);
  if (!c->re->ok()) {
    c->error = c->re->error();
    c->re.reset();
  }
  const std::lock_guard<std::mutex> lock(mu);
  if (cache.size() >= kRegexCache) cache.clear();
  return cache.emplace(pattern, std::move(c)).first->second;
}

// Throws the InputError naming the file and field when `pattern` does not compile.
void check_regex(const std::string& pattern, std::string_view src, const std::string& field) {
  const auto c = module_regex(pattern);
  if (!c->re)
    throw input_error(src, field,
                      fmt::format("is not a regular expression peftplan can match ({}; lookarounds and backreferences are "
                                  "not supported: list the modules instead)",
                                  c->error),
                      "\"" + pattern + "\"");
}

bool regex_full(const std::string& pattern, const std::string& key) {
  const auto c = module_regex(pattern);
  return c->re && re2::RE2::FullMatch(key, *c->re);
}

// List semantics: exact key or ".name" suffix.
bool list_match(const std::vector<std::string>& names, const std::string& key) {
  for (const auto& t : names)
    if (key == t || (key.size() > t.size() && key.ends_with(t) && key[key.size() - t.size() - 1] == '.'))
      return true;
  return false;
}

bool selector_match(const ModuleSelector& s, const std::string& key) {
  switch (s.kind) {
    case ModuleSelector::Kind::none: return false;
    case ModuleSelector::Kind::regex: return regex_full(s.regex, key);
    case ModuleSelector::Kind::list: return list_match(s.names, key);
    case ModuleSelector::Kind::all_linear: return false;  // resolved before matching
  }
  return false;
}

// The container of a layer index in a module path: "model.layers.3.mlp" -> ("layers", 3).
std::optional<std::pair<std::string, std::int64_t>> layer_of(const std::string& key) {
  static const re2::RE2 re(R"((?:.*\.)?([^.]*)\.(\d+)\..*)");
  std::string list, index;
  // more than 18 digits could overflow std::stoll's int64
  if (!re2::RE2::FullMatch(key, re, &list, &index) || index.size() > 18) return std::nullopt;
  return std::make_pair(list, std::stoll(index));
}

// A rank_pattern or alpha_pattern key as the regex PEFT matches it with.
std::string pattern_regex(const std::string& key) { return "(.*\\.)?(" + key + ")"; }

// get_pattern_key: a pattern applies when it equals the key or matches "(.*\.)?(pattern)$".
template <typename T>
std::optional<T> pattern_value(const std::map<std::string, T>& patterns, const std::string& key) {
  for (const auto& [p, v] : patterns)
    if (p == key || regex_full(pattern_regex(p), key)) return v;
  return std::nullopt;
}

ModuleSelector parse_selector(const json& v, std::string_view src, const char* field) {
  ModuleSelector s;
  if (v.is_null()) return s;
  if (v.is_string()) {
    std::string text = v.get<std::string>();
    if (text == "all-linear") {
      s.kind = ModuleSelector::Kind::all_linear;
      return s;
    }
    check_regex(text, src, field);
    s.kind = ModuleSelector::Kind::regex;
    s.regex = text;
    return s;
  }
  if (v.is_array()) {
    s.kind = ModuleSelector::Kind::list;
    for (const auto& e : v) {
      if (!e.is_string()) throw input_error(src, field, "must hold module names (strings)", e.dump());
      s.names.push_back(e.get<std::string>());
    }
    if (s.names.empty()) s.kind = ModuleSelector::Kind::none;
    return s;
  }
  throw input_error(src, field, "must be a list of module names, a regex string or \"all-linear\"", v.dump());
}

// target_modules: as parse_selector, but an empty list is refused. PEFT keeps it (a set, not
// None), so no default applies and injection raises "Target modules set() not found in the base
// model" (tuners_utils.py inject_adapter). (An empty exclude_modules excludes nothing.)
ModuleSelector parse_targets(const json& v, std::string_view src) {
  if (v.is_array() && v.empty())
    throw input_error(src, "target_modules", "must name at least one module (PEFT finds none in an empty list); leave it out for PEFT's defaults", "[]");
  return parse_selector(v, src, "target_modules");
}

std::vector<std::string> string_list(const json& c, std::string_view src, const char* field) {
  std::vector<std::string> out;
  auto it = c.find(field);
  if (it == c.end() || it->is_null()) return out;
  if (it->is_string()) return {it->get<std::string>()};
  if (!it->is_array()) throw input_error(src, field, "must be a list of strings", it->dump());
  for (const auto& e : *it) {
    if (!e.is_string()) throw input_error(src, field, "must be a list of strings", e.dump());
    out.push_back(e.get<std::string>());
  }
  return out;
}


std::string leaf_names(const std::vector<LinearModule>& linears) {
  std::set<std::string> leaves;
  for (const auto& l : linears) leaves.insert(l.leaf);
  std::string s;
  for (const auto& l : leaves) s += (s.empty() ? "" : ", ") + l;
  return s;
}

// The modules an adapter with these selectors adapts, in model order.
std::vector<const LinearModule*> select_modules(const ModelSpec& model, const std::vector<LinearModule>& linears,
                                                ModuleSelector targets, const ModuleSelector& exclude,
                                                const std::optional<std::vector<std::int64_t>>& layers,
                                                const std::optional<std::string>& layers_pattern,
                                                const std::string& adapter, const std::string& source) {
  const std::string where = source.empty() ? fmt::format("adapter \"{}\"", adapter) : fmt::format("{} (adapter \"{}\")", source, adapter);
  if (targets.kind == ModuleSelector::Kind::all_linear) {
    // _maybe_include_all_linear_layers: the leaf names of every Linear except the output layer.
    std::set<std::string> leaves;
    for (const auto& l : linears)
      if (!l.is_output) leaves.insert(l.leaf);
    targets.kind = ModuleSelector::Kind::list;
    targets.names.assign(leaves.begin(), leaves.end());
  }
  // A listed name that matches no module is not an error as long as another one matches
  // (PEFT's BaseTuner.inject_adapter raises only when nothing was targeted): a config written
  // for several architectures loads. unmatched_target_warnings() names them.
  std::vector<const LinearModule*> out;
  for (const auto& l : linears) {
    if (selector_match(exclude, l.path)) continue;
    if (!selector_match(targets, l.path)) continue;
    // layers_to_transform applies to list targets only (check_target_module_exists).
    if (layers && targets.kind == ModuleSelector::Kind::list && !(targets.names.size() == 1 && targets.names[0] == l.path)) {
      auto lay = layer_of(l.path);
      if (!lay) continue;
      if (layers_pattern && lay->first != *layers_pattern) continue;
      if (std::find(layers->begin(), layers->end(), lay->second) == layers->end()) continue;
    }
    out.push_back(&l);
  }
  if (out.empty())
    throw input_error(where, "target_modules",
                      fmt::format("{}match no module of {} (its linear modules: {})",
                                  targets.kind == ModuleSelector::Kind::regex  ? fmt::format("\"{}\" ", targets.regex)
                                  : targets.kind == ModuleSelector::Kind::list ? fmt::format("\"{}\" ", fmt::join(targets.names, "\", \""))
                                                                               : std::string(),
                                  model.name, leaf_names(linears)));
  return out;
}

// The names of a list selector that match no Linear of the model.
std::vector<std::string> unmatched_names(const ModuleSelector& targets, const std::vector<LinearModule>& linears) {
  std::vector<std::string> out;
  if (targets.kind != ModuleSelector::Kind::list) return out;
  for (const auto& t : targets.names)
    if (std::none_of(linears.begin(), linears.end(), [&](const LinearModule& l) { return list_match({t}, l.path); })) out.push_back(t);
  return out;
}

std::vector<const LinearModule*> lora_selection(const ModelSpec& model, const std::vector<LinearModule>& linears,
                                                const AdapterSpec& a) {
  ModuleSelector targets = a.lora.targets;
  if (targets.kind == ModuleSelector::Kind::none) {
    targets.kind = ModuleSelector::Kind::list;
    targets.names = default_lora_targets(model.arch);
  }
  return select_modules(model, linears, targets, a.lora.exclude, a.lora.layers_to_transform, a.lora.layers_pattern,
                        a.name, a.source);
}

// modules_to_save: every module path that equals or ends with ".name" (ModulesToSaveWrapper).
void add_modules_to_save(const ModelSpec& model, const std::vector<std::string>& names, const AdapterSpec& a,
                         const std::vector<TensorInfo>& base, std::vector<TrainableTensor>& out) {
  for (const auto& name : names) {
    bool found = false;
    for (const auto& t : base) {
      if (!list_match({name}, t.module)) continue;
      found = true;
      out.push_back({std::string(kPrefix) + t.name, t.shape, a.name, t.module, t.layer, false});
    }
    if (!found && (name == "lm_head" || name == "embed_out") && model.tie_embeddings) {
      // A tied head owns no tensor; its copy is a fresh [V, H] parameter.
      for (const auto& t : base)
        if (t.role == ParamRole::embedding) {
          out.push_back({std::string(kPrefix) + name + ".weight", t.shape, a.name, name, -1, false});
          found = true;
        }
    }
    if (!found) throw input_error(a.source.empty() ? fmt::format("adapter \"{}\"", a.name) : fmt::format("{} (adapter \"{}\")", a.source, a.name),
                                  "modules_to_save",
                                  fmt::format("names \"{}\", which {} does not have", name, model.name));
  }
}

}  // namespace

std::string_view name_of(PeftType t) {
  switch (t) {
    case PeftType::lora: return "LORA";
    case PeftType::ia3: return "IA3";
    case PeftType::prefix_tuning: return "PREFIX_TUNING";
    case PeftType::prompt_tuning: return "PROMPT_TUNING";
  }
  return "?";
}

AdapterSpec adapter_from_config(const json& c, std::string_view src) {
  if (!c.is_object()) throw input_error(src, "", "must hold a JSON object (a PEFT adapter_config.json)");
  AdapterSpec a;
  a.source = std::string(src);
  auto pt = c.find("peft_type");
  std::string type = pt != c.end() && pt->is_string() ? pt->get<std::string>() : "";
  if (type.empty() && c.contains("r")) type = "LORA";
  if (type == "LORA") {
    a.type = PeftType::lora;
    LoraConfig& l = a.lora;
    l.r = json_fields::integer(c, "r", src, 8, "", 1, kMaxLoraRank);
    l.alpha = json_fields::number(c, "lora_alpha", src, 8.0);
    l.dropout = json_fields::number(c, "lora_dropout", src, 0.0);
    if (l.dropout < 0.0 || l.dropout >= 1.0)
      throw input_error(src, "lora_dropout", "must be in [0, 1)", fmt::format("{}", l.dropout));
    if (c.contains("target_modules")) l.targets = parse_targets(c["target_modules"], src);
    if (c.contains("exclude_modules")) l.exclude = parse_selector(c["exclude_modules"], src, "exclude_modules");
    if (auto it = c.find("layers_to_transform"); it != c.end() && !it->is_null()) {
      std::vector<std::int64_t> layers;
      if (it->is_number_integer()) layers.push_back(it->get<std::int64_t>());
      else if (it->is_array())
        for (const auto& e : *it) {
          layers.push_back(json_fields::as_integer(e, src, "layers_to_transform", 0, std::numeric_limits<std::int64_t>::max(), false,
                                                   "must hold non-negative layer indices"));
        }
      else throw input_error(src, "layers_to_transform", "must be an integer or a list of integers", it->dump());
      if (!layers.empty()) l.layers_to_transform = layers;
    }
    if (auto it = c.find("layers_pattern"); it != c.end() && !it->is_null()) {
      if (it->is_string()) l.layers_pattern = it->get<std::string>();
      else if (it->is_array() && it->size() == 1 && (*it)[0].is_string()) l.layers_pattern = (*it)[0].get<std::string>();
      else throw input_error(src, "layers_pattern", "must be a module-list name such as \"layers\"", it->dump());
    }
    for (const char* pattern : {"rank_pattern", "alpha_pattern"})
      if (auto it = c.find(pattern); it != c.end() && !it->is_null() && !it->is_object())
        throw input_error(src, pattern, "must be an object from a module-name pattern to a value", it->dump());
    if (auto it = c.find("rank_pattern"); it != c.end() && it->is_object())
      for (const auto& [k, v] : it->items()) {
        check_regex(pattern_regex(k), src, "rank_pattern." + k);
        l.rank_pattern[k] = json_fields::as_integer(v, src, "rank_pattern." + k, 1, kMaxLoraRank);
      }
    if (auto it = c.find("alpha_pattern"); it != c.end() && it->is_object())
      for (const auto& [k, v] : it->items()) {
        check_regex(pattern_regex(k), src, "alpha_pattern." + k);
        l.alpha_pattern[k] = json_fields::as_number(v, src, "alpha_pattern." + k);
      }
    l.use_rslora = json_fields::boolean(c, "use_rslora", src, false);
    l.use_dora = json_fields::boolean(c, "use_dora", src, false);
    l.lora_bias = json_fields::boolean(c, "lora_bias", src, false);
    if (auto it = c.find("bias"); it != c.end() && !it->is_null()) {
      std::string b = it->is_string() ? it->get<std::string>() : "";
      if (b != "none" && b != "all" && b != "lora_only")
        throw input_error(src, "bias", "must be \"none\", \"all\" or \"lora_only\"", it->dump());
      l.bias = b;
    }
    l.modules_to_save = string_list(c, src, "modules_to_save");
  } else if (type == "IA3") {
    a.type = PeftType::ia3;
    if (c.contains("target_modules")) a.ia3.targets = parse_targets(c["target_modules"], src);
    a.ia3.feedforward_modules = string_list(c, src, "feedforward_modules");
    // IA3Config.__post_init__: "`feedforward_modules` should be a subset of `target_modules`"
    // (checked only when both are lists, compared as sets; a regex string is not).
    if (a.ia3.targets.kind == ModuleSelector::Kind::list && c.contains("feedforward_modules") && c["feedforward_modules"].is_array())
      for (const std::string& f : a.ia3.feedforward_modules)
        if (std::find(a.ia3.targets.names.begin(), a.ia3.targets.names.end(), f) == a.ia3.targets.names.end())
          throw input_error(src, "feedforward_modules", fmt::format("must be a subset of target_modules ({}): {} is not in it",
                                                                    fmt::join(a.ia3.targets.names, ", "), f),
                            fmt::format("\"{}\"", f));
    a.ia3.modules_to_save = string_list(c, src, "modules_to_save");
  } else if (type == "PREFIX_TUNING" || type == "PROMPT_TUNING") {
    a.type = type == "PREFIX_TUNING" ? PeftType::prefix_tuning : PeftType::prompt_tuning;
    a.prompt.num_virtual_tokens = json_fields::integer(c, "num_virtual_tokens", src, 20, "", 1, kMaxVirtualTokens);
    // PeftModel sets 2 for encoder-decoder models and 1 otherwise (peft_model.py _setup_prompt_encoder).
    a.prompt.num_transformer_submodules = json_fields::integer(c, "num_transformer_submodules", src, 1, "", 1, 2);
    a.prompt.prefix_projection = json_fields::boolean(c, "prefix_projection", src, false);
    a.prompt.encoder_hidden_size = json_fields::integer(c, "encoder_hidden_size", src, 0, "", 1, kMaxVirtualTokens);
  } else {
    throw input_error(src, "peft_type", "must be one of LORA, IA3, PREFIX_TUNING, PROMPT_TUNING",
                      pt == c.end() ? std::string("nothing") : pt->dump());
  }
  return a;
}

std::vector<LoraModule> lora_modules(const ModelSpec& model, const PeftSpec& peft) {
  return lora_modules(model, peft, linear_modules(model));
}

std::vector<LoraModule> lora_modules(const ModelSpec& model, const PeftSpec& peft, const std::vector<LinearModule>& linears) {
  std::vector<LoraModule> out;
  for (const auto& a : peft.adapters) {
    if (a.type != PeftType::lora) continue;
    for (const LinearModule* l : lora_selection(model, linears, a)) {
      LoraModule m;
      m.linear = *l;
      m.adapter = a.name;
      m.r = pattern_value(a.lora.rank_pattern, l->path).value_or(a.lora.r);
      double alpha = pattern_value(a.lora.alpha_pattern, l->path).value_or(a.lora.alpha);
      // peft/tuners/lora/layer.py update_layer: scaling = alpha / sqrt(r) with rsLoRA, else alpha / r.
      m.scale = a.lora.use_rslora ? alpha / std::sqrt(static_cast<double>(m.r)) : alpha / static_cast<double>(m.r);
      m.dropout = a.lora.dropout;
      out.push_back(std::move(m));
    }
  }
  return out;
}

std::vector<std::string> unmatched_target_warnings(const ModelSpec& model, const PeftSpec& peft) {
  const std::vector<LinearModule> linears = linear_modules(model);
  std::vector<std::string> out;
  for (const auto& a : peft.adapters) {
    const ModuleSelector* targets = a.type == PeftType::lora ? &a.lora.targets : a.type == PeftType::ia3 ? &a.ia3.targets : nullptr;
    if (!targets) continue;
    const std::string where = a.source.empty() ? fmt::format("adapter \"{}\"", a.name) : fmt::format("{} (adapter \"{}\")", a.source, a.name);
    for (const auto& name : unmatched_names(*targets, linears))
      out.push_back(fmt::format("{}: target_modules names \"{}\", which {} does not have; PEFT adapts what the other names match and "
                                "ignores it (its linear modules: {})", where, name, model.name, leaf_names(linears)));
  }
  return out;
}

std::string describe(const Quantization& q) {
  if (q.dtype == DType::int8) return "bitsandbytes int8 (LLM.int8())";
  return fmt::format("bitsandbytes {}{}", name_of(q.dtype), q.double_quant ? " with double quantisation" : "");
}

std::vector<std::string> apply_checkpoint_quantization(const ModelSpec& model, PeftSpec& peft, bool quant_asked) {
  const auto& q = model.checkpoint_quantization;
  if (!q) return {};
  if (peft.adapters.empty())
    throw InputError(fmt::format("{} was saved quantised ({}, its config.json's quantization_config): transformers' Trainer refuses to "
                                 "fine-tune a purely quantised model; train an adapter (--lora-r or --peft; in the explorer, a LoRA rank above 0) or "
                                 "plan the unquantised checkpoint",
                                 model.name, describe(*q)));
  std::vector<std::string> out;
  if (quant_asked && peft.quantization != q)
    out.push_back(fmt::format("{} was saved quantised (its config.json's quantization_config), and transformers loads it that way whatever "
                              "is asked: planned as {}, not {}",
                              model.name, describe(*q), peft.quantization ? describe(*peft.quantization) : std::string("unquantised")));
  peft.quantization = q;
  return out;
}

std::vector<TrainableTensor> trainable_tensors(const ModelSpec& model, const PeftSpec& peft) {
  const auto base = parameter_tensors(model);
  return trainable_tensors(model, peft, base, linear_modules(model, base));
}

std::vector<TrainableTensor> trainable_tensors(const ModelSpec& model, const PeftSpec& peft,
                                               const std::vector<TensorInfo>& base,
                                               const std::vector<LinearModule>& linears) {
  std::vector<TrainableTensor> out;
  std::set<std::string> names;
  for (const auto& a : peft.adapters)
    if (!names.insert(a.name).second)
      throw input_error("peft", "adapters[].name", "must be unique across adapters", "\"" + a.name + "\" twice");
  // Tensor names carry the adapter name only when several adapters are trained together.
  auto tag = [&](const AdapterSpec& a, std::string_view kind) {
    return peft.adapters.size() > 1 ? fmt::format("{}.{}", kind, a.name) : std::string(kind);
  };
  const auto loras = lora_modules(model, peft, linears);
  for (const auto& a : peft.adapters) {
    switch (a.type) {
      case PeftType::lora: {
        std::set<std::string> adapted;
        for (const auto& m : loras) {
          if (m.adapter != a.name) continue;
          const auto& l = m.linear;
          const std::string p = std::string(kPrefix) + l.path + ".";
          adapted.insert(l.path);
          out.push_back({p + tag(a, "lora_A") + ".weight", {m.r, l.in}, a.name, l.path, l.layer, false});   // [r, in]
          out.push_back({p + tag(a, "lora_B") + ".weight", {l.out, m.r}, a.name, l.path, l.layer, false});  // [out, r]
          if (a.lora.lora_bias) out.push_back({p + tag(a, "lora_B") + ".bias", {l.out}, a.name, l.path, l.layer, false});
          if (a.lora.use_dora)  // DoRA magnitude, one per output feature (lora/dora.py)
            out.push_back({p + tag(a, "lora_magnitude_vector"), {l.out}, a.name, l.path, l.layer, false});
        }
        // bias="all": every base bias trains; "lora_only": biases of adapted modules.
        if (a.lora.bias != "none")
          for (const auto& t : base)
            if ((t.role == ParamRole::linear_bias || t.role == ParamRole::norm_bias) &&
                (a.lora.bias == "all" || (t.role == ParamRole::linear_bias && adapted.count(t.module))))
              out.push_back({std::string(kPrefix) + t.name, t.shape, a.name, t.module, t.layer, true});
        add_modules_to_save(model, a.lora.modules_to_save, a, base, out);
        break;
      }
      case PeftType::ia3: {
        ModuleSelector targets = a.ia3.targets;
        std::vector<std::string> ff = a.ia3.feedforward_modules;
        if (targets.kind == ModuleSelector::Kind::none) {
          auto [t, f] = default_ia3(model.arch, fmt::format("adapter \"{}\"", a.name));
          targets.kind = ModuleSelector::Kind::list;
          targets.names = t;
          if (ff.empty()) ff = f;
        }
        for (const LinearModule* l : select_modules(model, linears, targets, {}, std::nullopt, std::nullopt, a.name, a.source)) {
          // IA3Layer: feedforward modules scale the input (1, in), others the output (out, 1).
          bool is_ff = list_match(ff, l->path);
          std::vector<std::int64_t> shape = is_ff ? std::vector<std::int64_t>{1, l->in} : std::vector<std::int64_t>{l->out, 1};
          out.push_back({std::string(kPrefix) + l->path + "." + tag(a, "ia3_l"), shape, a.name, l->path, l->layer, false});
        }
        add_modules_to_save(model, a.ia3.modules_to_save, a, base, out);
        break;
      }
      case PeftType::prompt_tuning: {
        // PromptEmbedding: Embedding(n_vt * num_transformer_submodules, token_dim = H).
        const auto& p = a.prompt;
        out.push_back({tag(a, "prompt_embeddings"), {p.num_virtual_tokens * p.num_transformer_submodules, model.hidden},
                       a.name, "prompt_encoder", -1, false});
        break;
      }
      case PeftType::prefix_tuning: {
        // PrefixEncoder: Embedding(n_vt, L * 2 * token_dim); with projection an MLP
        // Embedding(n_vt, token_dim) -> Linear(token_dim, enc) -> Tanh -> Linear(enc, L * 2 * token_dim).
        const auto& p = a.prompt;
        const std::int64_t token_dim = model.hidden;
        const std::int64_t width = model.layers * 2 * token_dim;
        if (!p.prefix_projection) {
          out.push_back({tag(a, "prompt_embeddings"), {p.num_virtual_tokens, width}, a.name, "prompt_encoder", -1, false});
        } else {
          const std::int64_t enc = p.encoder_hidden_size > 0 ? p.encoder_hidden_size : token_dim;
          const std::string q = "prompt_encoder." + a.name + ".";
          out.push_back({q + "embedding.weight", {p.num_virtual_tokens, token_dim}, a.name, "prompt_encoder", -1, false});
          out.push_back({q + "transform.0.weight", {enc, token_dim}, a.name, "prompt_encoder", -1, false});
          out.push_back({q + "transform.0.bias", {enc}, a.name, "prompt_encoder", -1, false});
          out.push_back({q + "transform.2.weight", {width, enc}, a.name, "prompt_encoder", -1, false});
          out.push_back({q + "transform.2.bias", {width}, a.name, "prompt_encoder", -1, false});
        }
        break;
      }
    }
  }
  return out;
}

ParamCounts count_params(const ModelSpec& model, const PeftSpec& peft) {
  ParamCounts c;
  const BaseCounts base = count_base(model);
  c.total_params = base.total;
  c.active_params = base.active;
  if (peft.adapters.empty()) {  // full fine-tuning: everything trains
    c.trainable_params = c.all_params = base.total;
  } else {
    std::int64_t added = 0;
    for (const auto& t : trainable_tensors(model, peft)) {
      c.trainable_params += t.numel();
      if (!t.is_base_param) added += t.numel();
    }
    c.all_params = base.total + added;
  }
  c.trainable_percent = c.all_params > 0 ? 100.0 * static_cast<double>(c.trainable_params) /
                                               static_cast<double>(c.all_params)
                                         : 0.0;
  return c;
}

std::string peft_summary_line(const ParamCounts& c) {
  // peft_model.py print_trainable_parameters:
  // f"trainable params: {trainable_params:,d} || all params: {all_param:,d} || trainable%: {100 * trainable_params / all_param:.4f}"
  return fmt::format("trainable params: {} || all params: {} || trainable%: {:.4f}", with_commas(c.trainable_params),
                     with_commas(c.all_params), c.trainable_percent);
}

json lora_adapter_config(const AdapterSpec& a, const std::string& base_model) {
  const LoraConfig& l = a.lora;
  json targets;
  switch (l.targets.kind) {
    case ModuleSelector::Kind::none: targets = nullptr; break;
    case ModuleSelector::Kind::list: targets = l.targets.names; break;
    case ModuleSelector::Kind::regex: targets = l.targets.regex; break;
    case ModuleSelector::Kind::all_linear: targets = "all-linear"; break;
  }
  json layers = l.layers_to_transform ? json(*l.layers_to_transform) : json(nullptr);
  // Keys of a file saved by PEFT (docs/source/developer_guides/checkpoint.md).
  return json{{"alpha_pattern", l.alpha_pattern},
              {"auto_mapping", nullptr},
              {"base_model_name_or_path", base_model},
              {"bias", l.bias},
              {"fan_in_fan_out", false},
              {"inference_mode", true},
              {"init_lora_weights", true},
              {"layer_replication", nullptr},
              {"layers_pattern", l.layers_pattern ? json(*l.layers_pattern) : json(nullptr)},
              {"layers_to_transform", layers},
              {"loftq_config", json::object()},
              {"lora_alpha", l.alpha},
              {"lora_bias", l.lora_bias},
              {"lora_dropout", l.dropout},
              {"megatron_config", nullptr},
              {"megatron_core", "megatron.core"},
              {"modules_to_save", l.modules_to_save.empty() ? json(nullptr) : json(l.modules_to_save)},
              {"peft_type", "LORA"},
              {"r", l.r},
              {"rank_pattern", l.rank_pattern},
              {"revision", nullptr},
              {"target_modules", targets},
              {"task_type", "CAUSAL_LM"},
              {"use_dora", l.use_dora},
              {"use_rslora", l.use_rslora}};
}

}  // namespace peftplan::models
