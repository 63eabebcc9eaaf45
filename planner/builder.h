// The step-program builder's shared state (private to planner/): the Builder class whose
// layers live in their own files, each with one idea:
//   builder_layout.cpp   the layout (layout.h): facts (dtypes, sizes), the linear modules and
//                        their adapters, units, gradient buckets and the flat trainable layout's
//                        offsets, made once per LayoutKey and copied by each build; and the
//                        views each build makes of the flat layout
//   builder_graph.cpp    the model graph: a micro-batch's forward through the layers, the loss,
//                        the backward in reverse (what each layer saves, recomputes and frees)
//   builder_traffic.cpp  the strategy's traffic: ZeRO-3 / FSDP gathers and releases, gradient
//                        reductions per bucket, FSDP2's copy-out
//   builder_state.cpp    state: the persistent buffers per strategy (setup), the optimizer step
//                        and its offload
//   program.cpp          build() in that order, and the public entry points (program.h)
// Deliberately not here: what the ops mean (sim/ops.h), the runtime profiles' rules
// (runtime.h), costs (sim/), and anything an interpreter does.
#pragma once

#include "peftplan/planner/program.h"

#include "layout.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <mutex>
#include <set>
#include <string>
#include <string_view>
#include <type_traits>
#include <unordered_map>

#include "peftplan/common/error.h"
#include "peftplan/models/parameters.h"
#include "peftplan/planner/runtime.h"
#include "peftplan/planner/saved.h"
#include "peftplan/sim/ops.h"

