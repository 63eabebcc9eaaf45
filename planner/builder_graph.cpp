// The model graph: a micro-batch's forward through the layers, the loss, and the backward in
// reverse, with what each layer saves, recomputes and frees (builder.h).
#include "builder.h"

namespace peftplan::planner::builder {

// x: [M, in] input buffer. Emits the base GEMM, the adapter branch, and returns the output
// buffer [M, out] (category out_cat). Buffers the backward needs are appended to `saved`.
// Args conventions (all tensors row-major, the compute dtype unless noted; M = rows):
//   cast          {src, dst}: dst[in*out] (compute dtype) = src converted from the storage dtype
//   linear_fwd    {x [M,in], W [out,in], y [M,out], bias [out] or -1}: y = x·Wᵀ (+ bias)
//   dropout       {x [M,in], x_drop [M,in], A}: x_drop = x ⊙ keep / (1-p); the keep mask is a
//                 counter-based hash keyed by the adapter (A's buffer id), the micro-batch and
//                 the step, so the recompute and the backward regenerate the same mask
//   lora_fwd      {x_in [M,in], A [r,in], B [out,r], u [M,r], y [M,out]}: u = x_in·Aᵀ,
//                 y += scale·u·Bᵀ (x_in is the dropped input when dropout > 0)
// The allocations come from the linear's rows of the layer's table (saved.h): the output's dtype
// is the row's (bitsandbytes' Linear4bit returns its input's dtype).
std::int32_t Builder::linear_forward(LinearPlan& lp, const std::vector<SavedTensor>& table, const LinearRows& lr, std::int32_t x,
                                     std::int32_t layer, Phase phase, Cat out_cat, Cat saved_cat, std::vector<std::int32_t>& saved) {
  const auto& mod = *lp.mod;
  const SavedTensor& out = *linear_row(table, lr, LinearSlot::out);
  const std::int64_t rows = out.shape[0];  // MoE: the expert's share of the tokens
  const std::uint64_t wbytes = storage_bytes(f_.base_dtype, mod.in * mod.out);
  const std::string base = names_ ? name_cat(mod.path, ".mb", mb_) : std::string();
  auto alloc_row = [&](const SavedTensor& r, Cat cat) { return alloc([&] { return name_cat(base, '.', r.name); }, cat, r.bytes(), phase); };
  const std::int32_t y = alloc_row(out, out_cat);
  std::int32_t w = lp.weight_buf;
  std::int32_t cast = -1;
  // A weight stored in another dtype than the compute dtype is converted per GEMM into a
  // workspace copy (the w_compute row).
  if (const SavedTensor* wc = linear_row(table, lr, LinearSlot::w_compute)) {
    cast = alloc_row(*wc, Cat::workspace);
    compute("dequantize", layer, phase, elementwise(wbytes + act(mod.in * mod.out)),
            ops::Cast{.src = w, .dst = cast, .n = mod.in * mod.out, .from = f_.base_dtype, .to = f_.compute_dtype});
    w = cast;
  }
  // A 16-bit GEMM fed an fp32 input (an fp32 norm's output) casts it, and bitsandbytes'
  // Linear4bit returns out.to(x.dtype) (bitsandbytes 0.43.3 nn/modules.py Linear4bit.forward):
  // two eager casts.
  const DType od = out.dtype;
  if (rules_.eager_elementwise && (lp.input_dtype != f_.compute_dtype || od != f_.compute_dtype))
    compute("cast_io", layer, phase,
            elementwise((lp.input_dtype != f_.compute_dtype ? bytes(lp.input_dtype, rows * mod.in) + act(rows * mod.in) : 0) +
                        (od != f_.compute_dtype ? bytes(od, rows * mod.out) + act(rows * mod.out) : 0)),
            ops::Cast{.src = x, .dst = y, .n = rows * mod.in, .from = lp.input_dtype, .to = f_.compute_dtype});
  compute(intern(mod.leaf), layer, phase, gemm(rows, mod.out, mod.in, wbytes + act(rows * (mod.in + mod.out))),
          ops::LinearFwd{.x = x, .w = w, .y = y, .bias = lp.bias_buf, .M = rows, .K = mod.in, .N = mod.out});
  free(cast, phase);
  if (lp.adapter) {
    Adapter& a = *lp.adapter;
    std::int32_t xin = x;
    lp.xin_buf = -1;
    // The branch's activations: the compute dtype, or (runtime rule) the adapter's.
    const DType ad = adapter_dtype(lp);
    if (const SavedTensor* lx = linear_row(table, lr, LinearSlot::lora_x)) {  // PEFT applies dropout to the adapter input: keep the dropped copy
      xin = alloc_row(*lx, saved_cat);
      const std::uint64_t in_bytes = rules_.eager_elementwise
                                         ? static_cast<std::uint64_t>(eager::lora_in_fwd(static_cast<double>(bytes_of(lp.input_dtype)), static_cast<double>(bytes_of(ad)), a.dropout > 0.0) *
                                                                      static_cast<double>(rows * mod.in))
                                         : act(rows * mod.in) + bytes(ad, rows * mod.in);
      if (a.dropout > 0.0)
        compute("lora_dropout", layer, phase, elementwise(in_bytes),
                ops::Dropout{.x = x, .out = xin, .n = rows * mod.in, .p = a.dropout, .adapter = a.index});
      else
        compute("lora_cast", layer, phase, elementwise(in_bytes),
                ops::Cast{.src = x, .dst = xin, .n = rows * mod.in, .from = lp.input_dtype, .to = ad});
      saved.push_back(xin);
      lp.xin_buf = xin;
      // torch's native_dropout saves its keep mask (bool, a byte per element) for backward.
      if (const SavedTensor* mask = linear_row(table, lr, LinearSlot::lora_mask)) saved.push_back(alloc_row(*mask, saved_cat));
    }
    if (const SavedTensor* ur = linear_row(table, lr, LinearSlot::lora_u)) {
      const std::int32_t u = alloc_row(*ur, saved_cat);
      sim::ComputeWork w1 = gemm(rows, a.r, mod.in, bytes(ad, rows * (mod.in + a.r)));
      sim::ComputeWork w2 = gemm(rows, mod.out, a.r, bytes(ad, rows * (a.r + 2 * mod.out)));
      w1.flops += w2.flops;
      w1.bytes_moved += w2.bytes_moved;
      w1.fp32_math = rules_.eager_elementwise && ad == DType::fp32 && f_.compute_dtype != DType::fp32;
      compute("lora", layer, phase, w1,
              ops::LoraFwd{.x_in = xin, .a = a.a_buf, .b = a.b_buf, .u = u, .y = y, .M = rows, .K = mod.in, .N = mod.out, .r = a.r,
                           .scale = a.scale, .adapter = a.index});
      if (rules_.eager_elementwise)  // the scaling, the add into the base output and its cast
        compute("lora_add", layer, phase,
                elementwise(static_cast<std::uint64_t>(eager::lora_out_fwd(static_cast<double>(bytes_of(f_.compute_dtype)), static_cast<double>(bytes_of(ad))) *
                                                       static_cast<double>(rows * mod.out))),
                ops::Accumulate{.in = y});
      saved.push_back(u);
      lp.u_buf = u;
    } else {  // IA3: elementwise scaling
      compute("ia3", layer, phase, elementwise(act(rows * mod.out) * 2, static_cast<double>(rows * mod.out)),
              ops::LoraFwd{.y = y, .M = rows, .K = mod.in, .N = mod.out, .adapter = a.index});
    }
  }
  return y;
}

// dy: [M, out]; writes dx [M, in] (when dx >= 0; overwriting it when dx_first, else adding);
// x is the saved input (or -1 when nothing trains on it).
// Args conventions:
//   linear_bwd_data   {dy [M,out], W [out,in], dx [M,in]}: dx (=|+=) dy·W (Op::accumulate)
//   linear_bwd_weight {dy [M,out], x [M,in], dW}: full fine-tuning only
//   lora_bwd          {dy [M,out], x_in [M,in], A [r,in], B [out,r], u [M,r], scratch, dx [M,in]
//                      or -1, dA [r,in], dB [out,r]}: with s = scale, du = s·dy·B (scratch[0,M·r)),
//                      dB += s·dyᵀ·u, dA += duᵀ·x_in, dx += drop'(du·A); with dropout x_in is the
//                      saved dropped input and du·A goes through scratch[M·r, M·r + M·in) before
//                      the mask is applied (scratch is M·(r + in) elements then, M·r otherwise)
std::int32_t Builder::linear_backward(LinearPlan& lp, std::int32_t dy, std::int32_t dx, std::int32_t x, std::int32_t layer,
                                      bool dx_first) {
  const Phase B = Phase::backward;
  const auto& mod = *lp.mod;
  const auto rows = static_cast<std::int64_t>(std::llround(static_cast<double>(M_) * lp.token_share));
  const std::uint64_t wbytes = storage_bytes(f_.base_dtype, mod.in * mod.out);
  const std::string base = names_ ? name_cat(mod.path, ".mb", mb_) : std::string();
  std::int32_t w = lp.weight_buf, cast = -1;
  if (f_.base_dtype != f_.compute_dtype && !lp.trainable_weight && !mod.is_output) {
    cast = alloc([&] { return base + ".w_compute_bwd"; }, Cat::workspace, act(mod.in * mod.out), B);
    compute("dequantize", layer, B, elementwise(wbytes + act(mod.in * mod.out)),
            ops::Cast{.src = w, .dst = cast, .n = mod.in * mod.out, .from = f_.base_dtype, .to = f_.compute_dtype});
    w = cast;
  }
  std::int32_t op = -1;
  // The backward of the two casts (see linear_forward).
  const DType od = lp.input_dtype == f_.compute_dtype ? f_.compute_dtype : lp.input_dtype;  // Linear4bit: out like x
  if (rules_.eager_elementwise && lp.input_dtype != f_.compute_dtype && !mod.is_output)
    compute("cast_io", layer, B,
            elementwise((dx >= 0 ? bytes(lp.input_dtype, rows * mod.in) + act(rows * mod.in) : 0) + bytes(od, rows * mod.out) + act(rows * mod.out)),
            ops::Cast{.src = dy, .n = rows * mod.out, .from = od, .to = f_.compute_dtype});
  if (dx >= 0) {
    op = compute(intern(mod.leaf), layer, B, gemm(rows, mod.in, mod.out, wbytes + act(rows * (mod.in + mod.out))),
                 ops::LinearBwdData{.dy = dy, .w = w, .dx = dx, .M = rows, .K = mod.in, .N = mod.out});
    if (!dx_first) compute_acc(op);
  }
  free(cast, B);
  if (lp.trainable_weight)
    op = compute(intern(mod.leaf), layer, B, gemm(mod.out, mod.in, rows, act(rows * (mod.in + mod.out)) + wbytes),
                 ops::LinearBwdWeight{.dy = dy, .x = x, .dw = weight_grad_of(mod.path), .M = rows, .K = mod.in, .N = mod.out});
  if (lp.adapter && lp.adapter->r > 0) {
    const Adapter& a = *lp.adapter;
    // dB = s·dyᵀu, du = s·dy·B, dA = duᵀx, dx += du·A: four skinny GEMMs through a [M, r]
    // temporary (and, with dropout, a [M, in] one for du·A before the mask).
    const std::int64_t scratch = rows * (a.r + (a.dropout > 0.0 ? mod.in : 0));
    const std::int32_t du = alloc([&] { return base + ".lora_du"; }, Cat::workspace, act(scratch), B);
    const DType ad = adapter_dtype(lp);
    const auto abytes = [&](std::int64_t n) { return rules_.eager_elementwise ? bytes(ad, n) : act(n); };
    sim::ComputeWork w1 = gemm(mod.out, a.r, rows, abytes(rows * (mod.out + a.r)));
    for (const auto& extra : {gemm(rows, a.r, mod.out, abytes(rows * (mod.out + a.r))), gemm(a.r, mod.in, rows, abytes(rows * (mod.in + a.r))),
                              gemm(rows, mod.in, a.r, abytes(rows * (mod.in + a.r))) }) {
      w1.flops += extra.flops;
      w1.bytes_moved += extra.bytes_moved;
    }
    w1.fp32_math = rules_.eager_elementwise && ad == DType::fp32 && f_.compute_dtype != DType::fp32;
    if (rules_.eager_elementwise) {  // the branch's elementwise backward, kernels of their own
      const double o = static_cast<double>(bytes_of(f_.compute_dtype)), adb = static_cast<double>(bytes_of(ad));
      compute("lora_eager_bwd", layer, B,
              elementwise(static_cast<std::uint64_t>(eager::lora_out_bwd(o, adb) * static_cast<double>(rows * mod.out) +
                                                     eager::lora_in_bwd(static_cast<double>(bytes_of(lp.input_dtype)), adb, a.dropout > 0.0) *
                                                         static_cast<double>(rows * mod.in))),
              ops::Accumulate{.in = dy});
    }
    op = compute("lora", layer, B, w1,
                 ops::LoraBwd{.dy = dy, .x_in = lp.xin_buf >= 0 ? lp.xin_buf : x, .a = a.a_buf, .b = a.b_buf, .u = lp.u_buf, .scratch = du,
                              .dx = dx, .da = a.ga_buf, .db = a.gb_buf, .M = rows, .K = mod.in, .N = mod.out, .r = a.r, .scale = a.scale,
                              .p = a.dropout, .adapter = a.index});
    free(du, B);
  } else if (lp.adapter) {
    op = compute("ia3", layer, B, elementwise(act(rows * mod.out) * 3, static_cast<double>(2 * rows * mod.out)),
                 ops::LoraBwd{.dy = dy, .M = rows, .K = mod.in, .N = mod.out, .adapter = lp.adapter->index});
  }
  return op;
}

void Builder::layer_forward(std::int32_t l, bool recompute) {
  const Phase P = recompute ? Phase::recompute : Phase::forward;
  const bool ckpt = checkpointed(l);
  // Saved tensors are activations, unless the layer is checkpointed: then they are transient in
  // forward and rebuilt as workspace in the recompute.
  const Cat keep = recompute || ckpt ? Cat::workspace : Cat::activations;
  const bool store = recompute || !ckpt;
  auto& saved = saved_[static_cast<std::size_t>(l)];
  std::vector<std::int32_t> transient;
  // What the layer allocates and keeps: its table (saved.h). A row that is not kept is
  // workspace, freed at its last use or the end of the layer's forward.
  const LayerTable& T = tables_[static_cast<std::size_t>(l)];
  auto& lin = lay_.layer_linears[static_cast<std::size_t>(l)];
  auto cat_for = [&](bool needed) { return needed && store ? keep : Cat::workspace; };
  // Called at a tensor's last use in the forward: saved for backward, or freed now (runtime
  // rule free_at_last_use) or at the end of the layer.
  auto keep_or_drop = [&](std::int32_t b, bool needed) {
    if (needed && store) saved.push_back(b);
    else if (rules_.free_at_last_use) free(b, P);
    else transient.push_back(b);
  };
  auto save = [&](std::int32_t b) { keep_or_drop(b, true); };
  std::vector<std::int32_t> scratch;  // a linear's saved tensors when nothing keeps them
  auto& kept = store ? saved : rules_.free_at_last_use ? scratch : transient;  // where linear_forward puts what backward needs
  auto flush = [&] {
    for (std::int32_t b : scratch) free(b, P);
    scratch.clear();
  };
  const std::size_t unit = static_cast<std::size_t>(l) + 1;
  gather_unit(unit, P, true);
  // Prefetch the next layer (or the head); FSDP's forward_prefetch is off by default.
  if (!recompute && (!fsdp() || s_.fsdp.forward_prefetch)) gather_unit(unit + 1, P, false);
  const std::int64_t H = m_.hidden, B = t_.micro_batch, S = M_ / t_.micro_batch;
  const std::string pre = names_ ? name_cat("layers.", l, ".mb", mb_) : std::string();
  const std::int32_t x = resid_[static_cast<std::size_t>(l)];
  // Slot s's tensor of the table, in category `cat`.
  auto alloc_slot = [&](Slot s, Cat cat) {
    const SavedTensor& r = *T.row(s);
    return alloc([&] { return name_cat(pre, '.', r.name); }, cat, r.bytes(), P);
  };

  // Args conventions (M = B·S rows, fp32 statistics):
  //   norm_fwd     {x [M,H], w [H], y [M,H], rstd [M]}: RMSNorm (LayerNorm: stats are mean, rstd)
  //   rope_fwd     {q [M,nh·d], k [M,nkv·d], tables}: rotates q and k in place
  //   attention_fwd {q, k, v, P [B,nh,S,S], out [M,nh·d]} (eager)
  //   flash_attention_fwd {q, k, v, lse [B,nh,S], out [M,nh·d]}
  //   residual_add {a, b, out}: out = a + b (out -1: nothing to write, as in a recompute)
  //   mlp_act_fwd  {gate [M,I], up [M,I], act [M,I]}: act = silu(gate) ⊙ up (GELU: {fc1, -1, act})
  LayerBufs& lb = lb_[static_cast<std::size_t>(l)];
  lb = LayerBufs{};
  // Runtime rules (the table's rows): an RMSNorm that computes in fp32 saves its input in fp32
  // (a copy unless the input is fp32 already, and then the input itself), and with a trainable
  // weight the normalised input too; the norm's output dtype is the stream's.
  const DType nd = stream_dtype();
  // Returns the saved copy of the input (-1: the norm keeps the input itself).
  auto norm_saves = [&](Slot x32, Slot normed) -> std::int32_t {
    std::int32_t copy = -1;
    if (T.row(x32)) save(copy = alloc_slot(x32, keep));
    if (T.row(normed)) save(alloc_slot(normed, keep));
    return copy;
  };
  // A linear of the layer (lin[i]) through its rows.
  auto linear = [&](std::size_t i, std::int32_t in, Cat out_cat, std::vector<std::int32_t>& into) {
    return linear_forward(lin[i], T.table.rows, T.linear[i], in, l, P, out_cat, keep, into);
  };
  // --- attention block ---
  const bool h1_needed = T.kept(Slot::norm1_out);
  const std::int32_t rstd1 = alloc_slot(Slot::norm1_stats, keep);
  const std::int32_t h1 = alloc_slot(Slot::norm1_out, cat_for(h1_needed));
  compute("input_norm", l, P, elementwise(norm_fwd_bytes(M_ * H, resid_dtype(l)), 4.0 * static_cast<double>(M_ * H)),
          ops::NormFwd{.x = x, .w = norm1_.empty() ? -1 : norm1_[static_cast<std::size_t>(l)], .y = h1, .rstd = rstd1, .M = M_, .H = H,
                       .eps = m_.norm_eps});
  save(rstd1);
  lb.norm1_x = norm_saves(Slot::norm1_x_fp32, Slot::norm1_normed);
  lb.rstd1 = rstd1;
  lb.h1 = h1;
  std::vector<std::int32_t> qkv;
  std::vector<std::size_t> qkv_linear;
  for (std::size_t i = 0; i < lin.size(); ++i)
    if (lin[i].role == Role::attn_in) {
      qkv.push_back(linear(i, h1, keep, kept));
      qkv_linear.push_back(i);
      flush();
    }
  keep_or_drop(h1, h1_needed);
  if (m_.rms_norm() || m_.arch == models::Arch::gpt_neox || m_.arch == models::Arch::falcon)
    compute("rope", l, P,
            elementwise(eager_or(eager::rope_fwd(1), M_ * (m_.q_width() + m_.kv_width()), nd, act(M_ * (m_.q_width() + m_.kv_width())) * 2)),
            ops::RopeFwd{{.q = qkv.empty() ? -1 : qkv[0], .k = qkv.size() > 1 ? qkv[1] : -1, .tables = rope_, .B = B, .S = S, .nh = m_.heads,
                          .nkv = m_.kv_heads, .d = m_.head_dim}});
  for (std::size_t j = 0; j < qkv.size(); ++j)  // the attention kernel takes (and saves) compute-dtype copies
    if (const SavedTensor* oc = linear_row(T.table.rows, T.linear[qkv_linear[j]], LinearSlot::out_compute)) {
      std::int32_t& b = qkv[j];
      const std::int64_t n = oc->elements();
      const std::int32_t c = alloc([&] { return p_.buffers[static_cast<std::size_t>(b)].name + "_compute"; }, keep, oc->bytes(), P);
      compute("to_compute_dtype", l, P, elementwise(bytes(nd, n) + act(n)), ops::Cast{.src = b, .dst = c, .n = n, .from = nd, .to = f_.compute_dtype});
      free(b, P);
      b = c;
    }
  for (std::size_t i = 0; i < qkv.size() && i < lb.qkv.size(); ++i) lb.qkv[i] = qkv[i];
  // Attention: eager materialises scores and keeps the probabilities [B, nh, S, S_kv];
  // flash keeps the log-sum-exp [B, nh, S] in fp32 (Dao et al., FlashAttention-2).
  const std::int64_t nh = m_.heads, d = m_.head_dim, kv = kv_len_;
  std::int32_t probs = -1, probs32 = -1;
  sim::ComputeWork aw = gemm(S, kv, d, 0);
  aw.gemm_count = static_cast<std::int32_t>(B * nh);
  aw.flops = 4.0 * static_cast<double>(B * nh) * static_cast<double>(S) * static_cast<double>(kv) * static_cast<double>(d);
  probs = alloc_slot(Slot::attn_scores, keep);
  aw.flops *= score_work_fraction();  // causal blocks above the diagonal: computed (eager) or skipped
  if (t_.attention == Attention::eager) {
    aw.bytes_moved = act(B * nh * S * kv) * 3 + act(M_ * (m_.q_width() + 2 * m_.kv_width()));
    if (T.row(Slot::attn_probs_fp32)) probs32 = alloc_slot(Slot::attn_probs_fp32, keep);  // the Llama family's code
  } else {
    aw.bytes_moved = act(M_ * (2 * m_.q_width() + 2 * m_.kv_width()));
  }
  const bool out_saved = T.kept(Slot::attn_out);
  const std::int32_t attn_out = alloc_slot(Slot::attn_out, cat_for(out_saved));
  const ops::Id q = qkv.empty() ? -1 : qkv[0], k = qkv.size() > 1 ? qkv[1] : -1, v = qkv.size() > 2 ? qkv[2] : -1;
  if (t_.attention == Attention::eager)
    compute("attention_eager", l, P, aw,
            ops::AttentionFwd{.q = q, .k = k, .v = v, .probs = probs, .out = attn_out, .B = B, .S = S, .nh = nh, .nkv = m_.kv_heads, .d = d});
  else
    compute("attention_flash", l, P, aw,
            ops::FlashAttentionFwd{.q = q, .k = k, .v = v, .lse = probs, .out = attn_out, .B = B, .S = S, .nh = nh, .nkv = m_.kv_heads, .d = d});
  for (std::int32_t b : qkv) save(b);
  save(probs);
  if (probs32 >= 0) save(probs32);
  lb.probs = probs;
  lb.attn_out = attn_out;
  std::int32_t y_attn = -1;
  for (std::size_t i = 0; i < lin.size(); ++i)
    if (lin[i].role == Role::attn_out) {
      y_attn = linear(i, attn_out, Cat::workspace, kept);
      flush();
    }
  keep_or_drop(attn_out, out_saved);
  // The residual after attention: the post-attention norm's input, saved by it (or by our
  // executor's norm backward), unless the norm saves an fp32 copy instead.
  const bool x_mid_saved = T.kept(Slot::resid_mid);
  const std::int32_t x_mid = alloc_slot(Slot::resid_mid, x_mid_saved ? keep : Cat::workspace);
  compute("residual", l, P, elementwise(act(M_ * H) * 3, static_cast<double>(M_ * H)), ops::ResidualAdd{.a = x, .b = y_attn, .out = x_mid, .n = M_ * H});
  free(y_attn, P);
  if (!rules_.free_at_last_use) keep_or_drop(x_mid, x_mid_saved);  // freed with the layer's transients
  lb.x_mid = x_mid;

  // --- MLP block ---
  const bool h2_needed = T.kept(Slot::norm2_out);
  const std::int32_t rstd2 = alloc_slot(Slot::norm2_stats, keep);
  const std::int32_t h2 = alloc_slot(Slot::norm2_out, cat_for(h2_needed));
  compute("post_attention_norm", l, P, elementwise(norm_fwd_bytes(M_ * H, resid_dtype(l)), 4.0 * static_cast<double>(M_ * H)),
          ops::NormFwd{.x = x_mid, .w = norm2_.empty() ? -1 : norm2_[static_cast<std::size_t>(l)], .y = h2, .rstd = rstd2, .M = M_, .H = H,
                       .eps = m_.norm_eps});
  save(rstd2);
  lb.norm2_x = norm_saves(Slot::norm2_x_fp32, Slot::norm2_normed);
  lb.rstd2 = rstd2;
  lb.h2 = h2;
  for (std::size_t i = 0; i < lin.size(); ++i)
    if (lin[i].role == Role::router) {
      std::int32_t r = linear(i, h2, keep, kept);
      flush();
      save(r);
    }
  std::vector<std::int32_t> mlp_in;
  for (std::size_t i = 0; i < lin.size(); ++i)
    if (lin[i].role == Role::mlp_in) {
      mlp_in.push_back(linear(i, h2, keep, kept));
      flush();
    }
  keep_or_drop(h2, h2_needed);
  for (std::size_t i = 0; i < mlp_in.size() && i < lb.gate_up.size(); ++i) lb.gate_up[i] = mlp_in[i];
  const std::int64_t I = m_.intermediate;
  const auto rows = static_cast<std::int64_t>(M_ * (m_.is_moe() ? m_.experts_per_token : 1));
  std::int32_t silu = -1;
  if (T.row(Slot::mlp_silu)) silu = per_expert(alloc_slot(Slot::mlp_silu, keep));  // silu(gate), kept by the mul with up
  const bool a_needed = T.kept(Slot::mlp_act);
  const std::int32_t a = per_expert(alloc_slot(Slot::mlp_act, cat_for(a_needed)));
  compute(m_.gated_mlp() ? "swiglu" : "gelu", l, P,
          elementwise(m_.gated_mlp() ? eager_or(eager::swiglu_fwd(1), rows * I, nd, act(rows * I) * 3) : act(rows * I) * 3, 6.0 * static_cast<double>(rows * I)),
          ops::MlpActFwd{.gate = mlp_in.empty() ? -1 : mlp_in[0], .up = mlp_in.size() > 1 ? mlp_in[1] : -1, .act = a, .n = rows * I});
  for (std::int32_t b : mlp_in) save(b);  // gate/up (SwiGLU) or fc1 (GELU) outputs
  if (silu >= 0) save(silu);
  std::int32_t y_mlp = -1;
  for (std::size_t i = 0; i < lin.size(); ++i)
    if (lin[i].role == Role::mlp_out) {
      std::int32_t y = linear(i, a, Cat::workspace, kept);
      flush();
      if (y_mlp < 0) y_mlp = y;
      else free(y, P);  // MoE experts write into one combined output
    }
  keep_or_drop(a, a_needed);
  lb.act = a;
  // The layer output is the next layer's input: kept as an activation in every mode (a
  // checkpointed layer's input is exactly this tensor).
  std::int32_t& x_out = resid_[static_cast<std::size_t>(l) + 1];
  if (!recompute) x_out = alloc_slot(Slot::layer_out, Cat::activations);
  // The recomputed output is what the checkpoint's backward differentiates
  // (CheckpointFunction.backward: torch.autograd.backward(outputs, args)): live through the
  // layer's backward under a runtime that materialises it.
  if (recompute && rules_.free_at_last_use)
    saved.push_back(alloc([&] { return name_cat(pre, ".resid_out.recomputed"); }, Cat::workspace, T.row(Slot::layer_out)->bytes(), P));
  compute("residual", l, P, elementwise(act(M_ * H) * 3, static_cast<double>(M_ * H)),
          ops::ResidualAdd{.a = x_mid, .b = y_mlp, .out = recompute ? -1 : x_out, .n = M_ * H});
  free(y_mlp, P);
  if (rules_.free_at_last_use) keep_or_drop(x_mid, x_mid_saved);  // after its last use, the add above
  for (std::int32_t b : transient) free(b, P);
  // Runtime rule: the layer's input lives only while something saves it. Without a checkpoint
  // only an fp32 input is (the norm saves it); otherwise the norm's fp32 copy replaced it.
  if (!recompute && !ckpt && rules_.layer_input_only_if_saved && T.row(Slot::norm1_x_fp32)) {
    free(resid_[static_cast<std::size_t>(l)], P);
    resid_[static_cast<std::size_t>(l)] = -1;
  }
  // Under no_grad nothing keeps the layer's input once the layer has run (no checkpoint).
  if (eval_ && !recompute && resid_[static_cast<std::size_t>(l)] >= 0) {
    free(resid_[static_cast<std::size_t>(l)], P);
    resid_[static_cast<std::size_t>(l)] = -1;
  }
  if (!recompute) release_unit(unit, P);
}

void Builder::layer_backward(std::int32_t l) {
  const Phase B = Phase::backward;
  const std::size_t unit = static_cast<std::size_t>(l) + 1;
  gather_unit(unit, B, true);
  if (checkpointed(l)) {
    layer_forward(l, true);  // rebuilds saved_[l] as workspace
    // FSDP: the recompute's post-forward reshards the unit and its pre-backward hook gathers it
    // again (_runtime_utils.py _post_forward_reshard, _pre_backward_hook).
    if (fsdp() && s_.stage != Stage::fsdp_shard_grad_op) {
      release_unit(unit, Phase::recompute);
      gather_unit(unit, B, true);
    }
  }
  // Prefetch the previous layer (or the embedding). FSDP's BACKWARD_PRE prefetches only a unit
  // whose forward ran with grad enabled (_register_pre_backward_hooks): not a checkpointed one.
  // BACKWARD_POST prefetches after this unit's gradients (below), with the unit resharded.
  const bool prefetch = !fsdp() || (l > 0 && (!checkpointed(l - 1) || !t_.checkpoint_reentrant) && s_.fsdp.backward_prefetch != FsdpPrefetch::none);
  if (prefetch && !(fsdp() && s_.fsdp.backward_prefetch == FsdpPrefetch::backward_post)) gather_unit(unit - 1, B, false);
  begin_unit_gradients(unit);
  auto& lin = lay_.layer_linears[static_cast<std::size_t>(l)];
  auto& saved = saved_[static_cast<std::size_t>(l)];
  const LayerBufs& lb = lb_[static_cast<std::size_t>(l)];
  const std::int64_t H = m_.hidden, I = m_.intermediate, Bm = t_.micro_batch, S = M_ / t_.micro_batch;
  const std::string pre = names_ ? name_cat("layers.", l, ".mb", mb_) : std::string();
  std::int32_t last = -1;
  // Args conventions (the residual-stream gradient dres_ [M,H] is updated in place):
  //   mlp_act_bwd   {d_act [M,I], gate, up, d_gate [M,I], d_up [M,I]} (overwrites d_gate, d_up)
  //   norm_bwd      {dy [M,H], x [M,H], w [H], rstd [M], dx [M,H]}: dx (=|+=) (Op::accumulate)
  //   attention_bwd {d_out [M,nh·d], P, q, k, v, dq, dk, dv (overwritten), scratch}: eager
  //                 only; the scratch is d_probs [B,nh,S,S], one S×S block per worker
  //   rope_bwd      {dq, dk, tables}: rotates the gradients back in place
  // MLP backward: dres -> d(act) -> d(gate), d(up) -> d(norm2 out) -> dres.
  const auto rows = static_cast<std::int64_t>(M_ * (m_.is_moe() ? m_.experts_per_token : 1));
  const std::int32_t d_act = per_expert(alloc([&] { return pre + ".mlp.d_act"; }, Cat::workspace, act(rows * I), B));
  bool first = true;
  for (auto& lp : lin)
    if (lp.role == Role::mlp_out) {
      last = linear_backward(lp, dres_, d_act, lb.act, l, first);
      first = false;
    }
  std::vector<std::int32_t> d_in;
  for (auto& lp : lin)
    if (lp.role == Role::mlp_in) d_in.push_back(alloc([&] { return name_cat(pre, '.', lp.mod->leaf, ".d_out"); }, Cat::workspace, act(static_cast<std::int64_t>(std::llround(static_cast<double>(M_) * lp.token_share)) * lp.mod->out), B));
  compute(m_.gated_mlp() ? "swiglu" : "gelu", l, B,
          elementwise(m_.gated_mlp() ? eager_or(eager::swiglu_bwd(1), rows * I, stream_dtype(), act(rows * I) * 5) : act(rows * I) * 5,
                      10.0 * static_cast<double>(rows * I)),
          ops::MlpActBwd{.d_act = d_act, .gate = lb.gate_up[0], .up = lb.gate_up[1], .d_gate = d_in.empty() ? -1 : d_in[0],
                         .d_up = d_in.size() > 1 ? d_in[1] : -1, .n = rows * I});
  free(d_act, B);
  const std::int32_t d_h2 = alloc([&] { return pre + ".norm2.d_out"; }, Cat::workspace, act(M_ * H), B);
  {
    std::size_t i = 0;
    first = true;
    for (auto& lp : lin)
      if (lp.role == Role::mlp_in) {
        last = linear_backward(lp, d_in[i++], d_h2, lb.h2, l, first);
        first = false;
      }
    for (auto& lp : lin)
      if (lp.role == Role::router) {
        last = linear_backward(lp, -1, d_h2, lb.h2, l, first);
        first = false;
      }
  }
  for (std::int32_t b : d_in) free(b, B);
  compute_acc(compute("post_attention_norm", l, B, elementwise(norm_bwd_bytes(M_ * H, resid_dtype(l)), 8.0 * static_cast<double>(M_ * H)),
                      ops::NormBwd{.dy = d_h2, .x = lb.norm2_x >= 0 ? lb.norm2_x : lb.x_mid,
                                   .w = norm2_.empty() ? -1 : norm2_[static_cast<std::size_t>(l)], .rstd = lb.rstd2, .dx = dres_, .M = M_, .H = H}));
  free(d_h2, B);
  // Attention backward.
  const std::int32_t d_attn = alloc([&] { return pre + ".attn.d_out"; }, Cat::workspace, act(M_ * m_.q_width()), B);
  first = true;
  for (auto& lp : lin)
    if (lp.role == Role::attn_out) {
      last = linear_backward(lp, dres_, d_attn, lb.attn_out, l, first);
      first = false;
    }
  std::vector<std::int32_t> d_qkv;
  for (auto& lp : lin)
    if (lp.role == Role::attn_in) d_qkv.push_back(alloc([&] { return name_cat(pre, '.', lp.mod->leaf, ".d_out"); }, Cat::workspace, act(M_ * lp.mod->out), B));
  const std::int64_t nh = m_.heads, d = m_.head_dim, kv = kv_len_;
  sim::ComputeWork aw = gemm(S, kv, d, 0);
  aw.gemm_count = static_cast<std::int32_t>(Bm * nh);
  aw.flops = 8.0 * static_cast<double>(Bm * nh) * static_cast<double>(S) * static_cast<double>(kv) * static_cast<double>(d);
  std::int32_t dprobs = -1;
  aw.flops *= score_work_fraction();
  if (t_.attention == Attention::eager) {
    dprobs = alloc([&] { return pre + ".attn.d_probs"; }, Cat::workspace, act(Bm * nh * S * kv), B);
    aw.bytes_moved = act(Bm * nh * S * kv) * 4 + act(M_ * (2 * m_.q_width() + 4 * m_.kv_width()));
  } else {
    aw.flops *= 1.25;  // FlashAttention-2 backward recomputes the scores (5 GEMMs instead of 4)
    aw.bytes_moved = act(M_ * (3 * m_.q_width() + 4 * m_.kv_width()));
  }
  const ops::Id dq = d_qkv.empty() ? -1 : d_qkv[0], dk = d_qkv.size() > 1 ? d_qkv[1] : -1, dv = d_qkv.size() > 2 ? d_qkv[2] : -1;
  if (t_.attention == Attention::eager)
    compute("attention_eager", l, B, aw,
            ops::AttentionBwd{.d_out = d_attn, .probs = lb.probs, .q = lb.qkv[0], .k = lb.qkv[1], .v = lb.qkv[2], .dq = dq, .dk = dk, .dv = dv,
                              .scratch = dprobs, .B = Bm, .S = S, .nh = nh, .nkv = m_.kv_heads, .d = d});
  else  // flash reads the forward's output, which it saved (saved.cpp, Slot::attn_out)
    compute("attention_flash", l, B, aw,
            ops::FlashAttentionBwd{.d_out = d_attn, .q = lb.qkv[0], .k = lb.qkv[1], .v = lb.qkv[2], .out = lb.attn_out, .lse = lb.probs, .dq = dq,
                                   .dk = dk, .dv = dv, .B = Bm, .S = S, .nh = nh, .nkv = m_.kv_heads, .d = d});
  free(dprobs, B);
  free(d_attn, B);
  if (m_.rms_norm() || m_.arch == models::Arch::gpt_neox || m_.arch == models::Arch::falcon)
    compute("rope", l, B,
            elementwise(eager_or(eager::rope_bwd(1), M_ * (m_.q_width() + m_.kv_width()), stream_dtype(), act(M_ * (m_.q_width() + m_.kv_width())) * 2)),
            ops::RopeBwd{{.q = d_qkv.empty() ? -1 : d_qkv[0], .k = d_qkv.size() > 1 ? d_qkv[1] : -1, .tables = rope_, .B = Bm, .S = S, .nh = nh,
                          .nkv = m_.kv_heads, .d = d}});
  const std::int32_t d_h1 = alloc([&] { return pre + ".norm1.d_out"; }, Cat::workspace, act(M_ * H), B);
  {
    std::size_t i = 0;
    first = true;
    for (auto& lp : lin)
      if (lp.role == Role::attn_in) {
        last = linear_backward(lp, d_qkv[i++], d_h1, lb.h1, l, first);
        first = false;
      }
  }
  for (std::int32_t b : d_qkv) free(b, B);
  last = compute_acc(compute("input_norm", l, B, elementwise(norm_bwd_bytes(M_ * H, resid_dtype(l)), 8.0 * static_cast<double>(M_ * H)),
                             ops::NormBwd{.dy = d_h1, .x = lb.norm1_x >= 0 ? lb.norm1_x : resid_[static_cast<std::size_t>(l)],
                                          .w = norm1_.empty() ? -1 : norm1_[static_cast<std::size_t>(l)], .rstd = lb.rstd1, .dx = dres_, .M = M_,
                                          .H = H}));
  free(d_h1, B);
  // Everything the layer saved is released, and so is its input (the previous layer's output).
  for (std::int32_t b : saved) free(b, B);
  saved.clear();
  if (fsdp_retains(l)) {
    // FSDP (torch 2.4) registers a multi-grad hook on a frozen unit's input in the recomputed
    // forward (_register_post_backward_reshard_only_hook -> autograd/graph.py
    // register_multi_grad_hook): its closure holds the input's AccumulateGrad node, a reference
    // cycle the cyclic GC cannot see (pytorch/pytorch#183211, #139214), broken only when the final
    // callback removes the hook. The checkpoint input and its gradient live until backward ends:
    // this layer's input, and the gradient of the layer above's input, which this layer consumed.
    retained_.push_back(resid_[static_cast<std::size_t>(l)]);
  } else {
    free(resid_[static_cast<std::size_t>(l)], B);
  }
  if (l + 1 < m_.layers && fsdp_retains(l + 1))
    retained_.push_back(alloc([&] { return name_cat("layers.", l + 1, ".mb", mb_, ".input_grad.retained"); }, Cat::activations, act(M_ * H), B));
  resid_[static_cast<std::size_t>(l)] = -1;
  release_unit(unit, B);
  unit_gradients_done(unit, last);
  if (prefetch && fsdp() && s_.fsdp.backward_prefetch == FsdpPrefetch::backward_post) gather_unit(unit - 1, B, false);
}

// LossChain::hf_shift_copy: transformers 4.48.1 loss/loss_utils.py ForCausalLMLoss
// (`logits = logits.float()`, `shift_logits = logits[..., :-1, :].contiguous()`,
// `nn.functional.cross_entropy(..., reduction="sum")`; the .contiguous() copy is the one
// huggingface/transformers#35646 removed after 4.48). The model's bf16 logits live until forward
// returns; log_softmax saves its result. Backward (derivatives.yaml): nll_loss_backward and
// _log_softmax_backward_data allocate dense gradients, the slice's backward a zero-filled
// full-length one, and the .float() backward casts it back. Returns the logits' gradient.
std::int32_t Builder::hf_loss(std::int32_t logits, std::int32_t tokens) {
  const Phase L = Phase::loss, B = Phase::backward;
  const std::int64_t V = m_.vocab, T = M_, Tv = M_ - t_.micro_batch;  // Tv: positions with a next token
  const std::string pre = names_ ? name_cat("loss.mb", mb_) : std::string();
  // .float() of fp32 logits is the tensor itself (and its backward the identity).
  const bool upcast = f_.compute_dtype != DType::fp32;
  const std::int32_t up = upcast ? alloc([&] { return pre + ".logits_fp32"; }, Cat::workspace, f32(T * V), L) : logits;
  if (upcast)
    compute("upcast_logits", -1, L, elementwise(act(T * V) + f32(T * V)),
            ops::Cast{.src = logits, .dst = up, .n = T * V, .from = f_.compute_dtype, .to = DType::fp32});
  const std::int32_t shifted = alloc([&] { return pre + ".shift_logits"; }, Cat::workspace, f32(Tv * V), L);
  compute("shift_logits", -1, L, elementwise(2 * f32(Tv * V)), ops::Accumulate{.in = up, .out = shifted});
  const std::int32_t lsm = alloc([&] { return pre + ".log_softmax"; }, Cat::workspace, f32(Tv * V), L);
  compute("cross_entropy", -1, L, elementwise(2 * f32(Tv * V), 3.0 * static_cast<double>(Tv * V)),
          ops::CrossEntropyFwd{.logits = shifted, .tokens = tokens, .M = Tv, .V = V});
  free(shifted, L);
  if (upcast) free(up, L);
  free(logits, L);
  if (eval_) {  // no_grad: log_softmax's result is a temporary of the loss
    free(lsm, L);
    return -1;
  }
  const std::int32_t g_nll = alloc([&] { return pre + ".d_nll"; }, Cat::workspace, f32(Tv * V), B);
  compute("nll_loss_backward", -1, B, elementwise(f32(Tv * V)),
          ops::CrossEntropyBwd{.logits = lsm, .tokens = tokens, .d_logits = g_nll, .M = Tv, .V = V, .divisor = loss_divisor()});
  const std::int32_t g_lsm = alloc([&] { return pre + ".d_log_softmax"; }, Cat::workspace, f32(Tv * V), B);
  compute("log_softmax_backward", -1, B, elementwise(3 * f32(Tv * V), 2.0 * static_cast<double>(Tv * V)),
          ops::CrossEntropyBwd{.logits = lsm, .tokens = tokens, .d_logits = g_lsm, .M = Tv, .V = V, .divisor = loss_divisor()});
  free(g_nll, B);
  free(lsm, B);
  const std::int32_t g_up = alloc([&] { return pre + ".d_logits_fp32"; }, Cat::workspace, f32(T * V), B);
  compute("slice_backward", -1, B, elementwise(f32(T * V) + f32(Tv * V)), ops::Accumulate{.in = g_lsm, .out = g_up});
  free(g_lsm, B);
  if (!upcast) return g_up;
  const std::int32_t d = alloc([&] { return pre + ".d_logits"; }, Cat::workspace, act(T * V), B);
  compute("downcast_grad", -1, B, elementwise(f32(T * V) + act(T * V)), ops::Cast{.src = g_up, .dst = d, .n = T * V, .from = DType::fp32, .to = f_.compute_dtype});
  free(g_up, B);
  return d;
}

// CrossEntropy::chunked: Liger-Kernel's fused linear cross-entropy
// (src/liger_kernel/ops/fused_linear_cross_entropy.py, fused_linear_cross_entropy_forward). The
// tokens are cut into chunks of next_power_of_2(ceil(BT / ceil(V / H))) rows, so that a chunk's
// logits are about as large as the input; per chunk the head's GEMM, the cross-entropy kernel
// writing the logits' gradient in place, and the GEMMs into grad_input (and the head's weight
// gradient when it trains) run in the forward. It keeps grad_input [BT, H] and an fp32 loss per
// token; backward only scales grad_input (element_mul_kernel). Returns grad_input.
std::int32_t Builder::fused_loss(LinearPlan& lm, std::int32_t x, std::int32_t tokens) {
  const Phase L = Phase::loss;
  const std::int64_t V = m_.vocab, H = m_.hidden, BT = M_;
  const std::int64_t inc = (V + H - 1) / H;
  std::int64_t chunk = 1;
  while (chunk < (BT + inc - 1) / inc) chunk <<= 1;
  chunk = std::min(chunk, BT);
  const std::string pre = names_ ? name_cat("loss.mb", mb_) : std::string();
  const std::int32_t grad_in = alloc([&] { return pre + ".grad_input"; }, Cat::workspace, act(BT * H), L);
  const std::int32_t loss1d = alloc([&] { return pre + ".loss_1d"; }, Cat::workspace, f32(BT), L);
  const std::uint64_t wbytes = act(V * H);
  for (std::int64_t lo = 0; lo < BT; lo += chunk) {
    const std::int64_t rows = std::min(chunk, BT - lo);
    const std::int32_t lc = alloc([&] { return pre + ".logits_chunk"; }, Cat::workspace, act(rows * V), L);
    compute(intern(lm.mod->leaf), -1, L, gemm(rows, V, H, wbytes + act(rows * (H + V))),
            ops::LinearFwd{.x = x, .w = lm.weight_buf, .y = lc, .M = rows, .K = H, .N = V});
    compute("cross_entropy", -1, L, elementwise(2 * act(rows * V), 5.0 * static_cast<double>(rows * V)),
            ops::CrossEntropyFwd{.logits = lc, .tokens = tokens, .M = rows, .V = V});
    compute(intern(lm.mod->leaf), -1, L, gemm(rows, H, V, wbytes + act(rows * (H + V))),
            ops::LinearBwdData{.dy = lc, .w = lm.weight_buf, .dx = grad_in, .M = rows, .K = H, .N = V});
    if (lm.trainable_weight)
      compute(intern(lm.mod->leaf), -1, L, gemm(V, H, rows, wbytes + act(rows * (H + V))),
              ops::LinearBwdWeight{.dy = lc, .x = x, .dw = weight_grad_of(lm.mod->path), .M = rows, .K = H, .N = V});
    free(lc, L);
  }
  free(loss1d, L);
  return grad_in;
}

void Builder::micro_batch(std::int32_t mb) {
  mb_ = mb;
  const Phase F = Phase::forward, B = Phase::backward;
  const std::int64_t H = m_.hidden, V = m_.vocab;
  resid_.assign(static_cast<std::size_t>(m_.layers) + 1, -1);
  saved_.assign(static_cast<std::size_t>(m_.layers), {});
  lb_.assign(static_cast<std::size_t>(m_.layers), LayerBufs{});
  // Args conventions of the embedding and the head:
  //   tokens.mbN          int32 [M] input ids, then int32 [M] targets (ids shifted by one);
  //                       the data loader fills it when it is allocated
  //   embedding_fwd       {tokens, table [V,H], out [M,H]}
  //   norm_fwd / norm_bwd as in the layers, with model.norm.weight
  //   cross_entropy_fwd   {logits [M,V] fp32, tokens}: the loss sum of the micro-batch
  //   cross_entropy_bwd   {logits, tokens, d_logits [M,V]}: (softmax − onehot) / (tokens of the
  //                       whole step on all ranks); d_logits may be logits itself (in place)
  //   embedding_bwd       {tokens, d_out [M,H], d_table}: full fine-tuning only
  // Tokens and targets (int32) for the micro-batch.
  const std::int32_t tokens = alloc([&] { return name_cat("tokens.mb", mb); }, Cat::workspace, rules_.batch_bytes_per_token * static_cast<std::uint64_t>(M_), F);
  gather_unit(0, F, true);
  if (fsdp()) gather_unit(lay_.units.size() - 1, F, true);  // the root unit: embedding and head
  else gather_unit(1, F, false);
  resid_[0] = alloc([&] { return name_cat("embed.mb", mb, ".out"); }, Cat::activations, act(M_ * H), F);
  compute("embedding", -1, F, elementwise(act(M_ * H) * 2), ops::EmbeddingFwd{.tokens = tokens, .table = embed_buf_, .out = resid_[0], .M = M_, .V = V, .H = H});
  const bool embed_trains = lay_.units[0].trainable_numel > 0 && in_.peft.adapters.empty();
  release_unit(0, F);
  // Runtime rule: autocast keeps a compute-dtype copy of every fp32 adapter weight it casts
  // until the forward's autocast region closes (the end of the loss).
  std::int32_t autocast_cache = -1;
  // (Under FSDP's MixedPrecision the adapters compute from gathered compute-dtype copies: no cache.)
  if (rules_.autocast_weight_cache && !fsdp() && !in_.peft.adapters.empty() && f_.trainable_dtype != f_.compute_dtype)
    autocast_cache = alloc([&] { return name_cat("autocast.weight_cache.mb", mb); }, Cat::workspace, act(lay_.trainable_numel - lay_.extra_trainable_numel), F);
  for (std::int32_t l = 0; l < static_cast<std::int32_t>(m_.layers); ++l) layer_forward(l, false);
  // Head: final norm, LM head, cross-entropy (logits upcast to fp32 as transformers' loss does).
  // ZeRO-3 gathers the head for its forward and again for its backward (a tied head is the
  // embedding, so that unit is gathered with it).
  const std::size_t head = lay_.units.size() - 1;
  const bool tied = m_.tie_embeddings;
  gather_unit(head, F, true);
  if (tied) gather_unit(0, F, true);
  if (ag_held_ >= 0) {  // FSDP2: the root's post-forward drops the last all-gather state
    free(ag_held_, F);
    ag_held_ = -1;
  }
  std::int32_t xl = resid_.back();
  const std::int32_t rstd = alloc([&] { return name_cat("final_norm.mb", mb, ".stats"); }, Cat::activations, f32(M_) * (m_.rms_norm() ? 1 : 2), F);
  const std::int32_t hf = alloc([&] { return name_cat("final_norm.mb", mb, ".out"); }, Cat::workspace, bytes(stream_dtype(), M_ * H), F);
  compute("final_norm", -1, F, elementwise(norm_fwd_bytes(M_ * H, resid_dtype(m_.layers)), 4.0 * static_cast<double>(M_ * H)),
          ops::NormFwd{.x = xl, .w = final_norm_, .y = hf, .rstd = rstd, .M = M_, .H = H, .eps = m_.norm_eps});
  std::vector<std::int32_t> head_saved;
  bool hf_freed = false;
  // The final norm under the runtime rule of the layers' norms: an fp32 copy of a
  // compute-dtype input replaces the input (and the normalised input when the weight trains).
  if (rules_.norm_saves_fp32_input && m_.rms_norm()) {
    const DType xd = resid_dtype(m_.layers);
    if (xd != DType::fp32) {
      head_saved.push_back(alloc([&] { return name_cat("final_norm.mb", mb, ".x_fp32"); }, Cat::activations, f32(M_ * H), F));
      if (rules_.layer_input_only_if_saved) {
        free(xl, F);
        resid_.back() = xl = -1;
      }
    }
    if (in_.peft.adapters.empty())
      head_saved.push_back(alloc([&] { return name_cat("final_norm.mb", mb, ".normed"); }, Cat::activations, bytes(xd, M_ * H), F));
  }
  if (eval_) {  // no_grad: the norm's copies and statistics die with it, and so does its input
    for (std::int32_t b : head_saved) free(b, F);
    head_saved.clear();
    free(rstd, F);
    if (xl >= 0) free(xl, F);
    resid_.back() = -1;
  }
  LinearPlan* lm = nullptr;
  for (auto& lp : lay_.head_linears)
    if (lp.mod->is_output) lm = &lp;
  PEFTPLAN_CHECK(lm != nullptr);
  if (lm->weight_buf < 0) lm->weight_buf = embed_buf_;  // tied head
  const bool fused = t_.cross_entropy == CrossEntropy::chunked;
  std::int32_t logits = -1, grad_in = -1;
  if (fused) grad_in = fused_loss(*lm, hf, tokens);
  else {
    std::vector<SavedTensor> head_rows;
    const LinearRows lr = linear_rows(head_rows, *lm, f_.compute_dtype, false, "the logits: the loss reads them");
    logits = linear_forward(*lm, head_rows, lr, hf, -1, Phase::loss, Cat::workspace, Cat::activations, head_saved);
  }
  release_unit(head, Phase::loss);
  if (tied) release_unit(0, Phase::loss);
  std::int32_t dlogits = -1;
  if (fused) {
    free(autocast_cache, Phase::loss);
    // The fused loss saves only its gradients: the head's input goes with the model's outputs.
    if (rules_.free_at_last_use) {
      free(hf, Phase::loss);
      hf_freed = true;
    }
  } else if (rules_.loss == LossChain::hf_shift_copy) {
    dlogits = hf_loss(logits, tokens);
    if (eval_) return;  // evaluation: the loss is all that runs
    free(autocast_cache, Phase::loss);
    // The model's outputs are gone once forward returns: the final norm's output stays only
    // when the LM head saves it (a trainable head).
    if (!lm->needs_input()) {
      free(hf, Phase::loss);
      hf_freed = true;
    }
  } else {
    std::int32_t logits32 = logits;
    if (f_.compute_dtype != DType::fp32) {
      logits32 = alloc([&] { return name_cat("logits_fp32.mb", mb); }, Cat::workspace, f32(M_ * V), Phase::loss);
      compute("upcast_logits", -1, Phase::loss, elementwise(act(M_ * V) + f32(M_ * V)),
              ops::Cast{.src = logits, .dst = logits32, .n = M_ * V, .from = f_.compute_dtype, .to = DType::fp32});
      free(logits, Phase::loss);
    }
    free(autocast_cache, Phase::loss);
    compute("cross_entropy", -1, Phase::loss, elementwise(f32(M_ * V), 3.0 * static_cast<double>(M_ * V)),
            ops::CrossEntropyFwd{.logits = logits32, .tokens = tokens, .M = M_, .V = V});
    compute("cross_entropy", -1, Phase::loss, elementwise(f32(M_ * V) * 2, 2.0 * static_cast<double>(M_ * V)),
            ops::CrossEntropyBwd{.logits = logits32, .tokens = tokens, .d_logits = logits32, .M = M_, .V = V, .divisor = loss_divisor()});
    dlogits = logits32;
    if (f_.compute_dtype != DType::fp32) {
      dlogits = alloc([&] { return name_cat("d_logits.mb", mb); }, Cat::workspace, act(M_ * V), B);
      compute("downcast_grad", -1, B, elementwise(act(M_ * V) + f32(M_ * V)),
              ops::Cast{.src = logits32, .dst = dlogits, .n = M_ * V, .from = DType::fp32, .to = f_.compute_dtype});
      free(logits32, B);
    }
  }
  // Runtime rule: the gradients come to exist when backward first reaches one.
  if (mb == 0)
    for (std::int32_t g : lazy_grads_) alloc_buffer(g, B);
  gather_unit(head, B, true);
  if (tied) gather_unit(0, B, true);
  begin_unit_gradients(head);
  const bool hf_needed = lm->needs_input();
  std::int32_t d_hf = grad_in, last = -1;
  if (fused) {  // element_mul_kernel: grad_input *= grad_output, in place
    last = compute("scale_grad_input", -1, B, elementwise(2 * act(M_ * H), static_cast<double>(M_ * H)), ops::Accumulate{.in = d_hf});
  } else {
    d_hf = alloc([&] { return name_cat("final_norm.mb", mb, ".d_out"); }, Cat::workspace, act(M_ * H), B);
    last = linear_backward(*lm, dlogits, d_hf, hf_needed ? hf : -1, -1, true);
  }
  free(dlogits, B);
  if (!hf_freed) free(hf, B);
  for (std::int32_t b : head_saved) free(b, B);
  dres_ = alloc([&] { return name_cat("d_resid.mb", mb); }, Cat::workspace, act(M_ * H), B);
  last = compute("final_norm", -1, B, elementwise(norm_bwd_bytes(M_ * H, resid_dtype(m_.layers)), 8.0 * static_cast<double>(M_ * H)),
                 ops::NormBwd{.dy = d_hf, .x = xl, .w = final_norm_, .rstd = rstd, .dx = dres_, .M = M_, .H = H});
  free(d_hf, B);
  free(rstd, B);
  free(xl, B);
  release_unit(head, B);
  if (tied) release_unit(0, B);
  unit_gradients_done(head, last);
  for (std::int32_t l = static_cast<std::int32_t>(m_.layers) - 1; l >= 0; --l) layer_backward(l);
  // DeepSpeed's pre-backward hook gathers the embedding's parameters even though its backward
  // only scatters into the gradient.
  gather_unit(0, B, true);
  begin_unit_gradients(0);
  if (embed_trains)
    last = compute("embedding", -1, B, elementwise(act(M_ * H) * 2),
                   ops::EmbeddingBwd{.tokens = tokens, .d_out = dres_, .d_table = embed_grad_ >= 0 ? embed_grad_ : grad_flat_, .M = M_, .V = V, .H = H});
  wait_ = -1;
  release_unit(0, B, true);
  release_unit(head, B, true);
  if (rs_held_ >= 0) {  // FSDP2: the root's final callback drops the last reduce-scatter state
    free(rs_held_, B);
    rs_held_ = -1;
  }
  unit_gradients_done(0, last_compute_);
  for (std::int32_t b : retained_) free(b, B);  // FSDP's final callback removes its hooks
  retained_.clear();
  free(dres_, B);
  dres_ = -1;
  free(resid_[0], B);
  free(tokens, B);
}

}  // namespace peftplan::planner::builder
