// parameter_tensors(): the parameter inventory of each architecture, with the names and shapes of
// the transformers modeling_*.py files (named_parameters order, tied weights once).
#include "peftplan/models/parameters.h"

#include <algorithm>
#include <map>

#include <fmt/format.h>

namespace peftplan::models {
namespace {

// Appends tensors in registration order; keeps the per-tensor lines short and readable.
struct Inventory {
  const ModelSpec& m;
  std::vector<TensorInfo> rows;

  void add(std::string module, std::string leaf, std::vector<std::int64_t> shape, ParamRole role,
           std::int32_t layer) {
    rows.push_back(TensorInfo{module + "." + leaf, std::move(shape), m.dtype, role, layer, std::move(module)});
  }
  // nn.Linear(in, out): weight [out, in], bias [out].
  void linear(const std::string& module, std::int64_t in, std::int64_t out, bool bias, std::int32_t layer) {
    add(module, "weight", {out, in}, ParamRole::linear_weight, layer);
    if (bias) add(module, "bias", {out}, ParamRole::linear_bias, layer);
  }
  // GPT-2 Conv1D(nf=out, nx=in): weight [in, out], bias [out].
  void conv1d(const std::string& module, std::int64_t in, std::int64_t out, std::int32_t layer) {
    add(module, "weight", {in, out}, ParamRole::linear_weight, layer);
    add(module, "bias", {out}, ParamRole::linear_bias, layer);
  }
  void norm(const std::string& module, std::int64_t width, bool bias, std::int32_t layer) {
    add(module, "weight", {width}, ParamRole::norm_weight, layer);
    if (bias) add(module, "bias", {width}, ParamRole::norm_bias, layer);
  }
};

void llama_family(Inventory& inv) {
  const ModelSpec& m = inv.m;
  const std::int64_t H = m.hidden, I = m.intermediate, V = m.vocab;
  inv.add("model.embed_tokens", "weight", {V, H}, ParamRole::embedding, -1);  // [V, H]
  for (std::int32_t l = 0; l < static_cast<std::int32_t>(m.layers); ++l) {
    const std::string p = fmt::format("model.layers.{}.", l);
    if (m.arch == Arch::phi3) {
      inv.linear(p + "self_attn.o_proj", m.q_width(), H, false, l);                       // [H, nh*d]
      inv.linear(p + "self_attn.qkv_proj", H, m.q_width() + 2 * m.kv_width(), false, l);  // [(nh+2nkv)d, H]
      inv.linear(p + "mlp.gate_up_proj", H, 2 * I, false, l);                             // [2I, H]
      inv.linear(p + "mlp.down_proj", I, H, false, l);                                    // [H, I]
    } else {
      inv.linear(p + "self_attn.q_proj", H, m.q_width(), m.qkv_bias, l);   // [nh*d, H]
      inv.linear(p + "self_attn.k_proj", H, m.kv_width(), m.qkv_bias, l);  // [nkv*d, H]
      inv.linear(p + "self_attn.v_proj", H, m.kv_width(), m.qkv_bias, l);  // [nkv*d, H]
      inv.linear(p + "self_attn.o_proj", m.q_width(), H, m.out_bias, l);   // [H, nh*d]
      if (m.is_moe()) {
        inv.linear(p + "block_sparse_moe.gate", H, m.experts, false, l);   // router [E, H]
        for (std::int64_t e = 0; e < m.experts; ++e) {
          const std::string x = fmt::format("{}block_sparse_moe.experts.{}.", p, e);
          inv.linear(x + "w1", H, I, false, l);  // gate [I, H]
          inv.linear(x + "w2", I, H, false, l);  // down [H, I]
          inv.linear(x + "w3", H, I, false, l);  // up   [I, H]
        }
      } else {
        inv.linear(p + "mlp.gate_proj", H, I, m.mlp_bias, l);  // [I, H]
        inv.linear(p + "mlp.up_proj", H, I, m.mlp_bias, l);    // [I, H]
        inv.linear(p + "mlp.down_proj", I, H, m.mlp_bias, l);  // [H, I]
      }
    }
    inv.norm(p + "input_layernorm", H, false, l);           // [H]
    inv.norm(p + "post_attention_layernorm", H, false, l);  // [H]
    if (m.arch == Arch::gemma2) {                           // Gemma2DecoderLayer: four norms
      inv.norm(p + "pre_feedforward_layernorm", H, false, l);
      inv.norm(p + "post_feedforward_layernorm", H, false, l);
    }
  }
  inv.norm("model.norm", H, false, -1);
  if (!m.tie_embeddings) inv.add("lm_head", "weight", {V, H}, ParamRole::lm_head, -1);  // [V, H]
}

void gpt2(Inventory& inv) {
  const ModelSpec& m = inv.m;
  const std::int64_t H = m.hidden, I = m.intermediate;
  inv.add("transformer.wte", "weight", {m.vocab, H}, ParamRole::embedding, -1);                 // [V, H]
  inv.add("transformer.wpe", "weight", {m.max_positions, H}, ParamRole::position_embedding, -1);  // [P, H]
  for (std::int32_t l = 0; l < static_cast<std::int32_t>(m.layers); ++l) {
    const std::string p = fmt::format("transformer.h.{}.", l);
    inv.norm(p + "ln_1", H, true, l);
    inv.conv1d(p + "attn.c_attn", H, 3 * H, l);  // [H, 3H]
    inv.conv1d(p + "attn.c_proj", H, H, l);      // [H, H]
    inv.norm(p + "ln_2", H, true, l);
    inv.conv1d(p + "mlp.c_fc", H, I, l);         // [H, I]
    inv.conv1d(p + "mlp.c_proj", I, H, l);       // [I, H]
  }
  inv.norm("transformer.ln_f", H, true, -1);
  if (!m.tie_embeddings) inv.add("lm_head", "weight", {m.vocab, H}, ParamRole::lm_head, -1);
}

void gpt_neox(Inventory& inv) {
  const ModelSpec& m = inv.m;
  const std::int64_t H = m.hidden, I = m.intermediate;
  inv.add("gpt_neox.embed_in", "weight", {m.vocab, H}, ParamRole::embedding, -1);  // [V, H]
  for (std::int32_t l = 0; l < static_cast<std::int32_t>(m.layers); ++l) {
    const std::string p = fmt::format("gpt_neox.layers.{}.", l);
    inv.norm(p + "input_layernorm", H, true, l);
    inv.norm(p + "post_attention_layernorm", H, true, l);
    inv.linear(p + "attention.query_key_value", H, m.q_width() + 2 * m.kv_width(), true, l);  // [3H, H]
    inv.linear(p + "attention.dense", m.q_width(), H, true, l);                               // [H, H]
    inv.linear(p + "mlp.dense_h_to_4h", H, I, true, l);                                       // [I, H]
    inv.linear(p + "mlp.dense_4h_to_h", I, H, true, l);                                       // [H, I]
  }
  inv.norm("gpt_neox.final_layer_norm", H, true, -1);
  if (!m.tie_embeddings) inv.add("embed_out", "weight", {m.vocab, H}, ParamRole::lm_head, -1);  // [V, H]
}

void falcon(Inventory& inv) {
  const ModelSpec& m = inv.m;
  const std::int64_t H = m.hidden, I = m.intermediate, d = m.head_dim;
  // FalconAttention: new architecture (nh + 2 nkv) d; multi-query H + 2d; otherwise 3H.
  const std::int64_t qkv_out = m.falcon_new_arch ? (m.heads + 2 * m.kv_heads) * d
                               : m.kv_heads == 1 ? H + 2 * d
                                                 : 3 * H;
  inv.add("transformer.word_embeddings", "weight", {m.vocab, H}, ParamRole::embedding, -1);
  for (std::int32_t l = 0; l < static_cast<std::int32_t>(m.layers); ++l) {
    const std::string p = fmt::format("transformer.h.{}.", l);
    inv.linear(p + "self_attention.query_key_value", H, qkv_out, m.qkv_bias, l);
    inv.linear(p + "self_attention.dense", m.q_width(), H, m.out_bias, l);
    inv.linear(p + "mlp.dense_h_to_4h", H, I, m.mlp_bias, l);
    inv.linear(p + "mlp.dense_4h_to_h", I, H, m.mlp_bias, l);
    if (m.falcon_new_arch && m.falcon_norms == 2) {
      inv.norm(p + "ln_attn", H, true, l);
      inv.norm(p + "ln_mlp", H, true, l);
    } else {
      inv.norm(p + "input_layernorm", H, true, l);
      if (!m.falcon_new_arch && !m.parallel_attn) inv.norm(p + "post_attention_layernorm", H, true, l);
    }
  }
  inv.norm("transformer.ln_f", H, true, -1);
  if (!m.tie_embeddings) inv.add("lm_head", "weight", {m.vocab, H}, ParamRole::lm_head, -1);
}

void opt(Inventory& inv) {
  const ModelSpec& m = inv.m;
  const std::int64_t H = m.hidden, I = m.intermediate, Pd = m.opt_proj_dim;
  inv.add("model.decoder.embed_tokens", "weight", {m.vocab, Pd}, ParamRole::embedding, -1);  // [V, proj]
  // OPTLearnedPositionalEmbedding keeps 2 extra rows (offset = 2).
  inv.add("model.decoder.embed_positions", "weight", {m.max_positions + 2, H}, ParamRole::position_embedding, -1);
  if (Pd != H) {
    inv.linear("model.decoder.project_out", H, Pd, false, -1);  // [proj, H]
    inv.linear("model.decoder.project_in", Pd, H, false, -1);   // [H, proj]
  }
  if (m.opt_final_norm) inv.norm("model.decoder.final_layer_norm", H, m.norm_bias, -1);
  for (std::int32_t l = 0; l < static_cast<std::int32_t>(m.layers); ++l) {
    const std::string p = fmt::format("model.decoder.layers.{}.", l);
    inv.linear(p + "self_attn.k_proj", H, H, m.qkv_bias, l);
    inv.linear(p + "self_attn.v_proj", H, H, m.qkv_bias, l);
    inv.linear(p + "self_attn.q_proj", H, H, m.qkv_bias, l);
    inv.linear(p + "self_attn.out_proj", H, H, m.out_bias, l);
    inv.norm(p + "self_attn_layer_norm", H, m.norm_bias, l);
    inv.linear(p + "fc1", H, I, m.mlp_bias, l);
    inv.linear(p + "fc2", I, H, m.mlp_bias, l);
    inv.norm(p + "final_layer_norm", H, m.norm_bias, l);
  }
  if (!m.tie_embeddings) inv.add("lm_head", "weight", {m.vocab, Pd}, ParamRole::lm_head, -1);
}

std::string leaf_of(const std::string& path) {
  auto dot = path.rfind('.');
  return dot == std::string::npos ? path : path.substr(dot + 1);
}

}  // namespace

std::vector<TensorInfo> parameter_tensors(const ModelSpec& model) {
  Inventory inv{model, {}};
  switch (model.arch) {
    case Arch::llama:
    case Arch::mistral:
    case Arch::mixtral:
    case Arch::qwen2:
    case Arch::gemma:
    case Arch::gemma2:
    case Arch::phi3: llama_family(inv); break;
    case Arch::gpt2: gpt2(inv); break;
    case Arch::gpt_neox: gpt_neox(inv); break;
    case Arch::falcon: falcon(inv); break;
    case Arch::opt: opt(inv); break;
  }
  return std::move(inv.rows);
}

std::vector<LinearModule> linear_modules(const ModelSpec& model) { return linear_modules(model, parameter_tensors(model)); }

std::vector<LinearModule> linear_modules(const ModelSpec& model, const std::vector<TensorInfo>& tensors) {
  std::vector<LinearModule> out;
  std::map<std::string, bool> has_bias;
  for (const auto& t : tensors)
    if (t.role == ParamRole::linear_bias) has_bias[t.module] = true;
  bool has_head = false;
  for (const auto& t : tensors) {
    if (t.role != ParamRole::linear_weight && t.role != ParamRole::lm_head) continue;
    LinearModule lm;
    lm.path = t.module;
    lm.leaf = leaf_of(t.module);
    lm.layer = t.layer;
    lm.conv1d = model.arch == Arch::gpt2 && t.role == ParamRole::linear_weight;
    lm.in = lm.conv1d ? t.shape[0] : t.shape[1];
    lm.out = lm.conv1d ? t.shape[1] : t.shape[0];
    lm.has_bias = has_bias.count(t.module) > 0;
    lm.is_output = t.role == ParamRole::lm_head;
    has_head = has_head || lm.is_output;
    if (auto pos = t.module.find(".experts."); pos != std::string::npos)
      lm.expert = std::stoi(t.module.substr(pos + 9));
    out.push_back(std::move(lm));
  }
  if (!has_head) {  // tied: the head is a Linear module whose weight is the embedding
    LinearModule lm;
    lm.path = model.arch == Arch::gpt_neox ? "embed_out" : "lm_head";
    lm.leaf = lm.path;
    lm.in = model.arch == Arch::opt ? model.opt_proj_dim : model.hidden;
    lm.out = model.vocab;
    lm.is_output = true;
    out.push_back(std::move(lm));
  }
  return out;
}

std::vector<std::string> module_paths(const ModelSpec& model) {
  std::vector<std::string> out;
  for (const auto& t : parameter_tensors(model))
    if (out.empty() || out.back() != t.module) out.push_back(t.module);
  for (const auto& lm : linear_modules(model))
    if (lm.is_output && std::find(out.begin(), out.end(), lm.path) == out.end()) out.push_back(lm.path);
  return out;
}

BaseCounts count_base(const ModelSpec& model) {
  BaseCounts c;
  std::map<std::string, std::int64_t> per_module;
  std::int64_t inactive_experts = 0;
  for (const auto& t : parameter_tensors(model)) {
    const std::int64_t n = t.numel();
    c.total += n;
    per_module[t.module] += n;
    if (t.role == ParamRole::embedding || t.role == ParamRole::position_embedding ||
        t.role == ParamRole::lm_head)
      c.embedding += n;
    if (model.is_moe() && t.module.find(".experts.") != std::string::npos) inactive_experts += n;
  }
  // Per token only k of E experts run: active = total - (E - k)/E of the expert parameters.
  c.active = c.total;
  if (model.is_moe()) c.active -= inactive_experts / model.experts * (model.experts - model.experts_per_token);
  for (const auto& [module, n] : per_module) c.largest_layer = std::max(c.largest_layer, n);
  return c;
}

}  // namespace peftplan::models