namespace peftplan::planner::builder {

using sim::Collective;
using sim::CopyDir;
using sim::Kernel;
using sim::MemCategory;
using sim::Op;
using sim::OpKind;
using sim::Phase;
using sim::Stream;
using Cat = sim::MemCategory;
namespace ops = sim::ops;

inline std::uint64_t ceil_div(std::uint64_t a, std::uint64_t b) { return (a + b - 1) / b; }

// Op labels are string_views that outlive the builder: module leaf names ("q_proj") are interned
// once for the life of the process (a few dozen distinct names).
inline std::string_view intern(const std::string& s) {
  static std::mutex mu;
  static std::set<std::string, std::less<>> names;
  std::lock_guard<std::mutex> lock(mu);
  return *names.insert(s).first;
}

// A buffer's name from its parts (string pieces and integers), sized once and appended without a
// format string: named builds (what `plan` and the explorer's hover make) name every buffer, and
// fmt::format's parsing was an eighth of such a build. Only called when names are on.
namespace name_detail {
inline std::size_t width(std::string_view s) { return s.size(); }
inline std::size_t width(char) { return 1; }
template <class I, class = std::enable_if_t<std::is_integral_v<I>>>
std::size_t width(I) { return 20; }
inline void put(std::string& out, std::string_view s) { out.append(s); }
inline void put(std::string& out, char c) { out.push_back(c); }
template <class I, class = std::enable_if_t<std::is_integral_v<I>>>
void put(std::string& out, I v) {
  char digits[24];
  const auto r = std::to_chars(digits, digits + sizeof digits, v);
  out.append(digits, r.ptr);
}
}  // namespace name_detail
template <class... Parts>
std::string name_cat(const Parts&... parts) {
  std::string out;
  out.reserve((name_detail::width(parts) + ...));
  (name_detail::put(out, parts), ...);
  return out;
}

// Bytes of a frozen tensor in its storage dtype. Quantised storage applies to Linear weights only
// (bitsandbytes replaces nn.Linear); NF4/FP4 keep one fp32 absmax per 64-element block, or with
// double quantisation one int8 absmax per block plus one fp32 constant per 256 blocks
// (Dettmers et al., QLoRA, arXiv 2305.14314, §3: 32/64 = 0.5 vs 8/64 + 32/(64*256) = 0.127 bits
// per parameter). LLM.int8 keeps one fp32 scale per output row (bitsandbytes Int8Params SCB).
inline std::uint64_t frozen_bytes(const models::TensorInfo& t, DType base, DType compute,
                           const std::optional<models::Quantization>& q) {
  if (t.role != models::ParamRole::linear_weight || !q) return storage_bytes(frozen_storage_dtype(t, base, compute), t.numel());
  const std::int64_t n = t.numel();
  if (q->dtype == DType::int8) return static_cast<std::uint64_t>(n) + 4ull * static_cast<std::uint64_t>(t.shape[0]);
  const std::uint64_t blocks = ceil_div(static_cast<std::uint64_t>(n), static_cast<std::uint64_t>(q->block_size));
  const std::uint64_t constants = q->double_quant ? blocks + 4 * ceil_div(blocks, 256) : 4 * blocks;
  return storage_bytes(q->dtype, n) + constants;
}

// RuntimeRules::eager_elementwise: eager PyTorch runs each elementwise op of the module code as
// its own kernel, reading and writing its operands in device memory. Bytes per element of the
// op's tensor (a: input dtype's bytes, o: output's, e: the tensor's, ad: the adapter branch's),
// from the code the hf profile models and autograd's formulas (tools/autograd/derivatives.yaml).
namespace eager {
// LlamaRMSNorm / MistralRMSNorm.forward: x.to(fp32) (a + 4, unless a is fp32), pow(2) (8),
// mean(-1) (4), x * rsqrt(var + eps) (8), .to(a) (4 + a, unless fp32), weight * x (a + o).
inline double norm_fwd(double a, double o) { return (a != 4 ? (a + 4) + (4 + a) : 0.0) + 8 + 4 + 8 + a + o; }
// Its backward: the weight mul (o + a), .to(a)'s (a + 4), the rstd mul's two gradients (8 and
// 16 with the row sum), mean's expanded gradient (4), pow's g * 2x (20), their sum (12),
// .to(fp32)'s (4 + a); and the residual stream's two gradients summed (3a).
inline double norm_bwd(double a, double o) { return (o + a) + (a != 4 ? (a + 4) + (4 + a) : 0.0) + 8 + 16 + 4 + 20 + 12 + 3 * a; }
// apply_rotary_pos_emb, per element of q or k: q * cos (2e), rotate_half's neg of a half and cat
// (e + 2e), * sin (2e), the add (3e); backward: two muls (4e), neg (e), the two slices'
// zero-filled full-size gradients (4e), summing three gradients (6e).
inline double rope_fwd(double e) { return 10 * e; }
inline double rope_bwd(double e) { return 15 * e; }
// MistralMLP act_fn(gate) * up, per intermediate element: silu (2e), mul (3e); backward: the
// mul's two gradients (6e), silu's (3e).
inline double swiglu_fwd(double e) { return 5 * e; }
inline double swiglu_bwd(double e) { return 9 * e; }
// PEFT lora.Linear.forward, per output element: `lora_B(...) * scaling` (2 ad), `result +`
// (o + ad + r, r = the promoted result's bytes), `.to(torch_result_dtype)` (r + o, when r != o);
// backward: the cast's (r + o), the add's gradient cast for the base result (r + o), the
// scaling mul's (2 ad).
inline double lora_out_fwd(double o, double ad) {
  const double r = std::max(o, ad);
  return 2 * ad + (o + ad + r) + (r != o ? r + o : 0.0);
}
inline double lora_out_bwd(double o, double ad) {
  const double r = std::max(o, ad);
  return (r != o ? 2 * (r + o) : 0.0) + 2 * ad;
}
// Per input element: the cast to the adapter's dtype (a + ad, when they differ) and
// native_dropout (2 ad + 1, the keep mask); backward: dropout's (2 ad + 1), the cast's (ad + a),
// and the input's two gradients (base and branch) summed (3a).
inline double lora_in_fwd(double a, double ad, bool dropout) { return (a != ad ? a + ad : 0.0) + (dropout ? 2 * ad + 1 : 0.0); }
inline double lora_in_bwd(double a, double ad, bool dropout) { return (dropout ? 2 * ad + 1 : 0.0) + (a != ad ? ad + a : 0.0) + 3 * a; }
}  // namespace eager

// A decoder layer's saved-for-backward table (saved.h) as the graph reads it: the rows, and
// where each tensor the forward allocates sits among them (-1: the layer has no such tensor).
enum class Slot : std::uint8_t {
  norm1_stats, norm1_x_fp32, norm1_normed, norm1_out, attn_scores, attn_probs_fp32, attn_out, resid_mid,
  norm2_stats, norm2_x_fp32, norm2_normed, norm2_out, mlp_silu, mlp_act, layer_out, count
};
// Per linear module: the weight's compute-dtype copy, the output, the output's compute-dtype copy
// (an fp32 output feeding attention), and the adapter branch's input copy, keep mask and u.
enum class LinearSlot : std::uint8_t { w_compute, out, out_compute, lora_x, lora_mask, lora_u, count };
using LinearRows = std::array<std::int16_t, static_cast<std::size_t>(LinearSlot::count)>;

struct LayerTable {
  SavedTable table;
  std::array<std::int16_t, static_cast<std::size_t>(Slot::count)> at{};
  std::vector<LinearRows> linear;  // per LinearPlan of the layer, Layout::layer_linears order
  const SavedTensor* row(Slot s) const {
    const std::int16_t i = at[static_cast<std::size_t>(s)];
    return i < 0 ? nullptr : &table.rows[static_cast<std::size_t>(i)];
  }
  bool kept(Slot s) const {
    const SavedTensor* r = row(s);
    return r && r->kept;
  }
};

// A row of the rows `rows` holds at `lr[s]`, or nullptr.
inline const SavedTensor* linear_row(const std::vector<SavedTensor>& rows, const LinearRows& lr, LinearSlot s) {
  const std::int16_t i = lr[static_cast<std::size_t>(s)];
  return i < 0 ? nullptr : &rows[static_cast<std::size_t>(i)];
}

class Builder {
 public:
  Builder(const PlanInput& in, const BuildOptions& options)
      : in_(in), rules_(runtime_rules(in)), m_(in.model), t_(in.training), s_(in.strategy), names_(options.names),
        eval_(options.evaluation), reuse_layout_(options.reuse_layout) {}

