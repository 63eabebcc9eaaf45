// config.json -> ModelSpec for the architectures in Arch, with transformers' defaults and field
// aliases (GPT-2's n_embd/n_layer/n_head, Falcon's n_head_kv/multi_query, OPT's ffn_dim).
// Defaults cite the transformers configuration_*.py that sets them.
#include "peftplan/models/config.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include <limits>

#include <fmt/format.h>
#include <openssl/evp.h>

#include "peftplan/common/error.h"
#include "peftplan/common/json_file.h"
#include "peftplan/common/json_fields.h"
#include "peftplan/models/parameters.h"

namespace peftplan::models {
namespace {

using nlohmann::json;

struct ArchName {
  std::string_view name;
  Arch arch;
};
constexpr ArchName kArchNames[] = {
    {"llama", Arch::llama},   {"mistral", Arch::mistral}, {"mixtral", Arch::mixtral},
    {"qwen2", Arch::qwen2},   {"gemma", Arch::gemma},     {"gemma2", Arch::gemma2},
    {"phi3", Arch::phi3},     {"gpt2", Arch::gpt2},       {"gpt_neox", Arch::gpt_neox},
    {"falcon", Arch::falcon}, {"opt", Arch::opt},
};

std::string valid_arch_list() {
  std::string s;
  for (const auto& a : kArchNames) s += (s.empty() ? "" : ", ") + std::string(a.name);
  return s;
}

// Reads the first present key among `keys`; nullopt when all are absent or null.
const json* find_field(const json& c, std::initializer_list<const char*> keys, const char** found) {
  for (const char* k : keys)
    if (const json* v = json_fields::find(c, k)) {
      *found = k;
      return v;
    }
  return nullptr;
}

// The largest value each count may take: well above every published model (Llama-3.1-405B:
// 126 layers, hidden 16,384, 128 heads, vocab 128,256, intermediate 53,248; Gemma's 256,000-token
// vocabulary), and small enough that the planner's products of them (layers x hidden^2 x 12, vocab
// x hidden, batch x heads x sequence^2) stay inside 64 bits.
struct Limit {
  std::string_view key;
  std::int64_t max;
};
constexpr Limit kLimits[] = {
    {"hidden_size", 1 << 20},          {"n_embd", 1 << 20},          {"d_model", 1 << 20},
    {"num_hidden_layers", 10'000},     {"n_layer", 10'000},          {"num_layers", 10'000},
    {"num_attention_heads", 1 << 16},  {"n_head", 1 << 16},          {"num_key_value_heads", 1 << 16},
    {"num_kv_heads", 1 << 16},         {"n_head_kv", 1 << 16},       {"head_dim", 1 << 16},
    {"vocab_size", 1 << 24},           {"intermediate_size", 1 << 24}, {"n_inner", 1 << 24},
    {"ffn_hidden_size", 1 << 24},      {"ffn_dim", 1 << 24},         {"max_position_embeddings", 1 << 26},
    {"n_positions", 1 << 26},          {"sliding_window", 1 << 26},  {"num_local_experts", 1 << 12},
    {"num_experts_per_tok", 1 << 12},  {"word_embed_proj_dim", 1 << 20}, {"num_ln_in_parallel_attn", 2},
};

std::optional<std::int64_t> get_int(const json& c, std::string_view src,
                                    std::initializer_list<const char*> keys) {
  const char* key = nullptr;
  const json* v = find_field(c, keys, &key);
  if (!v) return std::nullopt;
  std::int64_t max = std::numeric_limits<std::int32_t>::max();
  for (const auto& l : kLimits)
    if (l.key == key) max = l.max;
  return json_fields::as_integer(*v, src, key, 1, max);
}

std::int64_t require_int(const json& c, std::string_view src, std::initializer_list<const char*> keys) {
  auto v = get_int(c, src, keys);
  if (!v) {
    std::string names;
    for (const char* k : keys) names += (names.empty() ? "" : " or ") + std::string(k);
    throw input_error(src, names, "is required but missing");
  }
  return *v;
}

double get_double(const json& c, std::string_view src, std::initializer_list<const char*> keys,
                  double fallback) {
  const char* key = nullptr;
  const json* v = find_field(c, keys, &key);
  if (!v) return fallback;
  return json_fields::as_number(*v, src, key);
}

// config.json's quantization_config: a checkpoint saved quantised, read as transformers reads it.
// AutoQuantizationConfig.from_dict (quantizers/auto.py): a truthy load_in_4bit or load_in_8bit
// makes it bitsandbytes whatever quant_method says; otherwise quant_method picks the quantizer
// ("bitsandbytes" alone is an unknown type, none at all is refused). BitsAndBytesConfig
// (utils/quantization_config.py): both load flags at once is a ValueError; bnb_4bit_quant_type
// defaults to "fp4", bnb_4bit_use_double_quant to false, bnb_4bit_quant_storage to "uint8".
// llm_int8_skip_modules replaces the default list (lm_head) when given
// (HfQuantizer.get_modules_to_not_convert), and _replace_with_bnb_linear
// (integrations/bitsandbytes.py) keeps a Linear whole when its name or path equals an entry or
// an entry followed by "." occurs in its path. The planner quantises every Linear but the LM head,
// so a list that keeps another Linear whole, or leaves the LM head out, is refused rather than
// planned wrong.
std::optional<Quantization> read_quantization_config(const json& c, std::string_view src, ModelSpec& m) {
  const json* qc = json_fields::find(c, "quantization_config");
  if (!qc) return std::nullopt;
  if (!qc->is_object()) throw input_error(src, "quantization_config", "must be an object (transformers' quantization config)", qc->dump());
  constexpr std::string_view kPrefix = "quantization_config.";
  const bool four = json_fields::boolean(*qc, "load_in_4bit", src, false, kPrefix);
  const bool eight = json_fields::boolean(*qc, "load_in_8bit", src, false, kPrefix);
  if (four && eight)
    throw input_error(src, "quantization_config.load_in_4bit", "and load_in_8bit cannot both be true (BitsAndBytesConfig takes one)");
  if (!four && !eight) {
    const json* method = json_fields::find(*qc, "quant_method");
    if (!method)
      throw input_error(src, "quantization_config.quant_method",
                        "is missing, and neither load_in_4bit nor load_in_8bit is true (transformers refuses such a config)");
    const std::string name = json_fields::as_string(*method, src, "quantization_config.quant_method");
    if (name == "bitsandbytes")
      throw input_error(src, "quantization_config.load_in_4bit", "or load_in_8bit must be true for a bitsandbytes checkpoint");
    throw input_error(src, "quantization_config.quant_method",
                      "is not modelled: peftplan plans bitsandbytes checkpoints (load_in_4bit or load_in_8bit); a GPTQ, AWQ or other "
                      "quantised base stores and runs its weights differently",
                      "\"" + name + "\"");
  }
  Quantization q;
  if (eight) {
    q.dtype = DType::int8;  // Int8Params: int8 storage
  } else {
    const std::string type = json_fields::string(*qc, "bnb_4bit_quant_type", src, "fp4", kPrefix);
    if (type != "nf4" && type != "fp4")
      throw input_error(src, "quantization_config.bnb_4bit_quant_type", "must be \"nf4\" or \"fp4\"", "\"" + type + "\"");
    q.dtype = type == "nf4" ? DType::nf4 : DType::fp4;
    q.double_quant = json_fields::boolean(*qc, "bnb_4bit_use_double_quant", src, false, kPrefix);
    // BitsAndBytesConfig.__init__ takes these names and raises on any other.
    const std::string storage = json_fields::string(*qc, "bnb_4bit_quant_storage", src, "uint8", kPrefix);
    if (storage == "bfloat16") m.checkpoint_quant_storage = DType::bf16;
    else if (storage == "float16") m.checkpoint_quant_storage = DType::fp16;
    else if (storage == "float32") m.checkpoint_quant_storage = DType::fp32;
    else if (storage != "uint8" && storage != "int8" && storage != "float64")
      throw input_error(src, "quantization_config.bnb_4bit_quant_storage", "must be uint8, int8, float16, bfloat16, float32 or float64",
                        "\"" + storage + "\"");
  }
  if (const json* skip = json_fields::find(*qc, "llm_int8_skip_modules")) {
    if (!skip->is_array()) throw input_error(src, "quantization_config.llm_int8_skip_modules", "must be a list of module names or null", skip->dump());
    std::vector<std::string> keys;
    for (const json& name : *skip) keys.push_back(json_fields::as_string(name, src, "quantization_config.llm_int8_skip_modules[]"));
    auto kept_whole = [&](const std::string& path) -> const std::string* {
      const std::string local = path.substr(path.rfind('.') + 1);  // npos + 1 == 0: the whole path
      for (const auto& key : keys)
        if (key == local || key == path || path.find(key + ".") != std::string::npos) return &key;
      return nullptr;
    };
    const auto tensors = parameter_tensors(m);
    // The head's module (tied, it still exists, sharing the embedding): GPT-NeoX's embed_out.
    std::string head = m.arch == Arch::gpt_neox ? "embed_out" : "lm_head";
    for (const auto& t : tensors) {
      if (t.role == ParamRole::lm_head) head = t.module;
      if (t.role != ParamRole::linear_weight) continue;
      if (const std::string* key = kept_whole(t.module))
        throw input_error(src, "quantization_config.llm_int8_skip_modules",
                          fmt::format("keeps {} unquantised: a base quantised in part is not modelled (peftplan quantises every "
                                      "Linear but the LM head)", t.module),
                          "\"" + *key + "\"");
    }
    if (!kept_whole(head))
      throw input_error(src, "quantization_config.llm_int8_skip_modules",
                        fmt::format("leaves out {}, so bitsandbytes quantises the LM head too (transformers adds it only when the list "
                                    "is null): a quantised LM head is not modelled", head),
                        skip->dump());
  }
  return q;
}

}  // namespace

std::string_view name_of(Arch arch) {
  for (const auto& a : kArchNames)
    if (a.arch == arch) return a.name;
  return "?";
}

ModelSpec model_from_config(const json& c, std::string_view src, std::string name) {
  if (!c.is_object()) throw input_error(src, "", "must hold a JSON object (a Hugging Face config.json)");
  auto mt = c.find("model_type");
  if (mt == c.end() || !mt->is_string())
    throw input_error(src, "model_type", "is required (one of " + valid_arch_list() + ")");
  std::string type = mt->get<std::string>();
  ModelSpec m;
  m.name = std::move(name);
  bool known = false;
  for (const auto& a : kArchNames)
    if (a.name == type) {
      m.arch = a.arch;
      known = true;
    }
  if (!known)
    throw input_error(src, "model_type", "is not supported (supported: " + valid_arch_list() + ")",
                      "\"" + type + "\"");

  m.hidden = require_int(c, src, {"hidden_size", "n_embd", "d_model"});
  m.layers = require_int(c, src, {"num_hidden_layers", "n_layer", "num_layers"});
  m.heads = require_int(c, src, {"num_attention_heads", "n_head"});
  m.vocab = require_int(c, src, {"vocab_size"});
  m.max_positions = get_int(c, src, {"max_position_embeddings", "n_positions"}).value_or(2048);
  // PretrainedConfig: tie_word_embeddings defaults to true.
  m.tie_embeddings = json_fields::boolean(c, "tie_word_embeddings", src, true);
  if (auto hd = get_int(c, src, {"head_dim"})) {
    m.head_dim = *hd;
  } else {
    if (m.hidden % m.heads != 0)
      throw input_error(src, "hidden_size", fmt::format("must be divisible by num_attention_heads ({})", m.heads),
                        std::to_string(m.hidden));
    m.head_dim = m.hidden / m.heads;
  }
  m.kv_heads = get_int(c, src, {"num_key_value_heads"}).value_or(m.heads);
  m.rope_theta = get_double(c, src, {"rope_theta", "rotary_emb_base"}, 10000.0);
  m.norm_eps = get_double(c, src, {"rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon"}, 1e-5);
  if (auto it = c.find("torch_dtype"); it != c.end() && it->is_string())
    m.dtype = parse_dtype(it->get<std::string>()).value_or(DType::fp32);
  else if (auto it2 = c.find("dtype"); it2 != c.end() && it2->is_string())
    m.dtype = parse_dtype(it2->get<std::string>()).value_or(DType::fp32);
  if (auto sw = get_int(c, src, {"sliding_window"})) {
    bool use = json_fields::boolean(c, "use_sliding_window", src, m.arch != Arch::qwen2);
    if (use) m.sliding_window = *sw;
  }

  switch (m.arch) {
    case Arch::llama:
    case Arch::mistral:
    case Arch::mixtral:
    case Arch::qwen2:
    case Arch::gemma:
    case Arch::gemma2:
    case Arch::phi3:
      m.intermediate = require_int(c, src, {"intermediate_size"});
      // LlamaConfig attention_bias / mlp_bias (default false). Qwen2Attention hard-codes
      // q/k/v bias=True and o_proj bias=False (modeling_qwen2.py).
      m.qkv_bias = m.arch == Arch::qwen2 || json_fields::boolean(c, "attention_bias", src, false);
      m.out_bias = m.arch != Arch::qwen2 && json_fields::boolean(c, "attention_bias", src, false);
      m.mlp_bias = json_fields::boolean(c, "mlp_bias", src, false);
      if (m.arch == Arch::mixtral) {
        m.experts = get_int(c, src, {"num_local_experts"}).value_or(8);
        m.experts_per_token = get_int(c, src, {"num_experts_per_tok"}).value_or(2);
        if (m.experts_per_token > m.experts)
          throw input_error(src, "num_experts_per_tok",
                            fmt::format("must not exceed num_local_experts ({})", m.experts),
                            std::to_string(m.experts_per_token));
      }
      break;
    case Arch::gpt2:
      // GPT2Config: n_inner None => 4 * n_embd; Conv1D layers all carry biases.
      m.intermediate = get_int(c, src, {"n_inner"}).value_or(4 * m.hidden);
      m.qkv_bias = m.out_bias = m.mlp_bias = m.norm_bias = true;
      break;
    case Arch::gpt_neox:
      m.intermediate = get_int(c, src, {"intermediate_size"}).value_or(4 * m.hidden);
      m.qkv_bias = m.out_bias = m.mlp_bias = m.norm_bias = true;
      m.parallel_attn = json_fields::boolean(c, "use_parallel_residual", src, true);
      m.rotary_pct = get_double(c, src, {"rotary_pct", "partial_rotary_factor"}, 0.25);
      // GPTNeoXConfig tie_word_embeddings defaults to false.
      m.tie_embeddings = json_fields::boolean(c, "tie_word_embeddings", src, false);
      break;
    case Arch::falcon: {
      // FalconConfig: ffn_hidden_size None => 4 * hidden; bias False; parallel_attn True.
      m.intermediate = get_int(c, src, {"ffn_hidden_size"}).value_or(4 * m.hidden);
      bool bias = json_fields::boolean(c, "bias", src, false);
      m.qkv_bias = m.out_bias = m.mlp_bias = bias;
      m.norm_bias = true;
      m.parallel_attn = json_fields::boolean(c, "parallel_attn", src, true);
      m.falcon_new_arch = json_fields::boolean(c, "new_decoder_architecture", src, false);
      bool multi_query = json_fields::boolean(c, "multi_query", src, true);
      if (m.falcon_new_arch) {
        m.kv_heads = get_int(c, src, {"num_kv_heads", "n_head_kv"}).value_or(m.heads);
        // num_ln_in_parallel_attn: None => 2 for the new architecture (modeling_falcon.py).
        m.falcon_norms = get_int(c, src, {"num_ln_in_parallel_attn"}).value_or(2);
      } else {
        m.kv_heads = multi_query ? 1 : m.heads;
        m.falcon_norms = m.parallel_attn ? 1 : 2;
      }
      break;
    }
    case Arch::opt:
      m.intermediate = require_int(c, src, {"ffn_dim"});
      m.qkv_bias = m.out_bias = m.mlp_bias = json_fields::boolean(c, "enable_bias", src, true);
      m.norm_bias = json_fields::boolean(c, "layer_norm_elementwise_affine", src, true);
      m.opt_proj_dim = get_int(c, src, {"word_embed_proj_dim"}).value_or(m.hidden);
      // OPTDecoder: final_layer_norm exists only when do_layer_norm_before and not
      // _remove_final_layer_norm.
      m.opt_final_norm = json_fields::boolean(c, "do_layer_norm_before", src, true) &&
                         !json_fields::boolean(c, "_remove_final_layer_norm", src, false);
      break;
  }
  if (m.heads % m.kv_heads != 0)
    throw input_error(src, "num_key_value_heads",
                      fmt::format("must divide num_attention_heads ({})", m.heads), std::to_string(m.kv_heads));
  m.checkpoint_quantization = read_quantization_config(c, src, m);
  return m;
}

json read_json_file(const std::string& path) { return peftplan::read_json_file(path); }

ModelSpec load_model(const std::string& name_or_path) {
  if (const char* text = zoo_config_text(name_or_path)) {
    std::string src = "models/zoo/" + name_or_path + ".json";
    return model_from_config(json::parse(text), src, name_or_path);
  }
  namespace fs = std::filesystem;
  fs::path p(name_or_path);
  if (fs::is_directory(p)) p /= "config.json";
  if (!fs::exists(p)) {
    std::string names;
    for (const auto& z : zoo()) names += (names.empty() ? "" : ", ") + z.name;
    throw InputError(fmt::format("model: \"{}\" is neither a zoo model nor a config.json path "
                                 "(zoo: {})", name_or_path, names));
  }
  std::string stem = p.filename() == "config.json" ? p.parent_path().filename().string() : p.stem().string();
  return model_from_config(read_json_file(p.string()), p.string(), stem);
}

std::string sha256_hex(std::string_view bytes) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int n = 0;
  PEFTPLAN_CHECK_MSG(EVP_Digest(bytes.data(), bytes.size(), digest, &n, EVP_sha256(), nullptr) == 1, "OpenSSL SHA-256 failed");
  std::string hex;
  for (unsigned int i = 0; i < n; ++i) hex += fmt::format("{:02x}", digest[i]);
  return hex;
}

std::string config_sha256(const nlohmann::json& config) {
  // nlohmann::json keeps object keys sorted (std::map) and dump() without indent writes no
  // whitespace and leaves UTF-8 as it is.
  return sha256_hex(config.dump());
}

}  // namespace peftplan::models
