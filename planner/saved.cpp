// What a decoder layer saves for backward (saved.h): the table, built from the runtime rules
// (runtime.h) and the linear modules' plans (builder_layout.cpp), which the graph
// (builder_graph.cpp) emits its layer allocations from.
// Deliberately not here: when tensors are allocated and freed (the graph), their categories (a
// kept tensor is an activation, or workspace in a checkpointed layer), and costs.
#include "builder.h"

#include <fmt/format.h>

namespace peftplan::planner {

std::uint64_t SavedTable::kept_bytes() const {
  std::uint64_t n = 0;
  for (const SavedTensor& r : rows)
    if (r.kept) n += r.bytes();
  return n;
}

const SavedTensor* SavedTable::find(std::string_view name, std::string_view module) const {
  for (const SavedTensor& r : rows)
    if (r.name == name && r.module == module) return &r;
  return nullptr;
}

std::string shape_text(const SavedTensor& t) {
  std::string s = "[";
  for (std::uint8_t i = 0; i < t.rank; ++i) s += fmt::format("{}{}", i ? ", " : "", t.shape[i]);
  return s + "]";
}

SavedTable saved_for_backward(const PlanInput& input, std::int64_t layer) {
  if (layer < 0 || layer >= input.model.layers)
    throw input_error("saved_for_backward", "layer", fmt::format("must be in [0, {}) (the model's layers)", input.model.layers),
                      std::to_string(layer));
  validate(input);
  PlanInput in = input;
  // An inventory made here keys nothing later builds share: its layout is not kept.
  const bool own = !in.inventory;
  if (own) in.inventory = std::make_shared<const ModelInventory>(make_inventory(in.model, in.peft));
  builder::Builder b(in, BuildOptions{.reuse_layout = !own});
  SavedTable t = b.table_only(layer);
  t.owner = in.inventory;
  return t;
}

namespace builder {

namespace {

SavedTensor row(std::string_view name, std::string_view module, std::initializer_list<std::int64_t> shape, DType d, bool kept,
                std::string_view rule) {
  SavedTensor t;
  t.name = name;
  t.module = module;
  for (std::int64_t x : shape) t.shape[t.rank++] = x;
  t.dtype = d;
  t.kept = kept;
  t.rule = rule;
  return t;
}

}  // namespace

SavedTable Builder::table_only(std::int64_t l) {
  use_layout(reuse_layout_);
  return layer_table(l).table;
}

void Builder::make_tables() {
  tables_.clear();
  tables_.reserve(static_cast<std::size_t>(m_.layers));
  for (std::int64_t l = 0; l < m_.layers; ++l) tables_.push_back(layer_table(l));
}

LinearRows Builder::linear_rows(std::vector<SavedTensor>& rows, const LinearPlan& lp, DType out_dtype, bool out_kept,
                                std::string_view out_rule) const {
  LinearRows lr;
  lr.fill(-1);
  const auto& mod = *lp.mod;
  const std::string_view path = mod.path;
  const auto n = static_cast<std::int64_t>(std::llround(static_cast<double>(M_) * lp.token_share));  // MoE: the expert's tokens
  auto add = [&](LinearSlot s, SavedTensor t) {
    PEFTPLAN_CHECK_MSG(rows.size() < 32767, "layer table of {} rows: more than its int16 indices hold", rows.size());
    lr[static_cast<std::size_t>(s)] = static_cast<std::int16_t>(rows.size());
    rows.push_back(t);
  };
  // A frozen weight stored in another dtype than the compute dtype is converted per GEMM
  // (bitsandbytes dequantises; our executor converts bf16 to fp32); the LM head is stored in the
  // compute dtype like the embedding.
  if (f_.base_dtype != f_.compute_dtype && !lp.trainable_weight && !mod.is_output)
    add(LinearSlot::w_compute, row("w_compute", path, {mod.out, mod.in}, f_.compute_dtype, false,
                                   "the weight in the compute dtype for one GEMM (bitsandbytes dequantize_4bit), freed after it"));
  add(LinearSlot::out, row("out", path, {n, mod.out}, out_dtype, out_kept, out_rule));
  if (!lp.adapter) return lr;
  const Adapter& a = *lp.adapter;
  const DType ad = adapter_dtype(lp);
  if (a.dropout > 0.0 || lp.adapter_owns_input)
    add(LinearSlot::lora_x, row("lora_x", path, {n, mod.in}, ad, true,
                                "lora_A's input, dropped out (PEFT lora.Linear: lora_A(dropout(x))) or cast to the adapter's dtype: "
                                "its GEMM saves it"));
  if (lp.adapter_owns_input && a.dropout > 0.0)
    add(LinearSlot::lora_mask, row("lora_mask", path, {n, mod.in}, DType::int8, true,
                                   "native_dropout's keep mask, a byte per element (autograd's native_dropout_backward reads it)"));
  if (a.r > 0)
    add(LinearSlot::lora_u, row("lora_u", path, {n, a.r}, ad, true, "lora_B's input u = x·Aᵀ: lora_B's weight gradient reads it"));
  return lr;
}

LayerTable Builder::layer_table(std::int64_t l) const {
  LayerTable lt;
  lt.at.fill(-1);
  lt.table.layer = l;
  auto& rows = lt.table.rows;
  rows.reserve(static_cast<std::size_t>(Slot::count) + 4 * lay_.layer_linears[static_cast<std::size_t>(l)].size());
  auto add = [&](Slot s, SavedTensor t) {
    PEFTPLAN_CHECK_MSG(rows.size() < 32767, "layer table of {} rows: more than its int16 indices hold", rows.size());
    lt.at[static_cast<std::size_t>(s)] = static_cast<std::int16_t>(rows.size());
    rows.push_back(t);
  };
  const std::int64_t H = m_.hidden, B = t_.micro_batch, S = M_ / t_.micro_batch;
  const auto& lin = lay_.layer_linears[static_cast<std::size_t>(l)];
  lt.linear.assign(lin.size(), LinearRows{});
  for (auto& lr : lt.linear) lr.fill(-1);
  // A projection's input is kept only when something trains on it (an adapter, or the weight
  // itself): a frozen linear needs only its weight to propagate the gradient to its input.
  auto needs = [&](Role r) {
    return std::any_of(lin.begin(), lin.end(), [&](const LinearPlan& lp) { return lp.role == r && lp.needs_input(); });
  };
  const bool norm_copies = rules_.norm_saves_fp32_input && m_.rms_norm();
  const bool full = in_.peft.adapters.empty();
  const DType nd = stream_dtype(), xd = resid_dtype(l), cd = f_.compute_dtype;
  constexpr std::string_view kInputRule = "kept when an adapter or a trainable weight of the projections reading it needs it";
  // A norm: its statistics, its fp32 input copy and normalised input (runtime rule
  // norm_saves_fp32_input: LlamaRMSNorm.forward computes in fp32 from hidden_states.to(float32),
  // whose result autograd saves; the weight's gradient reads the normalised input), its output.
  auto norm = [&](Slot stats, Slot x32, Slot normed, Slot out, std::string_view n_stats, std::string_view n_x32,
                  std::string_view n_normed, std::string_view n_out, bool out_needed) {
    if (m_.rms_norm()) add(stats, row(n_stats, "", {M_}, DType::fp32, true, "rstd: the norm's backward reads it"));
    else add(stats, row(n_stats, "", {M_, 2}, DType::fp32, true, "mean and rstd: the norm's backward reads them"));
    if (norm_copies && xd != DType::fp32)
      add(x32, row(n_x32, "", {M_, H}, DType::fp32, true, "the input in fp32 (hidden_states.to(torch.float32)), saved by pow and mul"));
    if (norm_copies && full)
      add(normed, row(n_normed, "", {M_, H}, xd, true, "the normalised input: the trainable norm weight's gradient reads it"));
    add(out, row(n_out, "", {M_, H}, nd, out_needed, kInputRule));
  };
  auto linears = [&](Role r, DType out_dtype, bool out_kept, std::string_view rule) {
    for (std::size_t i = 0; i < lin.size(); ++i)
      if (lin[i].role == r) lt.linear[i] = linear_rows(rows, lin[i], out_dtype, out_kept, rule);
  };

  // --- attention block ---
  norm(Slot::norm1_stats, Slot::norm1_x_fp32, Slot::norm1_normed, Slot::norm1_out, "norm1.stats", "norm1.x_fp32", "norm1.normed",
       "norm1.out", needs(Role::attn_in));
  // q, k and v: attention saves its inputs (flash_attn_func / SDPA / eager matmuls). An fp32
  // projection output (bitsandbytes returns its input's dtype) is replaced by a compute-dtype
  // copy, which attention saves instead.
  linears(Role::attn_in, nd, nd == cd, nd == cd ? "attention saves q, k and v" : "cast to the compute dtype and freed: attention saves the copy");
  if (nd != cd)
    for (std::size_t i = 0; i < lin.size(); ++i)
      if (lin[i].role == Role::attn_in) {
        const SavedTensor& out = rows[static_cast<std::size_t>(lt.linear[i][static_cast<std::size_t>(LinearSlot::out)])];
        PEFTPLAN_CHECK(rows.size() < 32767);
        lt.linear[i][static_cast<std::size_t>(LinearSlot::out_compute)] = static_cast<std::int16_t>(rows.size());
        rows.push_back(row("out_compute", out.module, {out.shape[0], out.shape[1]}, cd, true, "attention saves q, k and v"));
      }
  const std::int64_t nh = m_.heads, kv = kv_len_;
  if (t_.attention == Attention::eager) {
    add(Slot::attn_scores, row("attn.probs", "", {B, nh, S, kv}, cd, true, "eager attention saves softmax's output for the PV product"));
    if (rules_.eager_softmax_fp32 && m_.rms_norm() && cd != DType::fp32)
      add(Slot::attn_probs_fp32, row("attn.probs_fp32", "", {B, nh, S, kv}, DType::fp32, true,
                                     "softmax(attn_weights, dtype=torch.float32) saves its fp32 output before the cast back"));
  } else {
    add(Slot::attn_scores, row("attn.lse", "", {B, nh, S}, DType::fp32, true,
                               "flash attention saves the log-sum-exp per row (Dao, FlashAttention-2) instead of the scores"));
  }
  // Flash attention keeps its output for the backward's D = Σ d_out ⊙ out per row, whoever runs
  // it: flash-attn's FlashAttnFunc (ctx.save_for_backward(q, k, v, out_padded, softmax_lse)),
  // SDPA's flash and memory-efficient kernels (derivatives.yaml: _scaled_dot_product_flash_attention
  // and _efficient_attention's backward take `output`), our executor's (kernels.h §5b). Eager
  // attention's P·V matmul saves its inputs, not its output, and a frozen o_proj saves nothing.
  const bool flash_keeps_out = t_.attention == Attention::flash;
  const bool out_saved = needs(Role::attn_out) || flash_keeps_out;
  add(Slot::attn_out, row("attn.out", "", {M_, m_.q_width()}, cd, out_saved,
                          needs(Role::attn_out) || !flash_keeps_out ? kInputRule : "flash attention saves its output for its backward"));
  linears(Role::attn_out, cd, false, "the residual add reads it; nothing saves it");
  // The residual after attention is the post-attention norm's input: saved by it, unless the
  // norm saves an fp32 copy instead.
  const bool mid_kept = !norm_copies || xd == DType::fp32;
  add(Slot::resid_mid, row("resid_mid", "", {M_, H}, xd, mid_kept,
                           mid_kept ? "the post-attention norm's input, saved by it" : "the post-attention norm's input: it saves an fp32 copy instead"));

  // --- MLP block ---
  norm(Slot::norm2_stats, Slot::norm2_x_fp32, Slot::norm2_normed, Slot::norm2_out, "norm2.stats", "norm2.x_fp32", "norm2.normed",
       "norm2.out", needs(Role::mlp_in) || needs(Role::router));
  linears(Role::router, cd, true, "the routing softmax and top-k read the router logits");
  linears(Role::mlp_in, nd, true, "the activation (act_fn(gate) * up, or GELU) saves its inputs");
  const std::int64_t I = m_.intermediate;
  const auto n = static_cast<std::int64_t>(M_ * (m_.is_moe() ? m_.experts_per_token : 1));
  if (rules_.unfused_swiglu && m_.gated_mlp())
    add(Slot::mlp_silu, row("mlp.silu", "", {n, I}, nd, true, "eager act_fn(gate): the product with up saves it"));
  add(Slot::mlp_act, row("mlp.act", "", {n, I}, nd, needs(Role::mlp_out), kInputRule));
  linears(Role::mlp_out, nd, false, "the residual add reads it; nothing saves it");
  // The layer's output is the next layer's input (or the final norm's), and a checkpoint's input.
  // Runtime rule layer_input_only_if_saved: once that norm has saved its fp32 copy nothing
  // holds the output (in a layer that is not checkpointed).
  const bool copied_next = rules_.layer_input_only_if_saved && norm_copies && resid_dtype(l + 1) != DType::fp32;
  add(Slot::layer_out, row("resid_out", "", {M_, H}, resid_dtype(l + 1), !copied_next,
                           copied_next ? "the next norm's input: freed once it has saved an fp32 copy (transformers drops the reference)"
                                       : "the next layer's input, saved by its norm"));
  return lt;
}

}  // namespace builder
}  // namespace peftplan::planner