  BuiltProgram build();
  // Layer l's saved-for-backward table alone (saved_for_backward): the facts and the linear
  // modules' plans, then the table, without a program.
  SavedTable table_only(std::int64_t l);

 private:
  // --- program emission helpers ---
  // `name` is a callable returning the buffer's name: names cost more than the rest of a buffer,
  // so searches that need none (BuildOptions::names = false) never format them.
  template <typename Name>
  std::int32_t alloc(Name&& name, Cat cat, std::uint64_t bytes, Phase phase) {
    const std::int32_t b = p_.add_buffer(names_ ? std::string(name()) : std::string(), cat, bytes);
    alloc_buffer(b, phase);
    return b;
  }
  // A persistent gradient buffer: allocated in setup, or (runtime rule grads_only_in_backward)
  // when backward first reaches a gradient (micro_batch) and freed after the step.
  std::int32_t grad_buffer(std::string_view name, std::uint64_t bytes) {
    if (!rules_.grads_only_in_backward) return alloc([&] { return name; }, Cat::gradients, bytes, Phase::setup);
    const std::int32_t b = p_.add_buffer(names_ ? std::string(name) : std::string(), Cat::gradients, bytes);
    lazy_grads_.push_back(b);
    return b;
  }
  // Runtime rule per_tensor_allocations (DDP's unsharded parameters): buffer b as PyTorch
  // allocates it, `copies` tensors of `elem_bytes` per element for each trainable tensor in
  // inventory order (AdamW's exp_avg then exp_avg_sq per parameter: 2), any padding last.
  void per_tensor(std::int32_t b, std::uint64_t elem_bytes, int copies) {
    if (b < 0 || !rules_.per_tensor_allocations || s_.stage != Stage::ddp) return;
    sim::Buffer& buf = p_.buffers[static_cast<std::size_t>(b)];
    std::vector<std::uint64_t> pieces;
    std::uint64_t sum = 0;
    auto add = [&](std::int64_t numel) {
      for (int c = 0; c < copies; ++c) {
        pieces.push_back(elem_bytes * static_cast<std::uint64_t>(numel));
        sum += pieces.back();
      }
    };
    if (in_.peft.adapters.empty())
      for (const auto& t : inv_->tensors) add(t.numel());
    else
      for (const auto& t : inv_->trainables) add(t.numel());
    if (sum > buf.bytes) return;  // not this buffer's layout: leave it one allocation
    if (sum < buf.bytes) pieces.push_back(buf.bytes - sum);
    buf.pieces = std::move(pieces);
  }
  // Runtime rule per_tensor_allocations on a MoE layer: a buffer that holds every expert's rows
  // (the program's one [M·k, I] tensor) is one tensor per expert in transformers' expert loop
  // (MixtralSparseMoeBlock.forward runs each expert's MLP on its own tokens), E equal pieces.
  std::int32_t per_expert(std::int32_t b) {
    if (b < 0 || !rules_.per_tensor_allocations || !m_.is_moe() || m_.experts < 2) return b;
    sim::Buffer& buf = p_.buffers[static_cast<std::size_t>(b)];
    const auto e = static_cast<std::uint64_t>(m_.experts);
    buf.pieces.assign(e, buf.bytes / e);
    buf.pieces.back() += buf.bytes % e;
    return b;
  }
  // The buffer of a state role (sim::BufferRole), named as every program names it.
  std::int32_t state_buffer(sim::BufferRole r, Cat cat, std::uint64_t bytes, Phase phase) {
    return role(alloc([&] { return sim::state_buffer_name(r); }, cat, bytes, phase), r);
  }
  std::int32_t state_grad(sim::BufferRole r, std::uint64_t bytes) {
    return role(grad_buffer(sim::state_buffer_name(r), bytes), r);
  }
  // Marks buffer b as what an interpreter finds it as (sim::BufferRole); returns b.
  std::int32_t role(std::int32_t b, sim::BufferRole r, std::int32_t tensor = -1) {
    sim::Buffer& buf = p_.buffers[static_cast<std::size_t>(b)];
    buf.role = r;
    buf.tensor = tensor;
    return b;
  }
  // The alloc op of a buffer added earlier (its views exist before it does).
  void alloc_buffer(std::int32_t b, Phase phase) {
    Op op;
    op.kind = OpKind::alloc;
    op.phase = phase;
    op.buffer = b;
    op.micro_batch = mb_;
    p_.add_op(op);
  }
  void free(std::int32_t b, Phase phase) {
    if (b < 0) return;
    Op op;
    op.kind = OpKind::free;
    op.phase = phase;
    op.buffer = b;
    op.micro_batch = mb_;
    p_.add_op(op);
  }
  // A compute op of kernel K::kernel with the operands, shape and scalars of `k` (sim/ops.h).
  template <class K>
  std::int32_t compute(std::string_view label, std::int32_t layer, Phase phase, sim::ComputeWork w, const K& k,
                       std::initializer_list<std::int32_t> deps = {}, Stream stream = Stream::compute) {
    Op op;
    sim::ops::emit(p_, op, k);
    op.kind = OpKind::compute;
    op.stream = stream;
    op.label = label;
    op.layer = layer;
    op.phase = phase;
    op.micro_batch = mb_;
    op.work = w;
    std::int32_t id;
    if (wait_ >= 0) {  // the first compute after a gather waits for it
      std::array<std::int32_t, 8> d{};
      std::size_t n = 0;
      for (std::int32_t x : deps) d[n++] = x;
      d[n++] = wait_;
      wait_ = -1;
      id = p_.add_op(op, std::span<const std::int32_t>(d.data(), n));
    } else {
      id = p_.add_op(op, deps);
    }
    if (pending_next_ < pending_.size()) issue_chunk(id);
    if (phase != Phase::recompute && phase != Phase::optimizer && phase != Phase::setup)
      p_.model_flops_per_step += w.flops;
    last_compute_ = id;
    return id;
  }
  std::int32_t collective(Collective c, std::string_view label, std::uint64_t bytes, std::int32_t layer,
                          Phase phase, std::int32_t buffer, std::initializer_list<std::int32_t> deps) {
    Op op;
    op.kind = OpKind::collective;
    op.stream = Stream::comm;
    op.collective = c;
    op.label = label;
    op.bytes = bytes;
    op.group_size = s_.ranks;
    op.layer = layer;
    op.phase = phase;
    op.buffer = buffer;
    op.micro_batch = mb_;
    return p_.add_op(op, deps);
  }
  std::int32_t copy(CopyDir dir, std::string_view label, std::uint64_t bytes, Phase phase, std::int32_t buffer,
                    std::initializer_list<std::int32_t> deps) {
    Op op;
    op.kind = OpKind::copy;
    op.stream = Stream::copy;
    op.copy_dir = dir;
    op.label = label;
    op.bytes = bytes;
    op.phase = phase;
    op.buffer = buffer;
    op.micro_batch = mb_;
    return p_.add_op(op, deps);
  }

