// explain_plan (see explain.h): the buffers live at the device peak, grouped and sized.
#include "peftplan/planner/explain.h"

#include <algorithm>
#include <cctype>
#include <map>
#include <optional>

#include <fmt/format.h>

#include "peftplan/common/dtype.h"
#include "peftplan/common/units.h"
#include "peftplan/planner/closed_forms.h"

namespace peftplan::planner {
namespace {

using sim::MemCategory;

// "model.layers.12.mlp.up_proj.mb0.out" -> "model.layers.N.mlp.up_proj.mb0.out": layer and
// expert indices become N; micro-batch indices stay (mb0 and mb1 are different micro-steps).
std::string pattern_of(const std::string& name) {
  std::string out;
  for (std::size_t i = 0; i < name.size();) {
    const bool after_mb = i >= 2 && name.compare(i - 2, 2, "mb") == 0;
    if (std::isdigit(static_cast<unsigned char>(name[i])) && !after_mb && (i == 0 || name[i - 1] == '.')) {
      while (i < name.size() && std::isdigit(static_cast<unsigned char>(name[i]))) ++i;
      out += 'N';
    } else {
      out += name[i++];
    }
  }
  return out;
}

struct Dim {
  std::string symbol;
  std::int64_t value;
  std::string meaning;
};

struct Shape {
  std::string formula;           // "B·S·H"
  std::vector<std::int64_t> factors;
};

// What a buffer is, by the end of its name (the builder's names); the rule's source where the
// builder cites one.
struct Note {
  std::string_view suffix;
  std::string_view text;
};
constexpr Note kNotes[] = {
    {".x_fp32", "an RMSNorm's input in fp32, saved for its backward (transformers LlamaRMSNorm: hidden_states.to(torch.float32))"},
    {".stats", "an RMSNorm's 1/rms per row, saved for its backward"},
    {"attn.lse", "flash attention's log-sum-exp per row and head, saved for its backward"},
    {"attn.probs", "eager attention's probabilities [B, nh, S, S], saved for its backward"},
    {"attn.out", "the attention output, o_proj's input: saved for o_proj's adapter or weight gradient, and by flash attention for its own backward (FlashAttnFunc)"},
    {"mlp.silu", "SiLU(gate), saved for the mul's backward (SwiGLU unfused in eager PyTorch)"},
    {"mlp.act", "the MLP activation, saved for its backward"},
    {".lora_u", "LoRA's x·Aᵀ [B·S, r], saved for B's gradient"},
    {".lora_x", "the dropped-out input of a LoRA branch (PEFT's dropout makes a copy per target module)"},
    {"gate_proj.mb0.out", "gate_proj's output, saved for SiLU's and the mul's backward"},
    {"up_proj.mb0.out", "up_proj's output, saved for the mul's backward"},
    {"proj.mb0.out", "a projection's output, saved for the op after it"},
    {".out", "an op's output, kept as the next op's saved input"},
    {"lm_head.mb0.out", "the logits [B·S, V] in the compute dtype"},
    {"logits_fp32", "the logits upcast to fp32 for the loss (LlamaForCausalLM: logits = logits.float())"},
    {"shift_logits", "shift_logits = logits[..., :-1, :].contiguous(): a copy without the last position"},
    {"log_softmax", "cross-entropy's log_softmax, saved for its backward"},
    {"cublas.workspace", "a cuBLAS workspace per handle: 4096 KiB × 2 + 16 KiB × 8 = 8,519,680 B, or 32 MiB on sm90 "
                         "(aten/src/ATen/cuda/CublasHandlePool.cpp, torch 2.4)"},
    {"rope.tables", "RoPE's cos and sin tables"},
    {"tokens.mb0", "the batch's token ids and labels"},
    {"optimizer.states", "AdamW's exp_avg and exp_avg_sq, 2 × 4 B per trainable parameter (torch/optim/adamw.py)"},
    {"optimizer.master_fp32", "the fp32 master copy of the trainable parameters, 4 B each (mixed precision)"},
    {"grad.flat", "the trainable parameters' gradients"},
    {"grad.shard", "this rank's shard of the gradients (ZeRO-2/3, FSDP)"},
    {"trainable.flat", "the trainable parameters"},
    {"trainable.shard", "this rank's shard of the trainable parameters"},
    {"frozen.shard", "this rank's shard of the frozen base (ZeRO-3 / FSDP: ⌈numel / N⌉ elements)"},
    {"frozen.persistent", "frozen tensors kept whole on every rank (DeepSpeed: below stage3_param_persistence_threshold; "
                          "under FSDP, bitsandbytes' QuantState, which is no parameter)"},
    {"gathered.forward", "a unit's parameters all-gathered for its forward"},
    {"gathered.backward", "a unit's parameters all-gathered for its backward"},
    {"input_grad.retained", "a frozen unit's input gradient, which FSDP1's hook keeps to the end of backward under reentrant "
                            "checkpointing (torch 2.4)"},
    {"resid_out.recomputed", "a checkpointed layer's output, recomputed in backward"},
    {"resid_out", "a checkpointed layer's input, saved for its recompute"},
    {".recomputed", "recomputed in backward (activation checkpointing)"},
    {"d_resid", "the residual stream's gradient"},
    {".d_out", "an op's output gradient in backward"},
    {".d_act", "the MLP activation's gradient in backward"},
    {"grad.bucket", "a gradient bucket waiting for its reduction"},
    {"embed.mb0.out", "the embedding's output, the first layer's input"},
    {"ipg_buffer", "DeepSpeed's gradient reduction bucket (stage_1_and_2.py / stage3.py ipg buffer)"},
    {".weight", "a frozen weight in its storage dtype"},
};

std::string note_for(const std::string& pattern) {
  for (const auto& n : kNotes)
    if (pattern.size() >= n.suffix.size() && pattern.compare(pattern.size() - n.suffix.size(), n.suffix.size(), n.suffix) == 0) return std::string(n.text);
  for (const auto& n : kNotes)
    if (pattern.find(n.suffix) != std::string::npos) return std::string(n.text);
  return "";
}

std::string dtype_word(int bytes, DType compute) {
  switch (bytes) {
    case 1: return "int8";
    case 2: return std::string(name_of(compute == DType::fp32 ? DType::bf16 : compute));
    case 4: return "fp32";
    case 8: return "int64";
  }
  return "";
}

}  // namespace

Explanation explain_plan(const Plan& p) {
  Explanation e;
  const auto& in = p.input;
  const auto& m = in.model;
  const auto& t = in.training;
  const std::int64_t r = in.peft.adapters.empty() ? 0 : in.peft.adapters[0].lora.r;
  const std::int64_t N = std::max(1, in.strategy.ranks);
  std::vector<Dim> dims = {{"B", t.micro_batch, "micro-batch"}, {"S", t.seq_len, "tokens per sequence"}, {"H", m.hidden, "hidden size"},
                           {"I", m.intermediate, "MLP width"},    {"V", m.vocab, "vocabulary"},           {"nh", m.heads, "attention heads"},
                           {"nkv", m.kv_heads, "key/value heads"}, {"d", m.head_dim, "head width"},         {"N", N, "data-parallel ranks"}};
  if (r > 0) dims.push_back({"r", r, "LoRA rank"});
  const std::int64_t psi_t = p.facts.trainable_params;
  dims.push_back({"Ψt", psi_t, "trainable parameters"});
  for (const auto& d : dims) e.dims.push_back(fmt::format("{} = {} ({})", d.symbol, with_commas(d.value), d.meaning));
  auto v = [&](const std::string& s) {
    for (const auto& d : dims)
      if (d.symbol == s) return d.value;
    return std::int64_t{0};
  };
  const std::int64_t B = v("B"), S = v("S"), H = v("H"), I = v("I"), V = v("V"), nh = v("nh"), nkv = v("nkv"), d = v("d");
  // Shapes in the order a reader expects them; the first whose size matches, in a dtype the
  // category holds, names the buffer. Batch shapes size activations and workspace, parameter
  // shapes the model states; a multiple (c ×) only where several tensors share a buffer (RoPE's
  // cos and sin, the batch's ids, mask and labels, a layer's two norms).
  struct Shaped {
    Shape shape;
    bool batch;
    bool multiple;
  };
  std::vector<Shaped> shapes = {
      {{"B·S·H", {B, S, H}}, true, false},         {{"B·S·I", {B, S, I}}, true, false},     {{"B·S·V", {B, S, V}}, true, false},
      {{"B·(S−1)·V", {B, S - 1, V}}, true, false}, {{"B·nh·S·S", {B, nh, S, S}}, true, false}, {{"B·nh·S", {B, nh, S}}, true, false},
      {{"B·S·nkv·d", {B, S, nkv, d}}, true, false}, {{"B·S", {B, S}}, true, true},          {{"S·d", {S, d}}, true, true},
      {{"⌈Ψt / N⌉", {(psi_t + N - 1) / N}}, false, true}, {{"Ψt", {psi_t}}, false, true},   {{"V·H", {V, H}}, false, false},
      {{"H·I", {H, I}}, false, false},             {{"H·H", {H, H}}, false, false},         {{"nkv·d·H", {nkv, d, H}}, false, false},
      {{"H", {H}}, false, true},
  };
  if (r > 0) shapes.push_back({{"B·S·r", {B, S, r}}, true, false});
  const DType compute = p.facts.compute_dtype;
  const int cb = static_cast<int>(storage_bytes(compute == DType::fp32 ? DType::fp32 : compute, 1));
  auto dtypes_of = [&](MemCategory c) -> std::vector<int> {
    auto size = [](DType dtype) { return dtype == DType::nf4 || dtype == DType::fp4 ? 0 : static_cast<int>(storage_bytes(dtype, 1)); };
    switch (c) {
      case MemCategory::activations: return {cb, 4};
      case MemCategory::workspace: return {cb, 4, 8};
      case MemCategory::base_weights: case MemCategory::gathered_weights: return {size(p.facts.base_dtype)};
      case MemCategory::trainable_weights: case MemCategory::gradients: return {size(p.facts.trainable_dtype)};
      case MemCategory::optimizer_states: return {4, size(p.facts.trainable_dtype)};
      default: return {};
    }
  };
  auto match = [&](MemCategory cat, std::uint64_t bytes, ExplainTerm& term) {
    const bool batch = cat == MemCategory::activations || cat == MemCategory::workspace;
    // Ψt sizes only what holds the trainable parameters: a frozen weight that happens to be a
    // multiple of it (Llama-2-7B's H·H = 2 × Ψt at r 16 on q and v) is its own shape.
    const bool trainable = cat == MemCategory::trainable_weights || cat == MemCategory::gradients || cat == MemCategory::optimizer_states;
    for (const auto& sh : shapes) {
      if (sh.batch != batch) continue;
      if (!trainable && sh.shape.formula.find("Ψt") != std::string::npos) continue;
      const Shape& s = sh.shape;
      std::uint64_t prod = 1;
      bool ok = true;
      for (auto f : s.factors) {
        if (f <= 0) ok = false;
        else prod *= static_cast<std::uint64_t>(f);
      }
      if (!ok) continue;
      for (int c : {1, 2, 3}) {
        if (c > 1 && !sh.multiple) break;
        for (int w : dtypes_of(cat)) {
          if (w == 8 && s.formula != "B·S") continue;  // int64: the token ids alone
          if (w <= 0 || static_cast<std::uint64_t>(c) * static_cast<std::uint64_t>(w) * prod != bytes) continue;
          std::string nums;
          for (auto f : s.factors) nums += (nums.empty() ? "" : "·") + with_commas(f);
          const std::string lead = c > 1 ? fmt::format("{} × ", c) : "";
          term.formula = fmt::format("{}{} × {} B ({})", lead, s.formula, w, dtype_word(w, compute));
          term.numbers = fmt::format("{}{} × {} B", lead, nums, w);
          return;
        }
      }
    }
  };

  // The buffers live at the device peak: the walk's ledger replayed to its peak op.
  const auto& prog = p.program;
  std::vector<int> live(prog.buffers.size(), 0);
  for (std::int32_t i = 0; i <= p.memory.device_peak_op && i < static_cast<std::int32_t>(prog.ops.size()); ++i) {
    const auto& op = prog.ops[static_cast<std::size_t>(i)];
    if (op.kind == sim::OpKind::alloc) ++live[static_cast<std::size_t>(op.buffer)];
    else if (op.kind == sim::OpKind::free) --live[static_cast<std::size_t>(op.buffer)];
  }
  if (p.memory.device_peak_op >= 0) {
    const auto& op = prog.ops[static_cast<std::size_t>(p.memory.device_peak_op)];
    e.peak_at = fmt::format("alloc of {} ({}, layer {})", op.buffer >= 0 ? prog.buffers[static_cast<std::size_t>(op.buffer)].name : "-",
                            sim::name_of(op.phase), op.layer);
  }
  std::map<std::pair<int, std::string>, ExplainTerm> groups;
  for (std::size_t b = 0; b < prog.buffers.size(); ++b) {
    const auto& buf = prog.buffers[b];
    if (live[b] <= 0 || sim::on_host(buf.category)) continue;
    ExplainTerm& g = groups[{static_cast<int>(buf.category), pattern_of(buf.name)}];
    g.count += live[b];
    g.bytes += static_cast<std::uint64_t>(live[b]) * buf.bytes;
    g.bytes_each = g.bytes_each == 0 || g.bytes_each == buf.bytes ? buf.bytes : 0;  // 0: sizes differ
  }
  for (int c = 0; c < sim::kNumDeviceCategories; ++c) {
    const auto cat = static_cast<MemCategory>(c);
    ExplainCategory ec;
    ec.category = cat;
    ec.at_peak_bytes = p.memory.at_peak_bytes[static_cast<std::size_t>(c)];
    ec.peak_bytes = p.memory.category_peak_bytes[static_cast<std::size_t>(c)];
    for (auto& [key, term] : groups) {
      if (key.first != c) continue;
      term.what = key.second;
      if (term.bytes_each > 0) match(cat, term.bytes_each, term);
      term.source = note_for(term.what);
      ec.terms.push_back(term);
    }
    std::sort(ec.terms.begin(), ec.terms.end(), [](const ExplainTerm& a, const ExplainTerm& b) { return a.bytes > b.bytes; });
    if (ec.at_peak_bytes == 0 && ec.terms.empty()) continue;
    e.categories.push_back(std::move(ec));
  }

  // The ZeRO paper's model-states formula beside the model-state categories (PEFT-aware form,
  // closed_forms.h): what the program's states come to in closed form.
  PeftModelStatesInput ms;
  ms.base_params = p.facts.base_params;
  ms.base_dtype = p.facts.base_dtype;
  ms.trainable_params = psi_t;
  ms.trainable_dtype = p.facts.trainable_dtype;
  const bool master = p.facts.master_weights;
  // K: the moments (AdamW two, SGD one) in the states' dtype (fp32 beside a master copy, else the
  // parameters' own; bitsandbytes' 8-bit AdamW one byte each) plus the 4 B master.
  const int moments = t.optimizer == Optimizer::sgd_momentum ? 1 : 2;
  const int state_bytes = t.optimizer == Optimizer::adamw_8bit ? 1 : master ? 4 : static_cast<int>(storage_bytes(p.facts.trainable_dtype, 1));
  const int k = moments * state_bytes + (master ? 4 : 0);
  ms.optimizer_bytes_per_param = k;
  const std::string over_n = shards_optimizer(in.strategy.stage) && N > 1 ? fmt::format(" / {} ranks", N) : "";
  for (auto& ec : e.categories) {
    if (ec.category == MemCategory::optimizer_states && psi_t > 0) {
      const std::uint64_t closed = static_cast<std::uint64_t>(k) * static_cast<std::uint64_t>(shards_optimizer(in.strategy.stage) ? (psi_t + N - 1) / N : psi_t);
      ec.closed_form = fmt::format("K × Ψt{} = {} B × {}{} = {} — {}; {}", over_n, k, with_commas(psi_t), over_n, human_bytes(closed),
                                   t.optimizer != Optimizer::adamw ? "K: the optimizer's moments and the master copy"
                                   : master                        ? "AdamW m and v (8 B) and the fp32 master (4 B): K = 12, ZeRO paper §3.1"
                                                                   : fmt::format("AdamW m and v in the parameters' {} (torch.optim: zeros_like(param)), no master copy",
                                                                                 name_of(p.facts.trainable_dtype)),
                                   closed == ec.at_peak_bytes ? std::string("the walk holds exactly this")
                                                              : fmt::format("the walk holds {} at the peak (the program's own sizes)", human_bytes(ec.at_peak_bytes)));
    }
    if (ec.category == MemCategory::base_weights && p.facts.base_params > 0)
      ec.closed_form = fmt::format("{} frozen parameters in {}{} = {} of frozen base in all", with_commas(p.facts.base_params), name_of(p.facts.base_dtype),
                                   shards_params(in.strategy.stage) && N > 1 ? fmt::format(", sharded over {} ranks", N) : "", human_bytes(p.facts.base_bytes));
  }
  e.kinds = {
      fmt::format("allocated peak {} = the categories above at the peak (torch.cuda.max_memory_allocated)", human_bytes(p.memory.device_peak_bytes)),
      fmt::format("reserved peak {} = allocated + {} the caching allocator holds in cached and split segments (max_memory_reserved)",
                  human_bytes(p.reserved_peak_bytes), human_bytes(p.reserved_peak_bytes - std::min(p.reserved_peak_bytes, p.memory.device_peak_bytes))),
      fmt::format("used peak {} = reserved + {} outside the allocator: the CUDA context and NCCL (what nvidia-smi shows)", human_bytes(p.used_peak_bytes),
                  human_bytes(p.outside_allocator_bytes)),
  };
  return e;
}

nlohmann::json explanation_to_json(const Explanation& e) {
  nlohmann::json j;
  j["dims"] = e.dims;
  j["peak_at"] = e.peak_at;
  j["categories"] = nlohmann::json::array();
  for (const auto& c : e.categories) {
    nlohmann::json cj = {{"category", sim::name_of(c.category)}, {"at_peak_bytes", c.at_peak_bytes}, {"peak_bytes", c.peak_bytes},
                         {"closed_form", c.closed_form}, {"terms", nlohmann::json::array()}};
    for (const auto& t : c.terms)
      cj["terms"].push_back({{"what", t.what}, {"count", t.count}, {"bytes_each", t.bytes_each}, {"bytes", t.bytes}, {"formula", t.formula},
                             {"numbers", t.numbers}, {"source", t.source}});
    j["categories"].push_back(cj);
  }
  j["memory_kinds"] = e.kinds;
  return j;
}

}  // namespace peftplan::planner