  // --- sizes ---
  // What the loss's gradient is divided by: the target tokens of the whole step on all ranks.
  double loss_divisor() const {
    return static_cast<double>(t_.micro_batch) * static_cast<double>(t_.grad_accum) * static_cast<double>(s_.ranks) *
           static_cast<double>(t_.seq_len);
  }
  std::uint64_t act(std::int64_t elems) const { return storage_bytes(f_.compute_dtype, elems); }
  static std::uint64_t f32(std::int64_t elems) { return 4ull * static_cast<std::uint64_t>(elems); }
  static sim::ComputeWork gemm(std::int64_t m, std::int64_t n, std::int64_t k, std::uint64_t bytes) {
    sim::ComputeWork w;
    w.flops = 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k);
    w.bytes_moved = bytes;
    w.gemm_m = m;
    w.gemm_n = n;
    w.gemm_k = k;
    return w;
  }
  static sim::ComputeWork elementwise(std::uint64_t bytes, double flops = 0.0) {
    sim::ComputeWork w;
    w.bytes_moved = bytes;
    w.flops = flops;
    return w;
  }
  // Parameters sharded at rest and gathered for compute: ZeRO-3 and FSDP's sharding strategies.
  bool zero3() const { return shards_params(s_.stage); }
  bool fsdp() const { return is_fsdp(s_.stage); }
  bool fsdp2() const { return fsdp() && s_.fsdp.version == 2; }
  // FSDP2: a full-precision parameter's shard elements, ceil(d0 / N) of its dim-0 rows.
  std::int64_t dim0_rows_shard(const models::TensorInfo& t) const {
    const std::int64_t rows = t.shape.empty() ? 1 : t.shape[0];
    return shard(rows) * (t.numel() / rows);
  }
  // This rank's shard of a unit: its frozen bytes and trainable elements (FSDP1 and ZeRO-3: the
  // flattened unit padded to a multiple of N; FSDP2: parameter by parameter).
  std::uint64_t frozen_shard_bytes(const Unit& un) const {
    return fsdp2() ? un.fsdp2_frozen_shard_bytes : ceil_div(un.frozen_bytes, static_cast<std::uint64_t>(group()));
  }
  std::int64_t trainable_shard_numel(const Unit& un) const { return fsdp2() ? un.fsdp2_trainable_shard_numel : shard(un.trainable_numel); }
  // This rank's trainable elements in all (the gradient and optimizer partition), and a
  // gradient bucket's.
  std::int64_t trainable_shard_total() const {
    if (!fsdp2()) return shard(lay_.trainable_numel);
    std::int64_t n = 0;
    for (const Unit& un : lay_.units) n += un.fsdp2_trainable_shard_numel;
    return n;
  }
  std::int64_t bucket_shard_numel(const GradBucket& bk) const {
    if (!fsdp2()) return shard(bk.numel);
    std::int64_t n = 0;
    for (std::size_t u : bk.units) n += lay_.units[u].fsdp2_trainable_shard_numel;
    return n;
  }
  // The optimizer steps on the host: ZeRO-Offload, or FSDP's CPUOffload(offload_params=True),
  // which moves the sharded gradients there and steps the parameters on the CPU
  // (torch/distributed/fsdp/api.py CPUOffload).
  bool host_optimizer() const {
    return s_.offload_optimizer == OffloadDevice::cpu || (fsdp() && s_.offload_param == OffloadDevice::cpu);
  }
  // Ranks a shard is split over: all of them, or a node's under HYBRID_SHARD.
  std::int32_t group() const { return s_.stage == Stage::fsdp_hybrid_shard && s_.shard_group > 0 ? s_.shard_group : s_.ranks; }
  // The fraction of attention's S x S_kv score GEMM work that is done. PyTorch's eager attention
  // (transformers' eager_attention_forward) multiplies the full matrices and masks afterwards: all
  // of it; flash-attn skips the blocks above the diagonal: half of it at large S. The executor
  // (executor/cpu/attention.cpp, eager and flash alike) multiplies causal row blocks of
  // kExecAttentionRows rows, each against the columns up to its last row, and skips the blocks
  // above the diagonal: with nb = ceil(S / rows) blocks, (nb + 1) / (2 nb) of the work when
  // S_kv = S (3/4 at S 128, 5/8 at S 256, towards 1/2).
  double score_work_fraction() const {
    if (in_.profile != RuntimeProfile::executor || kv_len_ != t_.seq_len) return t_.attention == Attention::eager ? 1.0 : 0.5;
    const std::int64_t S = t_.seq_len, rows = kExecAttentionRows;
    double done = 0.0;  // sum over row blocks of rows x columns multiplied
    for (std::int64_t i0 = 0; i0 < S; i0 += rows)
      done += static_cast<double>(std::min(rows, S - i0)) * static_cast<double>(std::min(S, i0 + rows));
    return done / (static_cast<double>(S) * static_cast<double>(S));
  }
  // ZeRO-3 as the executor runs it: the program names every tensor's place in the unit's
  // gathered buffer and the shards the all_gathers read (see setup and gather_unit).
  bool exec_z3() const { return zero3() && in_.profile == RuntimeProfile::executor; }
  // ZeRO-2 as the executor runs it with several ranks: the adapter partition is laid out per
  // gradient bucket (plan_buckets), so that every bucket's reduce_scatter fills a contiguous
  // block of this rank's partition.
  bool exec_z2() const { return s_.stage == Stage::zero2 && s_.ranks > 1 && in_.profile == RuntimeProfile::executor; }
  // ZeRO-2 on one rank has nothing to shard: its gradients live whole, as DDP's do.
  bool sharded_grads() const { return (s_.stage == Stage::zero2 && s_.ranks > 1) || zero3(); }
  bool sharded_optimizer() const { return shards_optimizer(s_.stage); }
  std::int64_t shard(std::int64_t n) const { return static_cast<std::int64_t>(ceil_div(static_cast<std::uint64_t>(n), static_cast<std::uint64_t>(group()))); }
  // FSDP keeps its root unit (the embedding, the final norm and the head) gathered from the start
  // of forward to the end of backward: torch/distributed/fsdp/_runtime_utils.py
  // _post_forward_reshard ("Do not free the root's parameters in the post-forward for
  // FULL_SHARD"), and a frozen root is resharded only by _catch_all_reshard in the final
  // callback.
  bool root_unit(std::size_t u) const { return fsdp() && (u == 0 || u == lay_.units.size() - 1); }
  bool checkpointed(std::int64_t layer) const {
    if (t_.checkpointing == Checkpointing::full) return true;
    if (t_.checkpointing == Checkpointing::every_k) return layer % t_.checkpoint_every == 0;
    return false;
  }

  // Bytes of the elementwise ops under RuntimeRules::eager_elementwise, else the fused kernels'.
  std::uint64_t norm_fwd_bytes(std::int64_t n, DType in) const {
    if (!rules_.eager_elementwise || !m_.rms_norm()) return act(n) * 2;
    return static_cast<std::uint64_t>(eager::norm_fwd(static_cast<double>(bytes_of(in)), static_cast<double>(bytes_of(stream_dtype()))) * static_cast<double>(n));
  }
  std::uint64_t norm_bwd_bytes(std::int64_t n, DType in) const {
    if (!rules_.eager_elementwise || !m_.rms_norm()) return act(n) * 4;
    return static_cast<std::uint64_t>(eager::norm_bwd(static_cast<double>(bytes_of(in)), static_cast<double>(bytes_of(stream_dtype()))) * static_cast<double>(n));
  }
  std::uint64_t eager_or(double per_element, std::int64_t n, DType d, std::uint64_t fused) const {
    return rules_.eager_elementwise ? static_cast<std::uint64_t>(per_element * static_cast<double>(bytes_of(d)) * static_cast<double>(n)) : fused;
  }

  // The layout layer (builder_layout.cpp, layout.h): make_layout runs the steps below on this
  // builder's input and gives the value away; use_layout takes the cached one (or makes it) and
  // then the sizes that depend on the micro-batch, the sequence and checkpointing.
  Layout make_layout();
  friend std::shared_ptr<const Layout> layout_of(const PlanInput& in);
  void use_layout(bool reuse);
  void layout_facts();
  void sizes();
  void plan_linears();
  // The layers' tables (saved.h), from the runtime rules: built once after plan_linears.
  void make_tables();
  LayerTable layer_table(std::int64_t l) const;
  // Appends lp's rows (its output's dtype and whether it is kept given by the caller) to `rows`.
  LinearRows linear_rows(std::vector<SavedTensor>& rows, const LinearPlan& lp, DType out_dtype, bool out_kept,
                         std::string_view out_rule) const;
  std::vector<LayerTable> tables_;
  void setup();
  void add_cuda_runtime();
  void micro_batch(std::int32_t mb);
  void layer_forward(std::int32_t l, bool recompute);
  void layer_backward(std::int32_t l);
  void gather_unit(std::size_t unit, Phase phase, bool prefetch_next);
  void release_unit(std::size_t unit, Phase phase, bool end_of_backward = false);
  void begin_unit_gradients(std::size_t unit);
  void unit_gradients_done(std::size_t unit, std::int32_t after_op);
  void optimizer_step();
  std::int32_t hf_loss(std::int32_t logits, std::int32_t tokens);
  std::int32_t fused_loss(LinearPlan& lm, std::int32_t x, std::int32_t tokens);
  // The linear's forward, its allocations from its rows (rows[lr[...]]).
  std::int32_t linear_forward(LinearPlan& lp, const std::vector<SavedTensor>& rows, const LinearRows& lr, std::int32_t x,
                              std::int32_t layer, Phase phase, Cat out_cat, Cat saved_cat, std::vector<std::int32_t>& saved);
  std::int32_t linear_backward(LinearPlan& lp, std::int32_t dy, std::int32_t dx, std::int32_t x, std::int32_t layer,
                               bool dx_first);
  std::int32_t compute_acc(std::int32_t op) {  // marks a compute op as adding into its output
    p_.ops[static_cast<std::size_t>(op)].accumulate = true;
    return op;
  }
  void adapter_offsets();
  void adapter_views();
  void plan_buckets();
  void bucket_ranges();
  std::int64_t flat_position(std::int64_t x) const;  // trainable.flat element of flat element x
  void bind_base(const models::TensorInfo& t, std::int32_t b);

  // --- dtypes the runtime rules give tensors ---
  // A frozen tensor's bytes: its storage dtype, or fp32 for norms the runtime keeps in fp32.
  std::uint64_t frozen(const models::TensorInfo& t) const {
    if (lay_.fp32_norms && (t.role == models::ParamRole::norm_weight || t.role == models::ParamRole::norm_bias)) return f32(t.numel());
    return frozen_bytes(t, f_.base_dtype, f_.compute_dtype, in_.peft.quantization);
  }
  static std::uint64_t bytes(DType d, std::int64_t elems) { return storage_bytes(d, elems); }
  // Norm outputs, the MLP and the residual stream after the first layer are fp32 when the norms
  // are (fp32_norms_on_kbit); the embedding output and attention stay in the compute dtype.
  DType stream_dtype() const { return lay_.fp32_norms ? DType::fp32 : f_.compute_dtype; }
  DType resid_dtype(std::int64_t l) const { return l == 0 ? f_.compute_dtype : stream_dtype(); }
  // The adapter branch's activations: the compute dtype, or (runtime rule) the adapter's own.
  DType adapter_dtype(const LinearPlan& lp) const { return lp.adapter_owns_input ? lay_.adapter_act_dtype : f_.compute_dtype; }

  const PlanInput& in_;
  RuntimeRules rules_;
  const models::ModelSpec& m_;
  const TrainingSpec& t_;
  const Strategy& s_;
  sim::Program p_;
  ProgramFacts f_;
  bool names_;
  // BuildOptions::evaluation: the forward and the loss under torch.no_grad, nothing after.
  bool eval_ = false;
  bool reuse_layout_ = true;  // BuildOptions::reuse_layout
  std::int32_t mb_ = -1;
  std::int32_t last_compute_ = -1;
  std::int32_t wait_ = -1;  // ZeRO-3: gather the next compute op must wait for
  // ZeRO-3 prefetch: the rest of a unit's all_gather, issued one chunk after each compute op, so
  // that at most stage3_prefetch_bucket_size elements are in flight ahead of the compute.
  struct Chunk {
    std::size_t unit;
    std::uint64_t bytes;
    std::string_view label;
    Phase phase;
  };
  std::vector<Chunk> pending_;
  std::size_t pending_next_ = 0;
  void issue_chunk(std::int32_t after);
  std::int64_t M_ = 0;      // tokens per micro-batch B * S (S includes prompt-tuning tokens)
  std::int64_t kv_len_ = 0; // attended positions (S + prefix tokens)

  // This build's copy of the layout (layout.h): the linear modules, units, buckets and offsets,
  // whose buffer ids the build fills in.
  Layout lay_;
  const std::vector<models::TensorInfo>* tensors_ = nullptr;  // the parameter inventory
  // The plan of the module at `path` (an inventory path), or nullptr.
  LinearPlan* linear_at(std::string_view path) {
    auto it = lay_.by_path->find(path);
    if (it == lay_.by_path->end()) return nullptr;
    const LinearRef r = it->second;
    return r.layer < 0 ? &lay_.head_linears[static_cast<std::size_t>(r.index)]
                       : &lay_.layer_linears[static_cast<std::size_t>(r.layer)][static_cast<std::size_t>(r.index)];
  }
  // Persistent state buffers.
  std::int32_t grad_flat_ = -1;      // full gradients (DDP, ZeRO-1)
  // Full fine-tuning under per_tensor_allocations: each module's weight gradient, a view of
  // grad.flat (absent: the kernels write grad.flat whole).
  std::unordered_map<std::string_view, std::int32_t> weight_grad_;
  std::int32_t embed_grad_ = -1;
  std::int32_t weight_grad_of(std::string_view module) const {
    auto it = weight_grad_.find(module);
    return it == weight_grad_.end() ? grad_flat_ : it->second;
  }
  std::int32_t grad_shard_ = -1;     // gradient partition (ZeRO-2/3)
  std::vector<std::int32_t> lazy_grads_;  // gradient buffers that live from backward to the step
  std::vector<std::int32_t> retained_;    // FSDP: checkpoint inputs and gradients its hooks hold
  // FSDP with reentrant checkpointing on a frozen decoder unit (see layer_backward).
  bool fsdp_retains(std::int64_t l) const {
    return fsdp() && !fsdp2() && rules_.fsdp_hook_retains_checkpoint_grads && !in_.peft.adapters.empty() && checkpointed(l) &&
           t_.checkpoint_reentrant;
  }
  std::int32_t trainable_shard_ = -1;  // ZeRO-3, executor profile: this rank's adapter partition
  std::int32_t trainable_flat_ = -1; // trainable weights, flat (replicated strategies)
  std::int32_t embed_buf_ = -1;
  std::int32_t opt_states_ = -1;     // optimizer.states (m then v for AdamW)
  std::int32_t master_ = -1;         // optimizer.master_fp32 (mixed precision)
  std::vector<std::int32_t> norm1_, norm2_;  // per layer: input / post-attention norm weights
  std::int32_t final_norm_ = -1;     // model.norm.weight
  std::int32_t rope_ = -1;           // RoPE cos/sin tables, live for the whole step
  const ModelInventory* inv_ = nullptr;
  // What a layer's forward (or its recompute) produced that its backward reads.
  struct LayerBufs {
    std::int32_t rstd1 = -1, h1 = -1, probs = -1, attn_out = -1, x_mid = -1, rstd2 = -1, h2 = -1, act = -1;
    std::int32_t norm1_x = -1, norm2_x = -1;             // what each norm saved of its input (an
                                                         // fp32 copy), when not the input itself
    std::array<std::int32_t, 3> qkv = {-1, -1, -1};      // q, k, v projections (after RoPE)
    std::array<std::int32_t, 2> gate_up = {-1, -1};      // gate and up projections
  };
  std::vector<LayerBufs> lb_;
  // Per micro-batch live buffers.
  std::vector<std::int32_t> resid_;          // residual stream: resid_[l] is layer l's input
  std::vector<std::vector<std::int32_t>> saved_;  // per layer saved buffers (freed in backward)
  std::vector<std::int32_t> gathered_;       // ZeRO-3: gathered buffers per unit (-1 when not)
  // FSDP2: a unit's flat all-gather output until its copy-out (-1: none waiting), the forward's
  // last copied-out one (held until the next unit's copy-out), and the last reduce-scatter input
  // (held until the next unit's post-backward).
  std::vector<std::int32_t> ag_out_;
  std::int32_t ag_held_ = -1, rs_held_ = -1;
  void fsdp2_copy_out(std::size_t u, Phase phase);
  std::vector<std::int32_t> gather_op_;      // ZeRO-3: the all_gather op per unit
  std::vector<std::int32_t> bucket_buf_;     // per bucket: this micro-batch's gradient buffer
  std::int32_t staging_ = -1;                // host.staging (optimizer offload)
  std::int32_t host_params_ = -1;            // executor offload: the host copy of the partition
  std::int32_t dres_ = -1;                   // gradient of the residual stream
  // Gradient buckets (DDP / ZeRO-2): pending unit gradients and their element count.
  std::vector<std::size_t> bucket_units_;
  std::int64_t bucket_numel_ = 0;
  std::vector<std::int32_t> reduce_ops_;
};

}  // namespace peftplan::planner::builder
