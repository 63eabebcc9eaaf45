// The step-program builder (see program.h). Reading order: facts (dtypes and sizes), setup
// (persistent buffers per strategy), then per micro-batch the forward through the layers, the
// loss, the backward in reverse with the strategy's reductions, and finally the optimizer step.
#include "peftplan/planner/program.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <set>
#include <unordered_map>

#include <fmt/format.h>

#include "peftplan/common/error.h"
#include "peftplan/models/parameters.h"
#include "peftplan/planner/runtime.h"
#include "peftplan/sim/ops.h"

namespace peftplan::planner {
namespace {

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

std::uint64_t ceil_div(std::uint64_t a, std::uint64_t b) { return (a + b - 1) / b; }

// Op labels are string_views that outlive the builder: module leaf names ("q_proj") are interned
// once for the life of the process (a few dozen distinct names).
std::string_view intern(const std::string& s) {
  static std::mutex mu;
  static std::set<std::string, std::less<>> names;
  std::lock_guard<std::mutex> lock(mu);
  return *names.insert(s).first;
}

// Bytes of a frozen tensor in its storage dtype. Quantised storage applies to Linear weights only
// (bitsandbytes replaces nn.Linear); NF4/FP4 keep one fp32 absmax per 64-element block, or with
// double quantisation one int8 absmax per block plus one fp32 constant per 256 blocks
// (Dettmers et al., QLoRA, arXiv 2305.14314, §3: 32/64 = 0.5 vs 8/64 + 32/(64*256) = 0.127 bits
// per parameter). LLM.int8 keeps one fp32 scale per output row (bitsandbytes Int8Params SCB).
std::uint64_t frozen_bytes(const models::TensorInfo& t, DType base, DType compute,
                           const std::optional<models::Quantization>& q) {
  if (t.role != models::ParamRole::linear_weight || !q) return storage_bytes(frozen_storage_dtype(t, base, compute), t.numel());
  const std::int64_t n = t.numel();
  if (q->dtype == DType::int8) return static_cast<std::uint64_t>(n) + 4ull * static_cast<std::uint64_t>(t.shape[0]);
  const std::uint64_t blocks = ceil_div(static_cast<std::uint64_t>(n), static_cast<std::uint64_t>(q->block_size));
  const std::uint64_t constants = q->double_quant ? blocks + 4 * ceil_div(blocks, 256) : 4 * blocks;
  return storage_bytes(q->dtype, n) + constants;
}

// Linear-module roles inside a decoder layer, by leaf name (transformers' module names).
enum class Role { attn_in, attn_out, mlp_in, mlp_out, router, other };
Role role_of(const models::LinearModule& l) {
  static const std::set<std::string> attn_in = {"q_proj", "k_proj", "v_proj", "qkv_proj", "c_attn", "query_key_value"};
  static const std::set<std::string> mlp_in = {"gate_proj", "up_proj", "gate_up_proj", "c_fc", "dense_h_to_4h",
                                               "fc1", "w1", "w3"};
  static const std::set<std::string> mlp_out = {"down_proj", "dense_4h_to_h", "fc2", "w2"};
  if (attn_in.count(l.leaf)) return Role::attn_in;
  if (mlp_in.count(l.leaf)) return Role::mlp_in;
  if (mlp_out.count(l.leaf)) return Role::mlp_out;
  if (l.leaf == "c_proj") return l.path.find(".mlp.") != std::string::npos ? Role::mlp_out : Role::attn_out;
  if (l.leaf == "o_proj" || l.leaf == "dense" || l.leaf == "out_proj") return Role::attn_out;
  if (l.leaf == "gate") return Role::router;
  return Role::other;
}

// RuntimeRules::eager_elementwise: eager PyTorch runs each elementwise op of the module code as
// its own kernel, reading and writing its operands in device memory. Bytes per element of the
// op's tensor (a: input dtype's bytes, o: output's, e: the tensor's, ad: the adapter branch's),
// from the code the hf profile models and autograd's formulas (tools/autograd/derivatives.yaml).
namespace eager {
// LlamaRMSNorm / MistralRMSNorm.forward: x.to(fp32) (a + 4, unless a is fp32), pow(2) (8),
// mean(-1) (4), x * rsqrt(var + eps) (8), .to(a) (4 + a, unless fp32), weight * x (a + o).
double norm_fwd(double a, double o) { return (a != 4 ? (a + 4) + (4 + a) : 0.0) + 8 + 4 + 8 + a + o; }
// Its backward: the weight mul (o + a), .to(a)'s (a + 4), the rstd mul's two gradients (8 and
// 16 with the row sum), mean's expanded gradient (4), pow's g * 2x (20), their sum (12),
// .to(fp32)'s (4 + a); and the residual stream's two gradients summed (3a).
double norm_bwd(double a, double o) { return (o + a) + (a != 4 ? (a + 4) + (4 + a) : 0.0) + 8 + 16 + 4 + 20 + 12 + 3 * a; }
// apply_rotary_pos_emb, per element of q or k: q * cos (2e), rotate_half's neg of a half and cat
// (e + 2e), * sin (2e), the add (3e); backward: two muls (4e), neg (e), the two slices'
// zero-filled full-size gradients (4e), summing three gradients (6e).
double rope_fwd(double e) { return 10 * e; }
double rope_bwd(double e) { return 15 * e; }
// MistralMLP act_fn(gate) * up, per intermediate element: silu (2e), mul (3e); backward: the
// mul's two gradients (6e), silu's (3e).
double swiglu_fwd(double e) { return 5 * e; }
double swiglu_bwd(double e) { return 9 * e; }
// PEFT lora.Linear.forward, per output element: `lora_B(...) * scaling` (2 ad), `result +`
// (o + ad + r, r = the promoted result's bytes), `.to(torch_result_dtype)` (r + o, when r != o);
// backward: the cast's (r + o), the add's gradient cast for the base result (r + o), the
// scaling mul's (2 ad).
double lora_out_fwd(double o, double ad) {
  const double r = std::max(o, ad);
  return 2 * ad + (o + ad + r) + (r != o ? r + o : 0.0);
}
double lora_out_bwd(double o, double ad) {
  const double r = std::max(o, ad);
  return (r != o ? 2 * (r + o) : 0.0) + 2 * ad;
}
// Per input element: the cast to the adapter's dtype (a + ad, when they differ) and
// native_dropout (2 ad + 1, the keep mask); backward: dropout's (2 ad + 1), the cast's (ad + a),
// and the input's two gradients (base and branch) summed (3a).
double lora_in_fwd(double a, double ad, bool dropout) { return (a != ad ? a + ad : 0.0) + (dropout ? 2 * ad + 1 : 0.0); }
double lora_in_bwd(double a, double ad, bool dropout) { return (dropout ? 2 * ad + 1 : 0.0) + (a != ad ? ad + a : 0.0) + 3 * a; }
}  // namespace eager

struct Adapter {       // a LoRA (or IA3) branch on one linear module
  std::int64_t r = 0;  // 0 for IA3 (a scaling vector)
  double dropout = 0.0;
  double scale = 0.0;  // alpha / r (rsLoRA: alpha / sqrt(r))
  std::int32_t index = -1;  // the module's place among the inventory's LoRA modules, in the order
                            // their first lora_A tensor comes (the key of its dropout masks)
  std::int32_t a_buf = -1, b_buf = -1;  // views of lora_A / lora_B in trainable.flat (-1 under
                                        // ZeRO-3, where they live in the gathered unit)
  std::int32_t ga_buf = -1, gb_buf = -1;  // views of their gradients in grad.flat, or (ZeRO-2/3
                                          // with several ranks) in the micro-batch's bucket
  std::int64_t params = 0;
  std::int64_t a_off = -1, b_off = -1;    // element offsets of lora_A / lora_B in the flat
  std::int64_t a_numel = 0, b_numel = 0;  //   trainable layout (inventory order), and sizes
  std::int32_t a_tensor = -1, b_tensor = -1;  // their index in the trainable inventory
};

struct LinearPlan {
  const models::LinearModule* mod = nullptr;  // into the ModelInventory
  Role role = Role::other;
  std::int32_t weight_buf = -1;   // base weight buffer (replicated strategies)
  std::int32_t bias_buf = -1;
  bool trainable_weight = false;  // full fine-tuning or modules_to_save
  std::optional<Adapter> adapter;
  double token_share = 1.0;       // MoE expert: fraction of the tokens it sees (k / E)
  std::int32_t xin_buf = -1;      // the latest forward's dropped adapter input (-1: no dropout)
  std::int32_t u_buf = -1;        // the latest forward's adapter intermediate u [M, r]
  bool adapter_owns_input = false;  // the adapter saves its own copy of the input (runtime rule)
  DType input_dtype = DType::bf16;  // the module's input dtype
  bool needs_input() const { return trainable_weight || (adapter.has_value() && !adapter_owns_input); }
};

// A unit of ZeRO-3 partitioning and gathering: one decoder layer, or the embedding / the head.
struct Unit {
  std::string name;
  std::int64_t frozen_numel = 0;          // non-persistent frozen elements (gathered)
  std::uint64_t frozen_bytes = 0;         // their storage bytes
  std::int64_t persistent_numel = 0;      // tensors below the persistence threshold: kept whole
  std::uint64_t persistent_bytes = 0;
  std::int64_t trainable_numel = 0;       // adapter (or all, in full fine-tuning) elements
  // FSDP2 (fully_shard): this rank's padded shard of the unit, parameter by parameter: each
  // parameter's ceil(d0 / N) dim-0 rows (torch/distributed/fsdp/_fully_shard/_fsdp_param.py
  // _init_sharded_param: _chunk_with_empty on dim 0, every rank's buffer padded to chunk 0).
  std::uint64_t fsdp2_frozen_shard_bytes = 0;
  std::int64_t fsdp2_trainable_shard_numel = 0;
  std::int32_t frozen_shard = -1, trainable_shard = -1;  // ZeRO-3 shard buffers
  std::int64_t flat_offset = -1;          // first element of its adapters in the flat trainable
                                          // layout (-1: unknown or not contiguous)
  // ZeRO-3 in the executor profile: where each frozen tensor lies (bytes from the start of the
  // unit's flattened frozen region, or of its persistent buffer), this unit's block of the
  // adapter partition (trainable.shard and grad.shard, elements) and its views.
  struct Tensor {
    const models::TensorInfo* info = nullptr;
    std::uint64_t offset = 0, bytes = 0;
  };
  std::vector<Tensor> gathered_tensors, persistent_tensors;
  std::int64_t part_offset = 0;
  std::int32_t grad_shard_view = -1;
};

// ZeRO-2/3 gradient bucket: consecutive units (in backward order) whose gradients are one
// contiguous buffer, padded to a multiple of N, from the bucket's first unit until its
// reduce_scatter (DeepSpeed's ipg bucket of reduce_bucket_size elements).
struct GradBucket {
  std::vector<std::size_t> units;   // units with trainable elements, backward order
  std::int64_t numel = 0;           // their trainable elements
  std::size_t flush_unit = 0;       // the unit whose gradients_done issues the reduce_scatter
  std::int64_t flat_lo = -1;        // first flat element covered (-1: not contiguous)
  // ZeRO-2 in the executor profile (bucket-partitioned layout, see plan_buckets): the bucket's
  // block in every rank's partition (elements), its region of trainable.flat, and its views.
  std::int64_t part_offset = 0, region = 0;
  std::int32_t grad_view = -1, param_view = -1, state_view = -1, host_view = -1;
};

class Builder {
 public:
  Builder(const PlanInput& in, const BuildOptions& options)
      : in_(in), rules_(runtime_rules(in)), m_(in.model), t_(in.training), s_(in.strategy), names_(options.names),
        eval_(options.evaluation) {}

  BuiltProgram build();

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
    if (!fsdp2()) return shard(trainable_numel_);
    std::int64_t n = 0;
    for (const Unit& un : units_) n += un.fsdp2_trainable_shard_numel;
    return n;
  }
  std::int64_t bucket_shard_numel(const GradBucket& bk) const {
    if (!fsdp2()) return shard(bk.numel);
    std::int64_t n = 0;
    for (std::size_t u : bk.units) n += units_[u].fsdp2_trainable_shard_numel;
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
  // ZeRO-3 as the executor runs it: the program names every tensor's place in the unit's
  // gathered buffer and the shards the all_gathers read (see setup and gather_unit).
  // The fraction of eager attention's S x S_kv score GEMM work that is done. PyTorch's eager
  // attention (transformers' eager_attention_forward) multiplies the full matrices and masks
  // afterwards: all of it. The executor (executor/cpu/attention.cpp) multiplies causal row
  // blocks of kExecAttentionRows rows, each against the columns up to its last row, and skips
  // the blocks above the diagonal: with nb = ceil(S / rows) blocks, (nb + 1) / (2 nb) of the work
  // when S_kv = S (3/4 at S 128, 5/8 at S 256, towards 1/2).
  double eager_gemm_fraction() const {
    if (in_.profile != RuntimeProfile::executor || kv_len_ != t_.seq_len) return 1.0;
    const std::int64_t S = t_.seq_len, rows = kExecAttentionRows;
    double done = 0.0;  // sum over row blocks of rows x columns multiplied
    for (std::int64_t i0 = 0; i0 < S; i0 += rows)
      done += static_cast<double>(std::min(rows, S - i0)) * static_cast<double>(std::min(S, i0 + rows));
    return done / (static_cast<double>(S) * static_cast<double>(S));
  }
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
  bool root_unit(std::size_t u) const { return fsdp() && (u == 0 || u == units_.size() - 1); }
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

  void facts();
  void plan_linears();
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
  std::int32_t linear_forward(LinearPlan& lp, std::int32_t x, std::int32_t layer, Phase phase, Cat out_cat,
                              Cat saved_cat, std::vector<std::int32_t>& saved, std::optional<DType> out_dtype = std::nullopt);
  std::int32_t linear_backward(LinearPlan& lp, std::int32_t dy, std::int32_t dx, std::int32_t x, std::int32_t layer,
                               bool dx_first);
  std::int32_t compute_acc(std::int32_t op) {  // marks a compute op as adding into its output
    p_.ops[static_cast<std::size_t>(op)].accumulate = true;
    return op;
  }
  void adapter_views();
  void plan_buckets();
  void bucket_ranges();
  std::int64_t flat_position(std::int64_t x) const;  // trainable.flat element of flat element x
  void bind_base(const models::TensorInfo& t, std::int32_t b);

  // --- dtypes the runtime rules give tensors ---
  // A frozen tensor's bytes: its storage dtype, or fp32 for norms the runtime keeps in fp32.
  std::uint64_t frozen(const models::TensorInfo& t) const {
    if (fp32_norms_ && (t.role == models::ParamRole::norm_weight || t.role == models::ParamRole::norm_bias)) return f32(t.numel());
    return frozen_bytes(t, f_.base_dtype, f_.compute_dtype, in_.peft.quantization);
  }
  static std::uint64_t bytes(DType d, std::int64_t elems) { return storage_bytes(d, elems); }
  // Norm outputs, the MLP and the residual stream after the first layer are fp32 when the norms
  // are (fp32_norms_on_kbit); the embedding output and attention stay in the compute dtype.
  DType stream_dtype() const { return fp32_norms_ ? DType::fp32 : f_.compute_dtype; }
  DType resid_dtype(std::int64_t l) const { return l == 0 ? f_.compute_dtype : stream_dtype(); }

  const PlanInput& in_;
  RuntimeRules rules_;
  bool fp32_norms_ = false;                   // see RuntimeRules::fp32_norms_on_kbit
  DType adapter_act_dtype_ = DType::bf16;     // the adapter branch's activations
  const models::ModelSpec& m_;
  const TrainingSpec& t_;
  const Strategy& s_;
  sim::Program p_;
  ProgramFacts f_;
  bool names_;
  // BuildOptions::evaluation: the forward and the loss under torch.no_grad, nothing after.
  bool eval_ = false;
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

  ModelInventory owned_inventory_;                      // when the input brings none
  const std::vector<models::TensorInfo>* tensors_ = nullptr;  // the parameter inventory
  std::vector<std::vector<LinearPlan>> layer_linears_;  // per layer, model order
  std::unordered_map<std::string_view, LinearPlan*> by_path_;  // module path -> its plan
  std::vector<LinearPlan> head_linears_;                // lm_head (and OPT projections)
  std::vector<Unit> units_;                             // 0 = embedding, 1..L = layers, L+1 = head
  std::int64_t trainable_numel_ = 0;                    // all trainable elements
  std::int64_t extra_trainable_numel_ = 0;              // prompt/prefix embeddings, DoRA, biases
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
  std::int64_t part_numel_ = 0;      // executor profile, ZeRO-3: the partition's elements (Σ unit
                                     //   shards); ZeRO-2 with N > 1: Σ bucket shards
  std::int32_t trainable_flat_ = -1; // trainable weights, flat (replicated strategies)
  std::int32_t embed_buf_ = -1;
  std::int32_t opt_states_ = -1;     // optimizer.states (m then v for AdamW)
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
  std::vector<GradBucket> buckets_;          // ZeRO-2/3 with several ranks
  std::vector<std::int32_t> bucket_of_, flush_of_;  // per unit: its bucket, the bucket it flushes
  std::vector<std::int32_t> bucket_buf_;     // per bucket: this micro-batch's gradient buffer
  std::int32_t staging_ = -1;                // host.staging (optimizer offload)
  std::int32_t host_params_ = -1;            // executor offload: the host copy of the partition
  std::int32_t dres_ = -1;                   // gradient of the residual stream
  // Gradient buckets (DDP / ZeRO-2): pending unit gradients and their element count.
  std::vector<std::size_t> bucket_units_;
  std::int64_t bucket_numel_ = 0;
  std::vector<std::int32_t> reduce_ops_;
};

void Builder::facts() {
  const bool exec = in_.profile == RuntimeProfile::executor;
  switch (t_.precision) {
    case Precision::fp32: f_.compute_dtype = DType::fp32; break;
    case Precision::fp16_mixed: f_.compute_dtype = DType::fp16; break;
    case Precision::bf16_mixed:
    case Precision::bf16_pure: f_.compute_dtype = DType::bf16; break;
  }
  if (exec) f_.compute_dtype = DType::fp32;  // the executor computes in fp32
  const bool mixed = t_.precision == Precision::fp16_mixed || t_.precision == Precision::bf16_mixed;
  const bool peft = !in_.peft.adapters.empty();
  f_.trainable_dtype = peft && rules_.adapter_dtype ? *rules_.adapter_dtype : f_.compute_dtype;
  f_.master_weights = rules_.fp32_master_for_mixed && mixed && f_.trainable_dtype != DType::fp32;
  const auto& q = in_.peft.quantization;
  // Under FSDP, TRL sees a sharded QLoRA model and skips prepare_model_for_kbit_training
  // (trl 0.13.0 sft_trainer.py is_sharded_qlora): the norms stay in the compute dtype.
  fp32_norms_ = rules_.fp32_norms_on_kbit && q && bits_of(q->dtype) <= 8 && !fsdp();
  // Under autocast the adapter's GEMMs run in the compute dtype; without it, in its own dtype.
  adapter_act_dtype_ = mixed ? f_.compute_dtype : f_.trainable_dtype;
  f_.base_dtype = t_.base_storage.value_or(in_.peft.quantization ? in_.peft.quantization->dtype : f_.compute_dtype);
  M_ = t_.micro_batch * t_.seq_len;
  kv_len_ = t_.seq_len;
  for (const auto& a : in_.peft.adapters) {
    if (a.type == models::PeftType::prompt_tuning) M_ = t_.micro_batch * (t_.seq_len + a.prompt.num_virtual_tokens);
    if (a.type == models::PeftType::prefix_tuning) kv_len_ += a.prompt.num_virtual_tokens;
  }
  if (M_ / t_.micro_batch > t_.seq_len) kv_len_ = M_ / t_.micro_batch;
}

void Builder::plan_linears() {
  if (!in_.inventory) owned_inventory_ = make_inventory(m_, in_.peft);
  const ModelInventory& inv = in_.inventory ? *in_.inventory : owned_inventory_;
  inv_ = &inv;
  tensors_ = &inv.tensors;
  const auto& tensors = inv.tensors;
  const auto& linears = inv.linears;
  const bool full = in_.peft.adapters.empty();
  const auto& trainables = inv.trainables;
  std::map<std::string, Adapter> adapters;
  std::set<std::string> trained_modules;  // modules_to_save, bias=all: base tensors that train
  if (!full) {
    for (const auto& lm : inv.loras) {
      Adapter& a = adapters[lm.linear.path];
      a.r += lm.r;  // several adapters on one module: their ranks add up
      a.dropout = std::max(a.dropout, lm.dropout);
      if (a.scale == 0.0) a.scale = lm.scale;  // (the first adapter's; the executor runs one)
    }
    std::int32_t lora_modules = 0;
    for (const auto& t : trainables) {
      if (t.name.find(".lora_A") != std::string::npos || t.name.find(".lora_B") != std::string::npos) {
        Adapter& a = adapters[t.module];
        a.params += t.numel();
        if (a.index < 0 && t.name.find(".lora_A") != std::string::npos) a.index = lora_modules++;
      } else if (t.name.find(".ia3_l") != std::string::npos) {
        Adapter& a = adapters[t.module];
        a.params += t.numel();
      } else {
        extra_trainable_numel_ += t.numel();
        if (!t.is_base_param && t.module != "prompt_encoder") trained_modules.insert(t.module);
      }
      trainable_numel_ += t.numel();
    }
  }
  layer_linears_.assign(static_cast<std::size_t>(m_.layers), {});
  for (const auto& lm : linears) {
    LinearPlan lp;
    lp.mod = &lm;
    lp.role = role_of(lm);
    lp.trainable_weight = full || trained_modules.count(lm.path) > 0;
    lp.input_dtype = lp.role == Role::attn_out || lm.layer < 0 ? f_.compute_dtype : stream_dtype();
    if (auto it = adapters.find(lm.path); it != adapters.end()) {
      lp.adapter = it->second;
      // PEFT's branch saves a tensor of its own when it casts the input to the adapter's dtype
      // or drops it out; otherwise its GEMM saves the module's input itself.
      const DType x_dtype = lp.input_dtype;
      lp.adapter_owns_input = rules_.adapter_owns_input && (lp.adapter->dropout > 0.0 || x_dtype != adapter_act_dtype_);
    }
    if (lm.expert >= 0) lp.token_share = static_cast<double>(m_.experts_per_token) / static_cast<double>(m_.experts);
    if (lm.layer >= 0) layer_linears_[static_cast<std::size_t>(lm.layer)].push_back(lp);
    else head_linears_.push_back(lp);
  }
  for (auto& lv : layer_linears_)
    for (auto& lp : lv) by_path_[lp.mod->path] = &lp;
  for (auto& lp : head_linears_) by_path_[lp.mod->path] = &lp;
  // Units for ZeRO-3 (and for the sizes every strategy reports).
  units_.assign(static_cast<std::size_t>(m_.layers) + 2, Unit{});
  units_[0].name = "embedding";
  for (std::int64_t l = 0; l < m_.layers; ++l) units_[static_cast<std::size_t>(l) + 1].name = fmt::format("layers.{}", l);
  units_.back().name = "head";
  const auto& q = in_.peft.quantization;
  for (const auto& t : tensors) {
    std::size_t u = t.layer >= 0 ? static_cast<std::size_t>(t.layer) + 1
                    : (t.role == models::ParamRole::embedding || t.role == models::ParamRole::position_embedding)
                        ? 0
                        : units_.size() - 1;
    const bool trains = full || trained_modules.count(t.module) > 0;
    f_.base_params += trains && full ? 0 : t.numel();
    if (trains && full) {
      units_[u].trainable_numel += t.numel();
      if (fsdp2()) units_[u].fsdp2_trainable_shard_numel += dim0_rows_shard(t);
      continue;
    }
    std::uint64_t bytes = frozen(t);
    f_.base_bytes += bytes;
    const bool persistent = zero3() && !fsdp() && t.numel() < s_.ds.stage3_param_persistence_threshold;
    // FSDP flattens the packed 4-bit weight (bnb_4bit_quant_storage relabels its n/2 bytes) but
    // not its QuantState, which every rank keeps whole (bitsandbytes 0.43.3 nn/modules.py
    // Linear4bit.forward re-attaches it: "the quant state got lost when the parameter got
    // converted. This happens for example for fsdp").
    if (fsdp() && q && t.role == models::ParamRole::linear_weight && bits_of(q->dtype) < 8) {
      const std::uint64_t packed = storage_bytes(q->dtype, t.numel());
      units_[u].persistent_bytes += bytes - packed;
      bytes = packed;
    }
    if (exec_z3())
      (persistent ? units_[u].persistent_tensors : units_[u].gathered_tensors)
          .push_back({&t, persistent ? units_[u].persistent_bytes : units_[u].frozen_bytes, bytes});
    if (persistent) {
      units_[u].persistent_numel += t.numel();
      units_[u].persistent_bytes += bytes;
    } else {
      units_[u].frozen_numel += t.numel();
      units_[u].frozen_bytes += bytes;
      if (fsdp2()) {  // a packed 4-bit weight is a [n / 4, 1] tensor of bf16 storage elements
        const bool packed = bytes != frozen(t) || (q && t.role == models::ParamRole::linear_weight && bits_of(q->dtype) < 8);
        const std::uint64_t rows = packed ? std::max<std::uint64_t>(1, bytes / 2) : static_cast<std::uint64_t>(t.shape.empty() ? 1 : t.shape[0]);
        units_[u].fsdp2_frozen_shard_bytes += ceil_div(rows, static_cast<std::uint64_t>(group())) * (bytes / rows);
      }
    }
  }
  auto dim0_shard = [&](std::int64_t rows, std::int64_t numel) {  // FSDP2: ceil(d0 / N) rows
    if (rows <= 0) return shard(numel);
    return shard(rows) * (numel / rows);
  };
  if (full) {
    for (const auto& t : tensors) trainable_numel_ += t.numel();
  } else {
    for (const auto& [path, a] : adapters) {
      const LinearPlan* lp = by_path_.at(std::string_view(path));
      Unit& un = units_[lp->mod->layer >= 0 ? static_cast<std::size_t>(lp->mod->layer) + 1 : units_.size() - 1];
      un.trainable_numel += a.params;
      // lora_A [r, in] and lora_B [out, r]; IA3's vector [out] (or [in]) as one tensor.
      if (fsdp2())
        un.fsdp2_trainable_shard_numel += a.r > 0 && a.params == a.r * (lp->mod->in + lp->mod->out)
                                              ? dim0_shard(a.r, a.r * lp->mod->in) + dim0_shard(lp->mod->out, lp->mod->out * a.r)
                                              : shard(a.params);
    }
    units_[0].trainable_numel += extra_trainable_numel_;  // prompt embeddings, biases, copies
    if (fsdp2()) units_[0].fsdp2_trainable_shard_numel += shard(extra_trainable_numel_);
  }
  f_.trainable_params = trainable_numel_;
  for (const auto& u : units_) f_.largest_layer_params = std::max(f_.largest_layer_params, u.frozen_numel + u.trainable_numel);
  // FSDP1's units as accelerate wraps a PEFT model: the root, each decoder layer, and (PEFT's
  // fsdp_auto_wrap_policy, peft/utils/other.py: a leaf module whose weight trains) each adapter
  // Linear; each runs its hooks in forward and backward, and again in a checkpointed layer's
  // recompute.
  if (fsdp() && s_.fsdp.version == 1) {
    f_.fsdp_unit_passes = 2;  // the root
    for (std::int64_t l = 0; l < m_.layers; ++l) f_.fsdp_unit_passes += checkpointed(l) ? 3 : 2;
    for (const auto& t : inv_->trainables) f_.fsdp_unit_passes += t.layer >= 0 && checkpointed(t.layer) ? 3 : 2;
  }
}

// Library buffers inside the caching allocator (they count in torch.cuda.memory_allocated):
// cuBLAS's workspaces, one per (handle, stream) (runtime.cpp). The CUDA context lies outside the
// allocator and outside the program (RuntimeRules::context_bytes).
void Builder::add_cuda_runtime() {
  const std::uint64_t ws = cublas_workspace_bytes(in_.device_sm);
  for (int i = 0; i < rules_.cublas_workspaces; ++i)
    alloc([&] { return i == 0 ? std::string("cublas.workspace.forward") : fmt::format("cublas.workspace.{}", i == 1 ? "backward" : std::to_string(i)); },
          Cat::runtime_overhead, ws, Phase::setup);
}

void Builder::setup() {
  const Phase S = Phase::setup;
  norm1_.assign(static_cast<std::size_t>(m_.layers), -1);
  norm2_.assign(static_cast<std::size_t>(m_.layers), -1);
  const std::uint64_t tw = bytes_of(f_.trainable_dtype);
  const std::int64_t N = group();
  // Frozen base weights: whole on every rank, or a ZeRO-3 shard (flattened per unit, padded to a
  // multiple of N) plus the persistent small tensors.
  if (zero3()) {
    for (std::size_t u = 0; u < units_.size(); ++u) {
      Unit& un = units_[u];
      if (un.frozen_numel > 0) {
        const std::uint64_t shard_bytes = frozen_shard_bytes(un);
        if (s_.offload_param == OffloadDevice::cpu)
          un.frozen_shard = alloc([&] { return un.name + ".frozen.shard"; }, Cat::host_weights, shard_bytes, S);
        else
          un.frozen_shard = alloc([&] { return un.name + ".frozen.shard"; }, Cat::base_weights, shard_bytes, S);
      }
      if (un.persistent_bytes > 0) {
        const std::int32_t pb = alloc([&] { return un.name + ".frozen.persistent"; }, Cat::base_weights, un.persistent_bytes, S);
        // The persistent small tensors are whole on every rank: kernels read them directly.
        for (const Unit::Tensor& t : un.persistent_tensors) bind_base(*t.info, p_.add_view(names_ ? t.info->name : std::string(), pb, t.offset, t.bytes));
      }
      if (exec_z3()) {  // one adapter partition, unit blocks in unit order (below)
        un.part_offset = part_numel_;
        part_numel_ += shard(un.trainable_numel);
      } else if (un.trainable_numel > 0)
        un.trainable_shard = alloc([&] { return un.name + ".trainable.shard"; }, s_.offload_param == OffloadDevice::cpu ? Cat::host_weights : Cat::trainable_weights,
                                   tw * static_cast<std::uint64_t>(trainable_shard_numel(un)), S);
    }
  } else {
    const bool full = in_.peft.adapters.empty();
    for (const auto& t : *tensors_) {
      if (full) continue;
      bind_base(t, alloc([&] { return t.name; }, Cat::base_weights, frozen(t), S));
    }
    // Trainable weights, flat; padded to a multiple of N when an all_gather refills them.
    const std::int64_t padded = exec_z2() ? part_numel_ * N : sharded_optimizer() ? shard(trainable_numel_) * N : trainable_numel_;
    trainable_flat_ = state_buffer(sim::BufferRole::trainable_flat, Cat::trainable_weights, tw * static_cast<std::uint64_t>(padded), S);
    if (full) {  // every weight lives in the flat trainable buffer
      embed_buf_ = trainable_flat_;
      for (auto& lv : layer_linears_)
        for (auto& lp : lv) lp.weight_buf = trainable_flat_;
      for (auto& lp : head_linears_) lp.weight_buf = trainable_flat_;
    }
    // Gradients: full on every rank for DDP / ZeRO-1, a partition for ZeRO-2.
    if (exec_z2()) {
      grad_shard_ = state_buffer(sim::BufferRole::grad_shard, Cat::gradients, tw * static_cast<std::uint64_t>(part_numel_), S);
      for (std::size_t b = 0; b < buckets_.size(); ++b) {
        GradBucket& bk = buckets_[b];
        const std::uint64_t sb = static_cast<std::uint64_t>(shard(bk.numel));
        bk.grad_view = p_.add_view(names_ ? fmt::format("grad.shard[bucket{}]", b) : std::string(), grad_shard_, tw * static_cast<std::uint64_t>(bk.part_offset), tw * sb);
        bk.param_view = p_.add_view(names_ ? fmt::format("trainable.flat[bucket{}]", b) : std::string(), trainable_flat_, tw * static_cast<std::uint64_t>(bk.region), tw * sb * static_cast<std::uint64_t>(N));
      }
    } else if (sharded_grads())
      grad_shard_ = state_grad(sim::BufferRole::grad_shard, tw * static_cast<std::uint64_t>(shard(trainable_numel_)));
    else if (rules_.grads_only_in_backward) {  // allocated when backward first reaches a gradient
      grad_flat_ = state_grad(sim::BufferRole::grad_flat, tw * static_cast<std::uint64_t>(padded));
      per_tensor(grad_flat_, tw, 1);
      // Full fine-tuning: each weight's backward writes its own gradient (a view at the tensor's
      // inventory offset), so that the replay allocates it there, layer by layer.
      if (full && !p_.buffers[static_cast<std::size_t>(grad_flat_)].pieces.empty()) {
        std::uint64_t off = 0;
        for (const auto& t : *tensors_) {
          const std::uint64_t bytes = tw * static_cast<std::uint64_t>(t.numel());
          if (t.role == models::ParamRole::linear_weight || t.role == models::ParamRole::lm_head || t.role == models::ParamRole::embedding)
            weight_grad_[std::string_view(t.module)] = p_.add_view(names_ ? "grad." + t.name : std::string(), grad_flat_, off, bytes);
          if (t.role == models::ParamRole::embedding) embed_grad_ = weight_grad_[std::string_view(t.module)];
          off += bytes;
        }
        if (m_.tie_embeddings)  // a tied head's gradient accumulates into the embedding's
          for (const auto& lp : head_linears_)
            if (!weight_grad_.contains(std::string_view(lp.mod->path))) weight_grad_[std::string_view(lp.mod->path)] = embed_grad_;
      }
    }
    else
      grad_flat_ = state_buffer(sim::BufferRole::grad_flat, Cat::gradients, tw * static_cast<std::uint64_t>(padded), S);
  }
  if (exec_z3()) {
    // The executor's ZeRO-3 adapter partition is per unit: rank r holds block r of every unit's
    // flattened adapter (padded to a multiple of N), the blocks one after another in unit order,
    // in trainable.shard; grad.shard has the same layout, so that the optimizer pairs them
    // element by element, and each unit's reduce_scatter delivers exactly its block.
    // Under parameter offload the partition lives on the host with the frozen shards (as the
    // other profiles place their trainable shards); each gather stages it on the device.
    trainable_shard_ = state_buffer(sim::BufferRole::trainable_shard, s_.offload_param == OffloadDevice::cpu ? Cat::host_weights : Cat::trainable_weights,
                                  tw * static_cast<std::uint64_t>(part_numel_), S);
    grad_shard_ = state_buffer(sim::BufferRole::grad_shard, Cat::gradients, tw * static_cast<std::uint64_t>(part_numel_), S);
    for (Unit& un : units_) {
      if (un.trainable_numel == 0) continue;
      const std::uint64_t off = tw * static_cast<std::uint64_t>(un.part_offset), bytes = tw * static_cast<std::uint64_t>(shard(un.trainable_numel));
      un.trainable_shard = p_.add_view(names_ ? un.name + ".trainable.shard" : std::string(), trainable_shard_, off, bytes);
      un.grad_shard_view = p_.add_view(names_ ? un.name + ".grad.shard" : std::string(), grad_shard_, off, bytes);
    }
  } else if (zero3()) {
    grad_shard_ = state_grad(sim::BufferRole::grad_shard, tw * static_cast<std::uint64_t>(trainable_shard_total()));
  }
  // Optimizer states for this rank's partition (all of it for DDP), on the device or the host.
  const std::int64_t opt_numel = exec_z3() || exec_z2() ? part_numel_ : sharded_optimizer() ? trainable_shard_total() : trainable_numel_;
  const bool host_opt = host_optimizer();
  const Cat opt_cat = host_opt ? Cat::host_optimizer_states : Cat::optimizer_states;
  double state_bytes = 0.0;
  const bool pure = t_.precision == Precision::bf16_pure && in_.profile != RuntimeProfile::executor;
  // A state's bytes per element: the parameters' dtype (torch.optim), else bf16 in pure-bf16
  // runs and fp32 otherwise.
  const double state = rules_.states_follow_params ? static_cast<double>(tw) : pure ? 2.0 : 4.0;
  switch (t_.optimizer) {
    case Optimizer::adamw: state_bytes = 2.0 * state; break;   // m, v
    // bitsandbytes 8-bit Adam: two uint8 states plus one fp32 absmax per 256-element block each
    // (Dettmers et al., 8-bit Optimizers via Block-wise Quantization, arXiv 2110.02861, §2).
    case Optimizer::adamw_8bit: state_bytes = 2.0 + 8.0 / 256.0; break;
    case Optimizer::sgd_momentum: state_bytes = state; break;
  }
  opt_states_ = state_buffer(sim::BufferRole::optimizer_states, opt_cat, static_cast<std::uint64_t>(std::ceil(state_bytes * static_cast<double>(opt_numel))), S);
  if (t_.optimizer == Optimizer::adamw && rules_.states_follow_params && !host_opt) per_tensor(opt_states_, tw, 2);
  if (exec_z2() && !host_opt)  // per bucket: its m then its v (the step runs bucket by bucket)
    for (GradBucket& bk : buckets_)
      bk.state_view = p_.add_view(std::string(), opt_states_, 2 * tw * static_cast<std::uint64_t>(bk.part_offset),
                                  2 * tw * static_cast<std::uint64_t>(shard(bk.numel)));
  if (f_.master_weights) alloc([&] { return "optimizer.master_fp32"; }, opt_cat, f32(opt_numel), S);
  // Runtime profile: buffers outside the model.
  if (in_.profile == RuntimeProfile::deepspeed) {
    const bool overlap = s_.ds.overlap(zero3());
    // stage_1_and_2.py: with contiguous_gradients an ipg buffer of reduce_bucket_size elements
    // (two when overlap_comm) in the gradient dtype; we cap it at the trainable size.
    if (s_.stage != Stage::ddp && s_.ds.contiguous_gradients) {
      const std::int64_t elems = std::min<std::int64_t>(s_.ds.reduce_bucket_size, trainable_numel_);
      alloc([&] { return "deepspeed.ipg_buffer"; }, Cat::comm_buffers, tw * static_cast<std::uint64_t>(elems) * (overlap ? 2 : 1), S);
    }
    add_cuda_runtime();
    if (host_opt && s_.ds.offload_pin_memory)
      alloc([&] { return "deepspeed.pinned_grads"; }, Cat::host_pinned_buffers, f32(opt_numel), S);
  } else if (in_.profile == RuntimeProfile::hf) {
    // torch.nn.parallel.DistributedDataParallel: gradient buckets of bucket_cap_mb = 25 MiB each,
    // together as large as the gradients (gradient_as_bucket_view=False copies into them).
    if (s_.ranks > 1 && s_.stage == Stage::ddp)
      alloc([&] { return "ddp.buckets"; }, Cat::comm_buffers, tw * static_cast<std::uint64_t>(trainable_numel_), S);
    add_cuda_runtime();
  }
  if (host_opt) staging_ = alloc([&] { return "host.staging"; }, Cat::host_pinned_buffers, tw * static_cast<std::uint64_t>(opt_numel), S);
  // The executor's offloaded step updates a host copy of this rank's parameter partition (the
  // fp32 "master" DeepSpeed keeps on the CPU) and copies it back.
  if (host_opt && in_.profile == RuntimeProfile::executor)
    host_params_ = state_buffer(sim::BufferRole::optimizer_params, Cat::host_optimizer_states, tw * static_cast<std::uint64_t>(opt_numel), S);
  if (exec_z2() && host_params_ >= 0)
    for (GradBucket& bk : buckets_)
      bk.host_view = p_.add_view(std::string(), host_params_, tw * static_cast<std::uint64_t>(bk.part_offset), tw * static_cast<std::uint64_t>(shard(bk.numel)));
}

// The buffer kernels read a frozen tensor from: its own buffer, a ZeRO-3 persistent view, or a
// view of its unit's gathered buffer.
void Builder::bind_base(const models::TensorInfo& t, std::int32_t b) {
  PEFTPLAN_CHECK(&t >= tensors_->data() && &t < tensors_->data() + tensors_->size());
  role(b, sim::BufferRole::base_tensor, static_cast<std::int32_t>(&t - tensors_->data()));
  if (t.role == models::ParamRole::embedding) embed_buf_ = b;
  if (t.role == models::ParamRole::norm_weight) {  // Llama-family names (transformers)
    if (t.layer < 0) final_norm_ = b;
    else if (t.module.ends_with("input_layernorm")) norm1_[static_cast<std::size_t>(t.layer)] = b;
    else if (t.module.ends_with("post_attention_layernorm")) norm2_[static_cast<std::size_t>(t.layer)] = b;
  }
  if (auto it = by_path_.find(std::string_view(t.module)); it != by_path_.end())
    (t.role == models::ParamRole::linear_bias ? it->second->bias_buf : it->second->weight_buf) = b;
}

// ZeRO-3: all_gather a unit's frozen (and trainable) shards into a full buffer. `use` makes the
// next compute op wait for it; a prefetch (use = false) only issues it, so that it runs on the
// comm stream while the current unit computes (DeepSpeed's PartitionedParameterCoordinator
// prefetches up to stage3_prefetch_bucket_size elements ahead).
void Builder::issue_chunk(std::int32_t after) {
  const Chunk c = pending_[pending_next_++];
  gather_op_[c.unit] = collective(Collective::all_gather, c.label, c.bytes, static_cast<std::int32_t>(c.unit) - 1, c.phase,
                                  gathered_[c.unit], {after});
  if (pending_next_ == pending_.size()) {
    pending_.clear();
    pending_next_ = 0;
  }
}

void Builder::gather_unit(std::size_t u, Phase phase, bool use) {
  if (!zero3()) return;
  if (gathered_[u] >= 0) {
    if (use) {
      while (pending_next_ < pending_.size()) issue_chunk(last_compute_);  // needed now
      if (gather_op_[u] >= 0) wait_ = gather_op_[u];
      if (fsdp2() && ag_out_[u] >= 0) fsdp2_copy_out(u, phase);
    }
    return;
  }
  Unit& un = units_[u];
  const std::int64_t N = group();
  // FSDP's MixedPrecision gathers the trainable units in the compute dtype (param_dtype).
  const bool mp = fsdp() && (t_.precision == Precision::bf16_mixed || t_.precision == Precision::fp16_mixed);
  const std::uint64_t tw = mp ? bytes_of(f_.compute_dtype) : bytes_of(f_.trainable_dtype);
  const std::uint64_t frozen_full = frozen_shard_bytes(un) * static_cast<std::uint64_t>(N);
  const std::uint64_t train_full = tw * static_cast<std::uint64_t>(trainable_shard_numel(un) * N);
  if (frozen_full + train_full == 0) return;
  // A prefetch never runs further ahead than max_live_parameters allows.
  if (!use && !fsdp() && un.frozen_numel + un.trainable_numel > s_.ds.stage3_max_live_parameters) return;
  std::int32_t staged = -1;
  // The gather is issued when the program reaches it: after the compute emitted before it.
  std::int32_t dep = last_compute_;
  std::int32_t dep_train = -1, dep_frozen = -1, staged_train = -1, staged_frozen = -1;  // executor profile
  if (s_.offload_param == OffloadDevice::cpu) {  // host shard -> device staging before the gather
    const std::uint64_t shard_bytes = (frozen_full + train_full) / static_cast<std::uint64_t>(N);
    staged = alloc([&] { return un.name + ".staged"; }, Cat::comm_buffers, shard_bytes, phase);
    if (exec_z3()) {
      // Executor profile: the staging buffer holds this rank's adapter block then its frozen
      // shard, each copied from its host buffer (Op::buffer) into a view of the staging buffer
      // (Op::buffer_out), the view the all_gather reads (Op::buffer_in).
      const std::string sname = names_ ? p_.buffers[static_cast<std::size_t>(staged)].name : std::string();
      auto stage = [&](std::string_view part, std::uint64_t off, std::uint64_t bytes, std::int32_t from, std::int32_t& view) {
        view = p_.add_view(names_ ? sname + std::string(part) : std::string(), staged, off, bytes);
        const std::int32_t c = dep >= 0 ? copy(CopyDir::host_to_device, "param_h2d", bytes, phase, from, {dep})
                                        : copy(CopyDir::host_to_device, "param_h2d", bytes, phase, from, {});
        p_.ops[static_cast<std::size_t>(c)].buffer_out = view;
        return c;
      };
      const std::uint64_t train_shard = train_full / static_cast<std::uint64_t>(N);
      if (train_full > 0) dep_train = stage(".trainable", 0, train_shard, un.trainable_shard, staged_train);
      if (frozen_full > 0) dep_frozen = stage(".frozen", train_shard, frozen_full / static_cast<std::uint64_t>(N), un.frozen_shard, staged_frozen);
    } else {
      dep = dep >= 0 ? copy(CopyDir::host_to_device, "param_h2d", shard_bytes, phase, staged, {dep})
                     : copy(CopyDir::host_to_device, "param_h2d", shard_bytes, phase, staged, {});
    }
  }
  gathered_[u] = alloc([&] { return fmt::format("{}.gathered.{}", un.name, name_of(phase)); }, Cat::gathered_weights, frozen_full + train_full, phase);
  // FSDP allocates the unsharded parameter on its unshard stream (_runtime_utils.py _unshard:
  // `with state._device_handle.stream(unshard_stream)`): the caching allocator then caches that
  // block for that stream only. FSDP2 allocates its flat all-gather output there too
  // (_fsdp_collectives.py foreach_all_gather, on all_gather_copy_in_stream).
  if (fsdp()) p_.ops.back().stream = Stream::comm;
  // FSDP1 frees it in reshard after record_stream on the compute stream that read it
  // (flat_param.py _free_unsharded_flat_param): its block is reused only once the GPU is past
  // the free, which the rate limiter bounds to one reshard behind (program.h). FSDP2 records no
  // stream: it holds references until the streams have waited on an event.
  if (fsdp() && !fsdp2() && in_.profile != RuntimeProfile::executor) p_.buffers[static_cast<std::size_t>(gathered_[u])].reuse_after_next_recorded_free = true;
  if (fsdp2()) ag_out_[u] = gathered_[u];
  const auto layer = static_cast<std::int32_t>(u) - 1;
  // Executor profile: the gathered buffer is the unit's flattened adapter (padded to a multiple
  // of N elements, unit inventory order) then its flattened frozen tensors (padded to a multiple
  // of N bytes, inventory order). Each all_gather fills one region (a view: its payload) from
  // this rank's shard (Op::buffer_in), rank r's shard landing in block r of the region; kernels
  // bind to views of the gathered buffer, one per tensor.
  std::int32_t payload_train = gathered_[u], payload_frozen = gathered_[u], shard_train = -1, shard_frozen = -1;
  if (exec_z3()) {
    const std::int32_t g = gathered_[u];
    const std::string gname = names_ ? p_.buffers[static_cast<std::size_t>(g)].name : std::string();
    if (train_full > 0) {
      payload_train = p_.add_view(names_ ? gname + ".trainable" : std::string(), g, 0, train_full);
      shard_train = staged_train >= 0 ? staged_train : un.trainable_shard;
    }
    if (frozen_full > 0) {
      payload_frozen = p_.add_view(names_ ? gname + ".frozen" : std::string(), g, train_full, frozen_full);
      shard_frozen = staged_frozen >= 0 ? staged_frozen : un.frozen_shard;
    }
    for (const Unit::Tensor& t : un.gathered_tensors)
      bind_base(*t.info, p_.add_view(names_ ? t.info->name : std::string(), g, train_full + t.offset, t.bytes));
    auto bind_adapter = [&](LinearPlan& lp) {
      if (!lp.adapter || lp.adapter->a_off < 0 || un.flat_offset < 0) return;
      Adapter& a = *lp.adapter;
      auto view = [&](std::int32_t tensor, std::int64_t off, std::int64_t numel) {
        return role(p_.add_view(names_ ? inv_->trainables[static_cast<std::size_t>(tensor)].name : std::string(), g,
                                tw * static_cast<std::uint64_t>(off - un.flat_offset), tw * static_cast<std::uint64_t>(numel)),
                    sim::BufferRole::adapter_tensor, tensor);
      };
      a.a_buf = view(a.a_tensor, a.a_off, a.a_numel);
      a.b_buf = view(a.b_tensor, a.b_off, a.b_numel);
    };
    if (u == units_.size() - 1) for (auto& lp : head_linears_) bind_adapter(lp);
    else if (u >= 1) for (auto& lp : layer_linears_[u - 1]) bind_adapter(lp);
  }
  auto issue = [&](std::string_view label, std::uint64_t bytes, std::int32_t payload, std::int32_t from, std::int32_t after) {
    gather_op_[u] = after >= 0 ? collective(Collective::all_gather, label, bytes, layer, phase, payload, {after})
                               : collective(Collective::all_gather, label, bytes, layer, phase, payload, {});
    p_.ops[static_cast<std::size_t>(gather_op_[u])].buffer_in = from;
    p_.ops[static_cast<std::size_t>(gather_op_[u])].group_size = static_cast<std::int32_t>(N);
  };
  if (train_full > 0) issue("gather_trainable", train_full, payload_train, shard_train, dep_train >= 0 ? dep_train : dep);
  if (frozen_full > 0) {
    // Prefetches go out in chunks of stage3_prefetch_bucket_size elements, one now and one after
    // each following compute op; a gather needed now goes out whole. The executor profile
    // gathers a unit's frozen region in one op (its chunks would not be contiguous blocks of
    // every rank's shard).
    const std::uint64_t chunks =
        use || exec_z3() || fsdp() ? 1 : std::max<std::uint64_t>(1, ceil_div(static_cast<std::uint64_t>(un.frozen_numel),
                                                      static_cast<std::uint64_t>(std::max<std::int64_t>(1, s_.ds.stage3_prefetch_bucket_size))));
    const std::uint64_t chunk = frozen_full / chunks / static_cast<std::uint64_t>(N) * static_cast<std::uint64_t>(N);  // whole shards
    issue("gather_frozen", frozen_full - chunk * (chunks - 1), payload_frozen, shard_frozen, dep_frozen >= 0 ? dep_frozen : dep);
    for (std::uint64_t c = 1; c < chunks; ++c) pending_.push_back(Chunk{u, chunk, "gather_frozen", phase});
  }
  if (staged >= 0) free(staged, phase);
  if (use) wait_ = gather_op_[u];
  if (use && fsdp2()) fsdp2_copy_out(u, phase);
}

// FSDP2 (_fsdp_collectives.py foreach_all_gather_copy_out, on the default stream): the flat
// all-gather output is split into each parameter's unsharded tensor (split_with_sizes_copy), the
// two live together for the copy. In forward the flat output is then held in
// comm_ctx.all_gather_state until the next unit's copy-out (or the root's post-forward); in
// backward it is freed at once (_fsdp_param_group.py wait_for_unshard).
void Builder::fsdp2_copy_out(std::size_t u, Phase phase) {
  const std::int32_t flat = ag_out_[u];
  const std::uint64_t bytes = p_.buffers[static_cast<std::size_t>(flat)].bytes;
  const std::int32_t unsharded = alloc([&] { return fmt::format("{}.unsharded.{}", units_[u].name, name_of(phase)); }, Cat::gathered_weights, bytes, phase);
  compute("fsdp_copy_out", static_cast<std::int32_t>(u) - 1, phase, elementwise(2 * bytes), ops::Accumulate{.in = flat, .out = unsharded});  // waits for the gather (wait_)
  if (ag_held_ >= 0) free(ag_held_, phase);
  ag_held_ = -1;
  if (phase == Phase::forward) ag_held_ = flat;
  else free(flat, phase);
  ag_out_[u] = -1;
  gathered_[u] = unsharded;
}

void Builder::release_unit(std::size_t u, Phase phase, bool end_of_backward) {
  if (!zero3() || gathered_[u] < 0) return;
  if (root_unit(u) && !end_of_backward) return;  // FSDP's root stays gathered (root_unit)
  // SHARD_GRAD_OP (reshard_after_forward=False) keeps every unit gathered from its forward to
  // its backward.
  if (s_.stage == Stage::fsdp_shard_grad_op && phase != Phase::backward) return;
  if (fsdp2() && ag_out_[u] >= 0) {  // gathered but never used: no copy-out was made
    ag_out_[u] = -1;
  }
  free(gathered_[u], phase);
  gathered_[u] = -1;
  gather_op_[u] = -1;
}

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
// out_dtype: the output's dtype when it is not the compute dtype (bitsandbytes' Linear4bit returns
// its input's dtype).
std::int32_t Builder::linear_forward(LinearPlan& lp, std::int32_t x, std::int32_t layer, Phase phase, Cat out_cat,
                                     Cat saved_cat, std::vector<std::int32_t>& saved, std::optional<DType> out_dtype) {
  const auto& mod = *lp.mod;
  const auto rows = static_cast<std::int64_t>(std::llround(static_cast<double>(M_) * lp.token_share));
  const std::uint64_t wbytes = storage_bytes(f_.base_dtype, mod.in * mod.out);
  const std::string base = names_ ? fmt::format("{}.mb{}", mod.path, mb_) : std::string();
  const std::int32_t y = alloc([&] { return base + ".out"; }, out_cat, bytes(out_dtype.value_or(f_.compute_dtype), rows * mod.out), phase);
  std::int32_t w = lp.weight_buf;
  std::int32_t cast = -1;
  // A weight stored in another dtype than the compute dtype is converted per GEMM into a
  // workspace copy (bitsandbytes dequantises the same way; our executor converts bf16 -> fp32).
  // The LM head is stored in the compute dtype like the embedding (frozen_bytes), so it is not.
  if (f_.base_dtype != f_.compute_dtype && !lp.trainable_weight && !mod.is_output) {
    cast = alloc([&] { return base + ".w_compute"; }, Cat::workspace, act(mod.in * mod.out), phase);
    compute("dequantize", layer, phase, elementwise(wbytes + act(mod.in * mod.out)),
            ops::Cast{.src = w, .dst = cast, .n = mod.in * mod.out, .from = f_.base_dtype, .to = f_.compute_dtype});
    w = cast;
  }
  // A 16-bit GEMM fed an fp32 input (an fp32 norm's output) casts it, and bitsandbytes'
  // Linear4bit returns out.to(x.dtype) (bitsandbytes 0.43.3 nn/modules.py Linear4bit.forward):
  // two eager casts.
  const DType od = out_dtype.value_or(f_.compute_dtype);
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
    const DType ad = lp.adapter_owns_input ? adapter_act_dtype_ : f_.compute_dtype;
    if (a.dropout > 0.0 || lp.adapter_owns_input) {  // PEFT applies dropout to the adapter input: keep the dropped copy
      xin = alloc([&] { return base + ".lora_x"; }, saved_cat, bytes(ad, rows * mod.in), phase);
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
      if (lp.adapter_owns_input && a.dropout > 0.0)
        saved.push_back(alloc([&] { return base + ".lora_mask"; }, saved_cat, static_cast<std::uint64_t>(rows * mod.in), phase));
    }
    if (a.r > 0) {
      const std::int32_t u = alloc([&] { return base + ".lora_u"; }, saved_cat, bytes(ad, rows * a.r), phase);
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
  const std::string base = names_ ? fmt::format("{}.mb{}", mod.path, mb_) : std::string();
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
    const DType ad = lp.adapter_owns_input ? adapter_act_dtype_ : f_.compute_dtype;
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
  // A projection's input is saved only when something trains on it (an adapter, or the weight
  // itself); otherwise it is workspace, freed at the end of the layer's forward.
  auto& lin = layer_linears_[static_cast<std::size_t>(l)];
  auto needs = [&](Role r) {
    return std::any_of(lin.begin(), lin.end(), [&](const LinearPlan& lp) { return lp.role == r && lp.needs_input(); });
  };
  const bool h1_needed = needs(Role::attn_in), attn_out_needed = needs(Role::attn_out);
  const bool h2_needed = needs(Role::mlp_in) || needs(Role::router), a_needed = needs(Role::mlp_out);
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
  const std::string pre = fmt::format("layers.{}.mb{}", l, mb_);
  const std::int32_t x = resid_[static_cast<std::size_t>(l)];
  const std::uint64_t stat_bytes = f32(M_) * (m_.rms_norm() ? 1 : 2);  // rstd (and mean for LayerNorm)

  // Args conventions (M = B·S rows, fp32 statistics):
  //   norm_fwd     {x [M,H], w [H], y [M,H], rstd [M]}: RMSNorm (LayerNorm: stats are mean, rstd)
  //   rope_fwd     {q [M,nh·d], k [M,nkv·d], tables}: rotates q and k in place
  //   attention_fwd {q, k, v, P [B,nh,S,S] (eager; flash: lse [B,nh,S]), out [M,nh·d]}
  //   residual_add {a, b, out}: out = a + b (out -1: nothing to write, as in a recompute)
  //   mlp_act_fwd  {gate [M,I], up [M,I], act [M,I]}: act = silu(gate) ⊙ up (GELU: {fc1, -1, act})
  LayerBufs& lb = lb_[static_cast<std::size_t>(l)];
  lb = LayerBufs{};
  // Runtime rules: an RMSNorm that computes in fp32 saves its input in fp32 (a copy unless the
  // input is fp32 already, and then the input itself), and with a trainable weight the
  // normalised input too; the norm's output dtype is the stream's.
  const bool norm_copies = rules_.norm_saves_fp32_input && m_.rms_norm();
  const bool full = in_.peft.adapters.empty();
  const DType nd = stream_dtype();
  // Returns the saved copy of the input (-1: the norm keeps the input itself).
  auto norm_saves = [&](std::string_view what, DType x_dtype) -> std::int32_t {
    if (!norm_copies) return -1;
    std::int32_t copy = -1;
    if (x_dtype != DType::fp32) save(copy = alloc([&] { return fmt::format("{}.{}.x_fp32", pre, what); }, keep, f32(M_ * H), P));
    if (full) save(alloc([&] { return fmt::format("{}.{}.normed", pre, what); }, keep, bytes(x_dtype, M_ * H), P));
    return copy;
  };
  // --- attention block ---
  const std::int32_t rstd1 = alloc([&] { return pre + ".norm1.stats"; }, keep, stat_bytes, P);
  const std::int32_t h1 = alloc([&] { return pre + ".norm1.out"; }, cat_for(h1_needed), bytes(nd, M_ * H), P);
  compute("input_norm", l, P, elementwise(norm_fwd_bytes(M_ * H, resid_dtype(l)), 4.0 * static_cast<double>(M_ * H)),
          ops::NormFwd{.x = x, .w = norm1_.empty() ? -1 : norm1_[static_cast<std::size_t>(l)], .y = h1, .rstd = rstd1, .M = M_, .H = H,
                       .eps = m_.norm_eps});
  save(rstd1);
  lb.norm1_x = norm_saves("norm1", resid_dtype(l));
  lb.rstd1 = rstd1;
  lb.h1 = h1;
  std::vector<std::int32_t> qkv;
  for (auto& lp : lin)
    if (lp.role == Role::attn_in) {
      qkv.push_back(linear_forward(lp, h1, l, P, keep, keep, kept, nd));
      flush();
    }
  keep_or_drop(h1, h1_needed);
  if (m_.rms_norm() || m_.arch == models::Arch::gpt_neox || m_.arch == models::Arch::falcon)
    compute("rope", l, P,
            elementwise(eager_or(eager::rope_fwd(1), M_ * (m_.q_width() + m_.kv_width()), nd, act(M_ * (m_.q_width() + m_.kv_width())) * 2)),
            ops::RopeFwd{{.q = qkv.empty() ? -1 : qkv[0], .k = qkv.size() > 1 ? qkv[1] : -1, .tables = rope_, .B = B, .S = S, .nh = m_.heads,
                          .nkv = m_.kv_heads, .d = m_.head_dim}});
  if (nd != f_.compute_dtype)  // the attention kernel takes (and saves) compute-dtype copies
    for (std::int32_t& b : qkv) {
      const std::int64_t n = static_cast<std::int64_t>(p_.buffers[static_cast<std::size_t>(b)].bytes / bytes_of(nd));
      const std::int32_t c = alloc([&] { return p_.buffers[static_cast<std::size_t>(b)].name + "_compute"; }, keep, act(n), P);
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
  if (t_.attention == Attention::eager) {
    probs = alloc([&] { return pre + ".attn.probs"; }, keep, act(B * nh * S * kv), P);
    aw.bytes_moved = act(B * nh * S * kv) * 3 + act(M_ * (m_.q_width() + 2 * m_.kv_width()));
    aw.flops *= eager_gemm_fraction();
    if (rules_.eager_softmax_fp32 && m_.rms_norm() && f_.compute_dtype != DType::fp32)  // the Llama family's code
      probs32 = alloc([&] { return pre + ".attn.probs_fp32"; }, keep, f32(B * nh * S * kv), P);
  } else {
    probs = alloc([&] { return pre + ".attn.lse"; }, keep, f32(B * nh * S), P);
    aw.flops /= 2.0;  // causal blocks above the diagonal are skipped
    aw.bytes_moved = act(M_ * (2 * m_.q_width() + 2 * m_.kv_width()));
  }
  const bool out_saved = attn_out_needed || rules_.attention_saves_output;
  const std::int32_t attn_out = alloc([&] { return pre + ".attn.out"; }, cat_for(out_saved), act(M_ * m_.q_width()), P);
  compute(t_.attention == Attention::eager ? "attention_eager" : "attention_flash", l, P, aw,
          ops::AttentionFwd{.q = qkv.empty() ? -1 : qkv[0], .k = qkv.size() > 1 ? qkv[1] : -1, .v = qkv.size() > 2 ? qkv[2] : -1, .probs = probs,
                            .out = attn_out, .B = B, .S = S, .nh = nh, .nkv = m_.kv_heads, .d = d});
  for (std::int32_t b : qkv) save(b);
  save(probs);
  if (probs32 >= 0) save(probs32);
  lb.probs = probs;
  lb.attn_out = attn_out;
  std::int32_t y_attn = -1;
  for (auto& lp : lin)
    if (lp.role == Role::attn_out) {
      y_attn = linear_forward(lp, attn_out, l, P, Cat::workspace, keep, kept);
      flush();
    }
  keep_or_drop(attn_out, out_saved);
  // The residual after attention: the post-attention norm's input, saved by it (or by our
  // executor's norm backward), unless the norm saves an fp32 copy instead.
  const bool x_mid_saved = !norm_copies || resid_dtype(l) == DType::fp32;
  const std::int32_t x_mid = alloc([&] { return pre + ".resid_mid"; }, x_mid_saved ? keep : Cat::workspace, bytes(resid_dtype(l), M_ * H), P);
  compute("residual", l, P, elementwise(act(M_ * H) * 3, static_cast<double>(M_ * H)), ops::ResidualAdd{.a = x, .b = y_attn, .out = x_mid, .n = M_ * H});
  free(y_attn, P);
  if (!rules_.free_at_last_use) keep_or_drop(x_mid, x_mid_saved);  // freed with the layer's transients
  lb.x_mid = x_mid;

  // --- MLP block ---
  const std::int32_t rstd2 = alloc([&] { return pre + ".norm2.stats"; }, keep, stat_bytes, P);
  const std::int32_t h2 = alloc([&] { return pre + ".norm2.out"; }, cat_for(h2_needed), bytes(nd, M_ * H), P);
  compute("post_attention_norm", l, P, elementwise(norm_fwd_bytes(M_ * H, resid_dtype(l)), 4.0 * static_cast<double>(M_ * H)),
          ops::NormFwd{.x = x_mid, .w = norm2_.empty() ? -1 : norm2_[static_cast<std::size_t>(l)], .y = h2, .rstd = rstd2, .M = M_, .H = H,
                       .eps = m_.norm_eps});
  save(rstd2);
  lb.norm2_x = norm_saves("norm2", resid_dtype(l));
  lb.rstd2 = rstd2;
  lb.h2 = h2;
  for (auto& lp : lin)
    if (lp.role == Role::router) {
      std::int32_t r = linear_forward(lp, h2, l, P, keep, keep, kept);
      flush();
      save(r);
    }
  std::vector<std::int32_t> mlp_in;
  for (auto& lp : lin)
    if (lp.role == Role::mlp_in) {
      mlp_in.push_back(linear_forward(lp, h2, l, P, keep, keep, kept, nd));
      flush();
    }
  keep_or_drop(h2, h2_needed);
  for (std::size_t i = 0; i < mlp_in.size() && i < lb.gate_up.size(); ++i) lb.gate_up[i] = mlp_in[i];
  const std::int64_t I = m_.intermediate;
  const auto rows = static_cast<std::int64_t>(M_ * (m_.is_moe() ? m_.experts_per_token : 1));
  std::int32_t silu = -1;
  if (rules_.unfused_swiglu && m_.gated_mlp())  // silu(gate), kept by the mul with up
    silu = per_expert(alloc([&] { return pre + ".mlp.silu"; }, keep, bytes(nd, rows * I), P));
  const std::int32_t a = per_expert(alloc([&] { return pre + ".mlp.act"; }, cat_for(a_needed), bytes(nd, rows * I), P));
  compute(m_.gated_mlp() ? "swiglu" : "gelu", l, P,
          elementwise(m_.gated_mlp() ? eager_or(eager::swiglu_fwd(1), rows * I, nd, act(rows * I) * 3) : act(rows * I) * 3, 6.0 * static_cast<double>(rows * I)),
          ops::MlpActFwd{.gate = mlp_in.empty() ? -1 : mlp_in[0], .up = mlp_in.size() > 1 ? mlp_in[1] : -1, .act = a, .n = rows * I});
  for (std::int32_t b : mlp_in) save(b);  // gate/up (SwiGLU) or fc1 (GELU) outputs
  if (silu >= 0) save(silu);
  std::int32_t y_mlp = -1;
  for (auto& lp : lin)
    if (lp.role == Role::mlp_out) {
      std::int32_t y = linear_forward(lp, a, l, P, Cat::workspace, keep, kept, nd);
      flush();
      if (y_mlp < 0) y_mlp = y;
      else free(y, P);  // MoE experts write into one combined output
    }
  keep_or_drop(a, a_needed);
  lb.act = a;
  // The layer output is the next layer's input: kept as an activation in every mode (a
  // checkpointed layer's input is exactly this tensor).
  std::int32_t& x_out = resid_[static_cast<std::size_t>(l) + 1];
  if (!recompute) x_out = alloc([&] { return fmt::format("layers.{}.mb{}.resid_out", l, mb_); }, Cat::activations, bytes(resid_dtype(l + 1), M_ * H), P);
  // The recomputed output is what the checkpoint's backward differentiates
  // (CheckpointFunction.backward: torch.autograd.backward(outputs, args)): live through the
  // layer's backward under a runtime that materialises it.
  if (recompute && rules_.free_at_last_use)
    saved.push_back(alloc([&] { return fmt::format("layers.{}.mb{}.resid_out.recomputed", l, mb_); }, Cat::workspace, bytes(resid_dtype(l + 1), M_ * H), P));
  compute("residual", l, P, elementwise(act(M_ * H) * 3, static_cast<double>(M_ * H)),
          ops::ResidualAdd{.a = x_mid, .b = y_mlp, .out = recompute ? -1 : x_out, .n = M_ * H});
  free(y_mlp, P);
  if (rules_.free_at_last_use) keep_or_drop(x_mid, x_mid_saved);  // after its last use, the add above
  for (std::int32_t b : transient) free(b, P);
  // Runtime rule: the layer's input lives only while something saves it. Without a checkpoint
  // only an fp32 input is (the norm saves it); otherwise the norm's fp32 copy replaced it.
  if (!recompute && !ckpt && rules_.layer_input_only_if_saved && norm_copies && resid_dtype(l) != DType::fp32) {
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
  auto& lin = layer_linears_[static_cast<std::size_t>(l)];
  auto& saved = saved_[static_cast<std::size_t>(l)];
  const LayerBufs& lb = lb_[static_cast<std::size_t>(l)];
  const std::int64_t H = m_.hidden, I = m_.intermediate, Bm = t_.micro_batch, S = M_ / t_.micro_batch;
  const std::string pre = names_ ? fmt::format("layers.{}.mb{}", l, mb_) : std::string();
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
    if (lp.role == Role::mlp_in) d_in.push_back(alloc([&] { return pre + "." + lp.mod->leaf + ".d_out"; }, Cat::workspace, act(static_cast<std::int64_t>(std::llround(static_cast<double>(M_) * lp.token_share)) * lp.mod->out), B));
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
    if (lp.role == Role::attn_in) d_qkv.push_back(alloc([&] { return pre + "." + lp.mod->leaf + ".d_out"; }, Cat::workspace, act(M_ * lp.mod->out), B));
  const std::int64_t nh = m_.heads, d = m_.head_dim, kv = kv_len_;
  sim::ComputeWork aw = gemm(S, kv, d, 0);
  aw.gemm_count = static_cast<std::int32_t>(Bm * nh);
  aw.flops = 8.0 * static_cast<double>(Bm * nh) * static_cast<double>(S) * static_cast<double>(kv) * static_cast<double>(d);
  std::int32_t dprobs = -1;
  if (t_.attention == Attention::eager) {
    dprobs = alloc([&] { return pre + ".attn.d_probs"; }, Cat::workspace, act(Bm * nh * S * kv), B);
    aw.bytes_moved = act(Bm * nh * S * kv) * 4 + act(M_ * (2 * m_.q_width() + 4 * m_.kv_width()));
    aw.flops *= eager_gemm_fraction();
  } else {
    aw.flops /= 2.0;
    aw.flops *= 1.25;  // FlashAttention-2 backward recomputes the scores (5 GEMMs instead of 4)
    aw.bytes_moved = act(M_ * (3 * m_.q_width() + 4 * m_.kv_width()));
  }
  compute(t_.attention == Attention::eager ? "attention_eager" : "attention_flash", l, B, aw,
          ops::AttentionBwd{.d_out = d_attn, .probs = lb.probs, .q = lb.qkv[0], .k = lb.qkv[1], .v = lb.qkv[2],
                            .dq = d_qkv.empty() ? -1 : d_qkv[0], .dk = d_qkv.size() > 1 ? d_qkv[1] : -1,
                            .dv = d_qkv.size() > 2 ? d_qkv[2] : -1, .scratch = dprobs, .B = Bm, .S = S, .nh = nh, .nkv = m_.kv_heads, .d = d});
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
    retained_.push_back(alloc([&] { return fmt::format("layers.{}.mb{}.input_grad.retained", l + 1, mb_); }, Cat::activations, act(M_ * H), B));
  resid_[static_cast<std::size_t>(l)] = -1;
  release_unit(unit, B);
  unit_gradients_done(unit, last);
  if (prefetch && fsdp() && s_.fsdp.backward_prefetch == FsdpPrefetch::backward_post) gather_unit(unit - 1, B, false);
}

// ZeRO-2/3 with several ranks: a bucket's full gradients live from its first unit's backward
// until its reduce_scatter. The buffer holds the bucket's flat range [flat_lo, flat_lo + numel)
// padded to a multiple of N; the adapters' gradient views point into it.
void Builder::begin_unit_gradients(std::size_t u) {
  if (!sharded_grads() || s_.ranks == 1 || bucket_of_.empty() || bucket_of_[u] < 0) return;
  const auto b = static_cast<std::size_t>(bucket_of_[u]);
  const GradBucket& bk = buckets_[b];
  if (bk.units.front() != u || bucket_buf_[b] >= 0) return;
  const std::uint64_t tw = bytes_of(f_.trainable_dtype);
  bucket_buf_[b] = alloc([&] { return fmt::format("grad.bucket{}.mb{}", b, mb_); }, Cat::gradients,
                         tw * static_cast<std::uint64_t>(bucket_shard_numel(bk) * group()), Phase::backward);
  if (bk.flat_lo < 0) return;
  auto views = [&](LinearPlan& lp) {
    if (!lp.adapter || lp.adapter->a_off < 0) return;
    Adapter& a = *lp.adapter;
    const std::string base = names_ ? fmt::format("grad.{}.mb{}", lp.mod->path, mb_) : std::string();
    a.ga_buf = role(p_.add_view(names_ ? base + ".lora_A" : std::string(), bucket_buf_[b], tw * static_cast<std::uint64_t>(a.a_off - bk.flat_lo),
                                tw * static_cast<std::uint64_t>(a.a_numel)),
                    sim::BufferRole::adapter_grad, a.a_tensor);
    a.gb_buf = role(p_.add_view(names_ ? base + ".lora_B" : std::string(), bucket_buf_[b], tw * static_cast<std::uint64_t>(a.b_off - bk.flat_lo),
                                tw * static_cast<std::uint64_t>(a.b_numel)),
                    sim::BufferRole::adapter_grad, a.b_tensor);
  };
  for (std::size_t v : bk.units) {
    if (v == units_.size() - 1) for (auto& lp : head_linears_) views(lp);
    else if (v >= 1) for (auto& lp : layer_linears_[v - 1]) views(lp);
  }
}

// A unit's gradients are complete for this micro-batch: bucket them for reduction.
void Builder::unit_gradients_done(std::size_t u, std::int32_t after_op) {
  const Unit& un = units_[u];
  const std::uint64_t tw = bytes_of(f_.trainable_dtype);
  const bool last_mb = mb_ == p_.micro_batches - 1;
  if (un.trainable_numel == 0 && u != 0) return;
  if (s_.ranks == 1) return;
  if (zero3() || s_.stage == Stage::zero2) {
    // DeepSpeed reduces during every micro-batch's backward for ZeRO-2/3: each bucket is
    // reduce-scattered into this rank's gradient partition, adding to the earlier micro-batches'.
    const std::int32_t b = flush_of_[u];
    if (b < 0) return;
    const GradBucket& bk = buckets_[static_cast<std::size_t>(b)];
    const std::int64_t padded = bucket_shard_numel(bk) * group();
    std::int32_t payload = bucket_buf_[static_cast<std::size_t>(b)];
    if (fsdp2()) {
      // FSDP2's foreach_reduce (_fsdp_collectives.py): the unsharded gradients are copied into
      // one padded reduce-scatter input (_chunk_cat, on the default stream) and freed; that input
      // is held in comm_ctx.reduce_scatter_state until the next unit's post-backward (the root's
      // final callback drops the last).
      const std::int32_t rs_in = alloc([&] { return fmt::format("grad.reduce_scatter_input{}.mb{}", b, mb_); }, Cat::comm_buffers,
                                       tw * static_cast<std::uint64_t>(padded), Phase::backward);
      after_op = compute("fsdp_chunk_cat", -1, Phase::backward, elementwise(2 * tw * static_cast<std::uint64_t>(padded)),
                         ops::Accumulate{.in = payload, .out = rs_in}, {after_op});
      free(payload, Phase::backward);
      bucket_buf_[static_cast<std::size_t>(b)] = -1;
      if (rs_held_ >= 0) free(rs_held_, Phase::backward);
      rs_held_ = payload = rs_in;
    }
    std::int32_t rs = collective(Collective::reduce_scatter, "reduce_scatter_grads", tw * static_cast<std::uint64_t>(padded), -1,
                                 Phase::backward, payload, {after_op});
    p_.ops[static_cast<std::size_t>(rs)].group_size = group();
    if (group() < s_.ranks) {  // HYBRID_SHARD: the shard is then all-reduced across the groups
      rs = collective(Collective::all_reduce, "all_reduce_grads", tw * static_cast<std::uint64_t>(bucket_shard_numel(bk)), -1, Phase::backward, -1, {rs});
      p_.ops[static_cast<std::size_t>(rs)].group_size = s_.ranks / group();
      p_.ops[static_cast<std::size_t>(rs)].group_stride = group();  // one member per node
    }
    p_.ops[static_cast<std::size_t>(rs)].buffer_out = exec_z3() ? un.grad_shard_view : exec_z2() ? bk.grad_view : grad_shard_;
    p_.ops[static_cast<std::size_t>(rs)].accumulate = mb_ > 0;
    reduce_ops_.push_back(rs);
    free(bucket_buf_[static_cast<std::size_t>(b)], Phase::backward);  // FSDP2: freed at the copy-in
    bucket_buf_[static_cast<std::size_t>(b)] = -1;
    return;
  }
  if ((s_.stage == Stage::ddp || s_.stage == Stage::fsdp_no_shard) && last_mb) {
    // DDP (no_sync on all but the last micro-batch): bucketed all_reduce in place.
    if (un.trainable_numel > 0) {
      bucket_units_.push_back(u);
      bucket_numel_ += un.trainable_numel;
    }
    const std::int64_t cap = in_.profile == RuntimeProfile::hf
                                 ? static_cast<std::int64_t>((25ull << 20) / tw)  // bucket_cap_mb = 25
                                 : s_.ds.reduce_bucket_size;
    // FSDP NO_SHARD all-reduces each unit in its post-backward hook.
    const bool flush = bucket_numel_ >= cap || u == 0 || s_.stage == Stage::fsdp_no_shard;
    if (!flush || bucket_numel_ == 0) return;
    // The bucket is a contiguous range of grad.flat (units in backward order are consecutive
    // ranges of the flat layout): its view is the payload.
    std::int32_t payload = grad_flat_;
    const std::int64_t lo = units_[bucket_units_.back()].flat_offset;
    if (lo >= 0 && units_[bucket_units_.front()].flat_offset + units_[bucket_units_.front()].trainable_numel - lo == bucket_numel_)
      payload = p_.add_view(names_ ? fmt::format("grad.flat[{}:{}]", lo, lo + bucket_numel_) : std::string(), grad_flat_,
                            tw * static_cast<std::uint64_t>(lo), tw * static_cast<std::uint64_t>(bucket_numel_));
    reduce_ops_.push_back(collective(Collective::all_reduce, "all_reduce_grads", tw * static_cast<std::uint64_t>(bucket_numel_), -1,
                                     Phase::backward, payload, {after_op}));
    bucket_units_.clear();
    bucket_numel_ = 0;
  }
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
  const std::string pre = names_ ? fmt::format("loss.mb{}", mb_) : std::string();
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
  const std::string pre = names_ ? fmt::format("loss.mb{}", mb_) : std::string();
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
  const std::int32_t tokens = alloc([&] { return fmt::format("tokens.mb{}", mb); }, Cat::workspace, rules_.batch_bytes_per_token * static_cast<std::uint64_t>(M_), F);
  gather_unit(0, F, true);
  if (fsdp()) gather_unit(units_.size() - 1, F, true);  // the root unit: embedding and head
  else gather_unit(1, F, false);
  resid_[0] = alloc([&] { return fmt::format("embed.mb{}.out", mb); }, Cat::activations, act(M_ * H), F);
  compute("embedding", -1, F, elementwise(act(M_ * H) * 2), ops::EmbeddingFwd{.tokens = tokens, .table = embed_buf_, .out = resid_[0], .M = M_, .V = V, .H = H});
  const bool embed_trains = units_[0].trainable_numel > 0 && in_.peft.adapters.empty();
  release_unit(0, F);
  // Runtime rule: autocast keeps a compute-dtype copy of every fp32 adapter weight it casts
  // until the forward's autocast region closes (the end of the loss).
  std::int32_t autocast_cache = -1;
  // (Under FSDP's MixedPrecision the adapters compute from gathered compute-dtype copies: no cache.)
  if (rules_.autocast_weight_cache && !fsdp() && !in_.peft.adapters.empty() && f_.trainable_dtype != f_.compute_dtype)
    autocast_cache = alloc([&] { return fmt::format("autocast.weight_cache.mb{}", mb); }, Cat::workspace, act(trainable_numel_ - extra_trainable_numel_), F);
  for (std::int32_t l = 0; l < static_cast<std::int32_t>(m_.layers); ++l) layer_forward(l, false);
  // Head: final norm, LM head, cross-entropy (logits upcast to fp32 as transformers' loss does).
  // ZeRO-3 gathers the head for its forward and again for its backward (a tied head is the
  // embedding, so that unit is gathered with it).
  const std::size_t head = units_.size() - 1;
  const bool tied = m_.tie_embeddings;
  gather_unit(head, F, true);
  if (tied) gather_unit(0, F, true);
  if (ag_held_ >= 0) {  // FSDP2: the root's post-forward drops the last all-gather state
    free(ag_held_, F);
    ag_held_ = -1;
  }
  std::int32_t xl = resid_.back();
  const std::int32_t rstd = alloc([&] { return fmt::format("final_norm.mb{}.stats", mb); }, Cat::activations, f32(M_) * (m_.rms_norm() ? 1 : 2), F);
  const std::int32_t hf = alloc([&] { return fmt::format("final_norm.mb{}.out", mb); }, Cat::workspace, bytes(stream_dtype(), M_ * H), F);
  compute("final_norm", -1, F, elementwise(norm_fwd_bytes(M_ * H, resid_dtype(m_.layers)), 4.0 * static_cast<double>(M_ * H)),
          ops::NormFwd{.x = xl, .w = final_norm_, .y = hf, .rstd = rstd, .M = M_, .H = H, .eps = m_.norm_eps});
  std::vector<std::int32_t> head_saved;
  bool hf_freed = false;
  // The final norm under the runtime rule of the layers' norms: an fp32 copy of a
  // compute-dtype input replaces the input (and the normalised input when the weight trains).
  if (rules_.norm_saves_fp32_input && m_.rms_norm()) {
    const DType xd = resid_dtype(m_.layers);
    if (xd != DType::fp32) {
      head_saved.push_back(alloc([&] { return fmt::format("final_norm.mb{}.x_fp32", mb); }, Cat::activations, f32(M_ * H), F));
      if (rules_.layer_input_only_if_saved) {
        free(xl, F);
        resid_.back() = xl = -1;
      }
    }
    if (in_.peft.adapters.empty())
      head_saved.push_back(alloc([&] { return fmt::format("final_norm.mb{}.normed", mb); }, Cat::activations, bytes(xd, M_ * H), F));
  }
  if (eval_) {  // no_grad: the norm's copies and statistics die with it, and so does its input
    for (std::int32_t b : head_saved) free(b, F);
    head_saved.clear();
    free(rstd, F);
    if (xl >= 0) free(xl, F);
    resid_.back() = -1;
  }
  LinearPlan* lm = nullptr;
  for (auto& lp : head_linears_)
    if (lp.mod->is_output) lm = &lp;
  PEFTPLAN_CHECK(lm != nullptr);
  if (lm->weight_buf < 0) lm->weight_buf = embed_buf_;  // tied head
  const bool fused = t_.cross_entropy == CrossEntropy::chunked;
  std::int32_t logits = -1, grad_in = -1;
  if (fused) grad_in = fused_loss(*lm, hf, tokens);
  else logits = linear_forward(*lm, hf, -1, Phase::loss, Cat::workspace, Cat::activations, head_saved);
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
      logits32 = alloc([&] { return fmt::format("logits_fp32.mb{}", mb); }, Cat::workspace, f32(M_ * V), Phase::loss);
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
      dlogits = alloc([&] { return fmt::format("d_logits.mb{}", mb); }, Cat::workspace, act(M_ * V), B);
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
    d_hf = alloc([&] { return fmt::format("final_norm.mb{}.d_out", mb); }, Cat::workspace, act(M_ * H), B);
    last = linear_backward(*lm, dlogits, d_hf, hf_needed ? hf : -1, -1, true);
  }
  free(dlogits, B);
  if (!hf_freed) free(hf, B);
  for (std::int32_t b : head_saved) free(b, B);
  dres_ = alloc([&] { return fmt::format("d_resid.mb{}", mb); }, Cat::workspace, act(M_ * H), B);
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

void Builder::optimizer_step() {
  mb_ = -1;
  const Phase O = Phase::optimizer;
  const std::uint64_t tw = bytes_of(f_.trainable_dtype);
  const std::int64_t part = exec_z3() || exec_z2() ? part_numel_ : sharded_optimizer() ? trainable_shard_total() : trainable_numel_;
  const std::int32_t N = s_.ranks;
  const std::int32_t params = exec_z3() ? trainable_shard_ : trainable_flat_;
  const bool exec = in_.profile == RuntimeProfile::executor;
  std::vector<std::int32_t> deps(reduce_ops_.begin(), reduce_ops_.end());
  std::int32_t dep = deps.empty() ? last_compute_ : deps.back();
  // The executor reports the step's loss on every rank: the loss sums of the ranks (one fp64)
  // are all-reduced, a collective of the program like any other.
  if (exec && N > 1) {
    dep = collective(Collective::all_reduce, "loss", 8, -1, O, -1, {dep});
    p_.ops[static_cast<std::size_t>(dep)].reduction = sim::ScalarReduction::loss_sum;
  }
  // ZeRO-1: one reduce_scatter of the accumulated full gradients at the step, into this rank's
  // partition.
  if (s_.stage == Stage::zero1 && N > 1) {
    const std::int32_t shard_buf = state_buffer(sim::BufferRole::grad_shard, Cat::gradients, tw * static_cast<std::uint64_t>(part), O);
    dep = collective(Collective::reduce_scatter, "reduce_scatter_grads", tw * static_cast<std::uint64_t>(part * N), -1, O, grad_flat_, {dep});
    p_.ops[static_cast<std::size_t>(dep)].buffer_out = shard_buf;
    grad_shard_ = shard_buf;
  }
  // Mixed precision: the optimizer works on an fp32 copy of this rank's gradient partition.
  std::int32_t g32 = -1;
  const bool host_opt = host_optimizer();
  if (f_.master_weights) g32 = alloc([&] { return "grad.fp32"; }, host_opt ? Cat::host_optimizer_states : Cat::gradients, f32(part), O);
  if (t_.grad_clip > 0.0 || exec) {  // the executor reports the norm even without clipping
    // grad_norm {grads}: sum of squares of this rank's gradient partition (all of it for DDP);
    // the partitions' sums are all-reduced as one fp64 (buffer -1)
    dep = compute("grad_norm", -1, O, elementwise(tw * static_cast<std::uint64_t>(part), 2.0 * static_cast<double>(part)),
                  ops::GradNorm{.grads = grad_shard_ >= 0 ? grad_shard_ : grad_flat_}, {dep});
    if (N > 1 && s_.stage != Stage::ddp) {
      dep = collective(Collective::all_reduce, "grad_norm", 8, -1, O, -1, {dep});
      p_.ops[static_cast<std::size_t>(dep)].reduction = sim::ScalarReduction::grad_sumsq;
    }
  }
  if (host_opt) {
    // Copies name their source (Op::buffer) and, in the executor profile, their destination
    // (Op::buffer_out); a destination N times the copy's bytes receives this rank's block.
    // The gradient partition, or the whole gradients when nothing is sharded (one rank).
    const std::int32_t grads = grad_shard_ >= 0 ? grad_shard_ : grad_flat_;
    const std::int32_t d2h = copy(CopyDir::device_to_host, "grad_d2h", tw * static_cast<std::uint64_t>(part), O, grads, {dep});
    if (exec) p_.ops[static_cast<std::size_t>(d2h)].buffer_out = staging_;
    const double state_rw = (f_.master_weights ? 4.0 : 0.0) + 8.0 + 4.0;
    sim::ComputeWork w = elementwise(static_cast<std::uint64_t>(state_rw * 2.0 * static_cast<double>(part)), 10.0 * static_cast<double>(part));
    w.params = part;
    // cpu_adam (executor) {host params, host.staging (the gradients), states}: as optimizer_step
    if (exec)
      dep = compute("cpu_adam", -1, O, w, ops::OptimizerStep{.params = host_params_, .grads = staging_, .states = opt_states_, .n = part}, {d2h},
                    Stream::host);
    else
      dep = compute("cpu_adam", -1, O, w, ops::OptimizerStep{.n = part}, {d2h}, Stream::host);
    if (exec_z2()) {  // bucket by bucket: this rank's block of each bucket's region
      const std::int32_t step = dep;
      for (const GradBucket& bk : buckets_) {
        dep = copy(CopyDir::host_to_device, "param_h2d", tw * static_cast<std::uint64_t>(shard(bk.numel)), O, bk.host_view, {step});
        p_.ops[static_cast<std::size_t>(dep)].buffer_out = bk.param_view;
      }
    } else {
      dep = copy(CopyDir::host_to_device, "param_h2d", tw * static_cast<std::uint64_t>(part), O, exec ? host_params_ : trainable_flat_, {dep});
      if (exec) p_.ops[static_cast<std::size_t>(dep)].buffer_out = params;
    }
  } else {
    const double state_rw = (f_.master_weights ? 4.0 : 0.0) + 8.0 + 2.0 * static_cast<double>(tw);
    sim::ComputeWork w = elementwise(static_cast<std::uint64_t>(state_rw * 2.0 * static_cast<double>(part)), 10.0 * static_cast<double>(part));
    w.params = part;
    // optimizer_step {params, grads, states}: AdamW over this rank's partition; states holds m
    // then v (SGD: the momentum buffer), each as many elements as the gradients; params N times
    // the gradients' size (ZeRO-1/2: trainable.flat) means this rank's block of them
    if (exec_z2()) {  // AdamW is elementwise: bucket by bucket over the same partition
      const std::int32_t before = dep;
      for (const GradBucket& bk : buckets_) {
        const std::int64_t sb = shard(bk.numel);
        sim::ComputeWork wb = elementwise(static_cast<std::uint64_t>(state_rw * 2.0 * static_cast<double>(sb)), 10.0 * static_cast<double>(sb));
        wb.params = sb;
        dep = compute("adamw", -1, O, wb, ops::OptimizerStep{.params = bk.param_view, .grads = bk.grad_view, .states = bk.state_view, .n = sb}, {before});
      }
    } else {
      // Runtime rule: torch's foreach AdamW holds sqrt(v) for the whole partition while it
      // steps (one state-sized temporary).
      std::int32_t sqrt_v = -1;
      if (rules_.foreach_step_temp && t_.optimizer == Optimizer::adamw)
        sqrt_v = alloc([&] { return "adamw.exp_avg_sq_sqrt"; }, Cat::workspace,
                       (rules_.states_follow_params ? tw : 4) * static_cast<std::uint64_t>(part), O);
      if (rules_.states_follow_params) per_tensor(sqrt_v, tw, 1);
      // Operands: parameters, gradients, states, and the foreach temporary when there is one.
      dep = compute("adamw", -1, O, w,
                    ops::OptimizerStep{.params = params, .grads = grad_shard_ >= 0 ? grad_shard_ : grad_flat_, .states = opt_states_, .sqrt_v = sqrt_v,
                                       .n = part},
                    {dep});
      free(sqrt_v, O);
    }
  }
  free(g32, O);
  // zero_grad(set_to_none=True) after the step.
  for (std::int32_t g : lazy_grads_) free(g, O);
  // ZeRO-1/2: every rank needs the whole updated adapter again (in place: rank r's block of
  // trainable.flat is its contribution).
  if (exec_z2()) {  // each bucket's region, in place
    for (const GradBucket& bk : buckets_)
      collective(Collective::all_gather, "all_gather_params", tw * static_cast<std::uint64_t>(shard(bk.numel) * N), -1, O, bk.param_view, {dep});
  } else if ((s_.stage == Stage::zero1 || s_.stage == Stage::zero2) && N > 1)
    collective(Collective::all_gather, "all_gather_params", tw * static_cast<std::uint64_t>(part * N), -1, O, trainable_flat_, {dep});
  if (s_.stage == Stage::zero1 && N > 1) {
    free(grad_shard_, O);
    grad_shard_ = -1;
  }
}

// Adapter weights are views into trainable.flat, laid out in the order of the trainable
// inventory (models::trainable_tensors: per module lora_A then lora_B); their gradients are views
// at the same offsets in grad.flat. Under ZeRO-3 they live in the gathered unit instead (-1).
// Every strategy records each adapter tensor's flat offset and each unit's first element, which
// place gradient buckets (DDP views of grad.flat, ZeRO-2/3 bucket buffers).
void Builder::adapter_views() {
  if (in_.peft.adapters.empty()) return;
  const std::uint64_t tw = bytes_of(f_.trainable_dtype);
  std::int64_t offset = 0;
  std::vector<std::int64_t> unit_lo(units_.size(), -1), unit_seen(units_.size(), 0);
  bool contiguous = extra_trainable_numel_ == 0;
  std::int32_t index = -1;
  for (const auto& t : inv_->trainables) {
    ++index;
    const std::int64_t numel = t.numel();
    const std::uint64_t bytes = tw * static_cast<std::uint64_t>(numel);
    const bool is_a = t.name.find(".lora_A") != std::string::npos, is_b = t.name.find(".lora_B") != std::string::npos;
    auto it = by_path_.find(std::string_view(t.module));
    if ((is_a || is_b) && it != by_path_.end() && it->second->adapter) {
      Adapter& a = *it->second->adapter;
      const std::size_t u = it->second->mod->layer >= 0 ? static_cast<std::size_t>(it->second->mod->layer) + 1 : units_.size() - 1;
      if (unit_lo[u] < 0) unit_lo[u] = offset;
      else if (unit_lo[u] + unit_seen[u] != offset) contiguous = false;
      unit_seen[u] += numel;
      std::int64_t& off = is_a ? a.a_off : a.b_off;
      if (off < 0) {  // several adapters on one module: the first one's tensors
        off = offset;
        (is_a ? a.a_numel : a.b_numel) = numel;
        (is_a ? a.a_tensor : a.b_tensor) = index;
        if (!zero3() && trainable_flat_ >= 0) {
          (is_a ? a.a_buf : a.b_buf) = role(p_.add_view(names_ ? t.name : std::string(), trainable_flat_, tw * static_cast<std::uint64_t>(flat_position(offset)), bytes),
                                            sim::BufferRole::adapter_tensor, index);
          if (grad_flat_ >= 0)
            (is_a ? a.ga_buf : a.gb_buf) = role(p_.add_view(names_ ? "grad." + t.name : std::string(), grad_flat_, tw * static_cast<std::uint64_t>(offset), bytes),
                                                sim::BufferRole::adapter_grad, index);
        }
      } else {
        contiguous = false;
      }
    } else {
      contiguous = false;
    }
    offset += numel;
  }
  for (std::size_t u = 0; u < units_.size(); ++u)
    if (contiguous && unit_seen[u] == units_[u].trainable_numel) units_[u].flat_offset = unit_lo[u];
}

// ZeRO-2/3 buckets, in the order backward completes units (head, layers L-1 … 0, embedding): a
// bucket closes when it reaches reduce_bucket_size elements, and at the embedding.
void Builder::plan_buckets() {
  bucket_of_.assign(units_.size(), -1);
  flush_of_.assign(units_.size(), -1);
  if (!sharded_grads() || s_.ranks == 1) return;
  std::vector<std::size_t> order = {units_.size() - 1};
  for (std::size_t u = units_.size() - 2; u >= 1; --u) order.push_back(u);
  order.push_back(0);
  if (fsdp()) {
    // FSDP reduce-scatters each unit in its post-backward hook; the root unit (the head and the
    // embedding) after the embedding's backward (_runtime_utils.py _post_backward_hook).
    GradBucket root;
    for (std::size_t u : order) {
      if (units_[u].trainable_numel == 0) continue;
      if (root_unit(u)) {
        root.units.push_back(u);
        root.numel += units_[u].trainable_numel;
        continue;
      }
      GradBucket b;
      b.units = {u};
      b.numel = units_[u].trainable_numel;
      b.flush_unit = u;
      buckets_.push_back(std::move(b));
    }
    if (root.numel > 0) {
      root.flush_unit = 0;
      buckets_.push_back(std::move(root));
    }
    order.clear();
  }
  GradBucket cur;
  for (std::size_t u : order) {
    if (units_[u].trainable_numel > 0) {
      cur.units.push_back(u);
      cur.numel += units_[u].trainable_numel;
    }
    // The executor's ZeRO-3 reduce-scatters each unit on its own: its partition is per unit
    // (setup), which a bucket of several units would not deliver as one contiguous block.
    if (cur.numel > 0 && (cur.numel >= s_.ds.reduce_bucket_size || u == 0 || exec_z3())) {
      cur.flush_unit = u;
      buckets_.push_back(std::move(cur));
      cur = GradBucket{};
    }
  }
  for (std::size_t b = 0; b < buckets_.size(); ++b) {
    GradBucket& bk = buckets_[b];
    for (std::size_t u : bk.units) bucket_of_[u] = static_cast<std::int32_t>(b);
    flush_of_[bk.flush_unit] = static_cast<std::int32_t>(b);
  }
  bucket_buf_.assign(buckets_.size(), -1);
  if (!exec_z2()) return;
  // The executor's ZeRO-2 layout (DeepSpeed's stage 1/2 partitions each bucket the same way):
  // trainable.flat holds every bucket's flat range padded to a multiple of N, one region per
  // bucket in flat order (the units' adapters are consecutive ranges of the flat layout, unit
  // by unit: the embedding, the layers, the head); rank r's partition is block r of every
  // region, bucket after bucket in backward order. Bucket b's reduce_scatter then delivers a
  // contiguous block of the partition (its grad.shard view), the optimizer steps each bucket's
  // block, and one in-place all_gather per region rebuilds the whole adapter.
  std::vector<std::int64_t> unit_lo(units_.size(), 0);
  for (std::size_t u = 1; u < units_.size(); ++u) unit_lo[u] = unit_lo[u - 1] + units_[u - 1].trainable_numel;
  for (GradBucket& bk : buckets_) {
    bk.part_offset = part_numel_;
    part_numel_ += shard(bk.numel);
    bk.flat_lo = unit_lo[bk.units.back()];
  }
  std::int64_t region = 0;
  for (std::size_t b = buckets_.size(); b-- > 0;) {
    buckets_[b].region = region;
    region += shard(buckets_[b].numel) * s_.ranks;
  }
}

// Where flat element x lives in trainable.flat: itself, or (executor ZeRO-2) in its bucket's
// region.
std::int64_t Builder::flat_position(std::int64_t x) const {
  if (!exec_z2()) return x;
  for (const GradBucket& bk : buckets_)
    if (x >= bk.flat_lo && x < bk.flat_lo + bk.numel) return bk.region + (x - bk.flat_lo);
  PEFTPLAN_CHECK_MSG(false, "flat element {} is in no gradient bucket", x);
  return x;
}

// Each bucket's first flat element, once adapter_views knows the units' flat offsets.
void Builder::bucket_ranges() {
  for (std::size_t b = 0; b < buckets_.size(); ++b) {
    GradBucket& bk = buckets_[b];
    const std::int64_t lo = units_[bk.units.back()].flat_offset;
    const std::size_t hi = bk.units.front();
    const std::int64_t want = bk.flat_lo;
    bk.flat_lo = -1;
    if (lo >= 0 && units_[hi].flat_offset >= 0 && units_[hi].flat_offset + units_[hi].trainable_numel - lo == bk.numel) bk.flat_lo = lo;
    if (exec_z2()) PEFTPLAN_CHECK_MSG(bk.flat_lo == want, "the adapter's flat layout is not unit by unit (bucket {})", b);
  }
}

BuiltProgram Builder::build() {
  facts();
  plan_linears();
  p_.ranks = s_.ranks;
  p_.micro_batches = static_cast<std::int32_t>(t_.grad_accum);
  p_.executable = in_.profile == RuntimeProfile::executor && executor_limitation(in_).empty();
  p_.tokens_per_step = t_.micro_batch * t_.seq_len * t_.grad_accum;
  // Reserve for the whole program at once: growing vectors of ~10^4 ops dominated build time.
  const auto per_mb = static_cast<std::size_t>(m_.layers) * (zero3() ? 200 : 160) + 64;
  p_.ops.reserve(per_mb * static_cast<std::size_t>(t_.grad_accum) + tensors_->size() + 64);
  p_.buffers.reserve(per_mb / 2 * static_cast<std::size_t>(t_.grad_accum) + tensors_->size() + 64);
  p_.deps.reserve(per_mb * static_cast<std::size_t>(t_.grad_accum) / 2);
  p_.operands.reserve(per_mb * static_cast<std::size_t>(t_.grad_accum) * 5);  // about half the ops compute, ~10 values each
  gathered_.assign(units_.size(), -1);
  gather_op_.assign(units_.size(), -1);
  ag_out_.assign(units_.size(), -1);
  plan_buckets();
  setup();
  adapter_views();
  bucket_ranges();
  if (exec_z3() && s_.ranks == 1) {  // one rank: the gradients are the partition itself
    const std::uint64_t tw = bytes_of(f_.trainable_dtype);
    for (std::size_t u = 1; u < units_.size(); ++u) {
      const Unit& un = units_[u];
      if (un.flat_offset < 0) continue;
      auto views = [&](LinearPlan& lp) {
        if (!lp.adapter || lp.adapter->a_off < 0) return;
        Adapter& a = *lp.adapter;
        a.ga_buf = role(p_.add_view(std::string(), grad_shard_, tw * static_cast<std::uint64_t>(un.part_offset + a.a_off - un.flat_offset),
                                    tw * static_cast<std::uint64_t>(a.a_numel)),
                        sim::BufferRole::adapter_grad, a.a_tensor);
        a.gb_buf = role(p_.add_view(std::string(), grad_shard_, tw * static_cast<std::uint64_t>(un.part_offset + a.b_off - un.flat_offset),
                                    tw * static_cast<std::uint64_t>(a.b_numel)),
                        sim::BufferRole::adapter_grad, a.b_tensor);
      };
      if (u == units_.size() - 1) for (auto& lp : head_linears_) views(lp);
      else for (auto& lp : layer_linears_[u - 1]) views(lp);
    }
  }
  // RoPE cos/sin tables [S, d/2] each, built once per step and read by every layer (rope_tables
  // {tables}: cos then sin).
  const bool rope = m_.rms_norm() || m_.arch == models::Arch::gpt_neox || m_.arch == models::Arch::falcon;
  if (rope) {
    const std::int64_t per_pos = rules_.rope_table_elems_per_pos > 0 ? static_cast<std::int64_t>(rules_.rope_table_elems_per_pos) * m_.head_dim
                                                                      : (m_.head_dim / 2) * 2;
    rope_ = alloc([&] { return "rope.tables"; }, Cat::workspace, act(kv_len_ * per_pos), Phase::forward);
    compute("rope_tables", -1, Phase::forward, elementwise(act(kv_len_ * (m_.head_dim / 2) * 2)),
            ops::RopeTables{.tables = rope_, .S = kv_len_, .d = m_.head_dim, .theta = m_.rope_theta});
  }
  for (std::int32_t mb = 0; mb < p_.micro_batches; ++mb) micro_batch(mb);
  mb_ = -1;
  if (eval_) return BuiltProgram{std::move(p_), f_};
  free(rope_, Phase::backward);
  rope_ = -1;
  optimizer_step();
  return BuiltProgram{std::move(p_), f_};
}

}  // namespace

DType frozen_storage_dtype(const models::TensorInfo& t, DType base, DType compute) {
  return t.role == models::ParamRole::linear_weight ? base : compute;
}

ModelInventory make_inventory(const models::ModelSpec& model, const models::PeftSpec& peft) {
  ModelInventory inv;
  inv.tensors = models::parameter_tensors(model);
  inv.linears = models::linear_modules(model, inv.tensors);
  if (!peft.adapters.empty()) {
    inv.trainables = models::trainable_tensors(model, peft, inv.tensors, inv.linears);
    inv.loras = models::lora_modules(model, peft, inv.linears);
  }
  return inv;
}

std::string_view name_of(RuntimeProfile p) {
  switch (p) {
    case RuntimeProfile::executor: return "executor";
    case RuntimeProfile::deepspeed: return "deepspeed";
    case RuntimeProfile::hf: return "hf";
  }
  return "?";
}

std::vector<std::string> validate(const PlanInput& in) {
  std::vector<std::string> warnings;
  const auto& t = in.training;
  const auto& s = in.strategy;
  auto positive = [](std::int64_t v, const char* flag) {
    if (v <= 0) throw input_error(flag, "", "must be a positive integer", std::to_string(v));
  };
  positive(t.micro_batch, "--micro-batch");
  positive(t.seq_len, "--seq-len");
  positive(t.grad_accum, "--grad-accum");
  positive(s.ranks, "--gpus");
  positive(t.checkpoint_every, "--checkpoint-every");
  if (is_fsdp(s.stage) && in.profile != RuntimeProfile::hf)
    throw InputError(fmt::format("--strategy {}: FSDP is planned with --profile hf (transformers + PEFT under torch FSDP "
                                 "through accelerate), got --profile {}", name_of(s.stage), name_of(in.profile)));
  if (is_fsdp(s.stage) && s.offload_optimizer == OffloadDevice::cpu)
    throw InputError(fmt::format("--offload-optimizer cpu: FSDP has no optimizer-only offload; --offload-param cpu is FSDP's "
                                 "CPUOffload (fsdp_offload_params: parameters, gradients and the optimizer step on the host), got "
                                 "--strategy {}", name_of(s.stage)));
  if (s.offload_param == OffloadDevice::cpu && !can_offload_params(s.stage))
    throw InputError("--offload-param cpu: parameter offload needs sharded parameters (--strategy zero3, fsdp-full-shard, "
                     "fsdp-shard-grad-op or fsdp-hybrid-shard), got --strategy " + std::string(name_of(s.stage)));
  if (is_fsdp(s.stage) && s.fsdp.version == 2 && s.stage != Stage::fsdp_full_shard && s.stage != Stage::fsdp_shard_grad_op)
    throw InputError(fmt::format("--fsdp-version 2 with --strategy {}: FSDP2's fully_shard plans fsdp-full-shard "
                                 "(reshard_after_forward true) and fsdp-shard-grad-op (false)", name_of(s.stage)));
  if (s.stage == Stage::fsdp_hybrid_shard && s.shard_group > 0 && s.ranks % s.shard_group != 0)
    throw InputError(fmt::format("--strategy fsdp-hybrid-shard: {} ranks do not divide into shard groups of {} (the GPUs per node)",
                                 s.ranks, s.shard_group));
  if (s.offload_optimizer == OffloadDevice::cpu && s.stage == Stage::ddp)  // FSDP's case is refused above
    throw InputError("--offload-optimizer cpu: optimizer offload needs a ZeRO stage (zero1, zero2 or zero3), got ddp");
  if (in.model.sliding_window && *in.model.sliding_window < t.seq_len)
    warnings.push_back(fmt::format("sliding_window {} < --seq-len {}: attention is planned over the full sequence",
                                   *in.model.sliding_window, t.seq_len));
  if (t.cross_entropy == CrossEntropy::chunked) {
    // The fused loss computes the head's weight gradient in its forward, outside the plan's
    // gradient buffers: not planned yet.
    const auto inv = make_inventory(in.model, in.peft);
    const bool head_trains = in.peft.adapters.empty() ||
                             std::any_of(inv.loras.begin(), inv.loras.end(), [](const models::LoraModule& l) { return l.linear.is_output; });
    if (head_trains)
      throw InputError("--cross-entropy chunked with a trainable LM head (full fine-tuning, or an adapter on lm_head) is not planned; "
                       "use --cross-entropy standard");
  }
  if (is_zero_stage(s.stage) && in.profile == RuntimeProfile::hf)
    throw InputError(fmt::format("--strategy {} is DeepSpeed's ZeRO: plan it with --profile deepspeed (the same transformers + PEFT "
                                 "model side under DeepSpeed's engine); --profile hf plans ddp and the FSDP strategies",
                                 name_of(s.stage)));
  if (in.profile == RuntimeProfile::executor && t.cross_entropy == CrossEntropy::chunked)
    throw InputError("--cross-entropy chunked: our executor computes the standard loss; plan it with --profile hf or deepspeed");
  if (in.profile == RuntimeProfile::executor && t.precision != Precision::fp32)
    warnings.push_back("the executor profile computes in fp32: --precision is ignored for activations and adapters");
  if (t.seq_len > in.model.max_positions && in.model.max_positions > 0)
    warnings.push_back(fmt::format("--seq-len {} exceeds max_position_embeddings {}", t.seq_len, in.model.max_positions));
  return warnings;
}

std::string executor_limitation(const PlanInput& in) {
  if (in.profile != RuntimeProfile::executor)
    return fmt::format("profile is {}; plans for the executor use the executor profile", name_of(in.profile));
  const auto arch = in.model.arch;
  if (arch != models::Arch::llama && arch != models::Arch::mistral && arch != models::Arch::qwen2)
    return fmt::format("model_type {} (supported: llama, mistral, qwen2)", models::name_of(arch));
  if (in.model.is_moe()) return "mixture-of-experts models";
  if (in.model.sliding_window && *in.model.sliding_window < in.training.seq_len)
    return fmt::format("sliding_window {} < seq_len {} (the executor attends over the whole sequence)", *in.model.sliding_window,
                       in.training.seq_len);
  if (in.model.out_bias || in.model.mlp_bias) return "bias on o_proj or the MLP";
  const auto& st = in.strategy;
  if (st.offload_param != OffloadDevice::none && !can_offload_params(st.stage)) return "parameter offload without ZeRO-3 (it needs --strategy zero3)";
  if (st.offload_optimizer != OffloadDevice::none && !can_offload_optimizer(st.stage)) return "optimizer offload with ddp (it needs a ZeRO stage)";
  if (is_fsdp(st.stage)) return fmt::format("strategy {} (supported: ddp, zero1, zero2, zero3)", name_of(st.stage));
  const auto& t = in.training;
  if (t.attention != Attention::eager) return "flash attention (use eager)";
  if (t.optimizer != Optimizer::adamw) return fmt::format("optimizer {} (supported: adamw)", name_of(t.optimizer));
  if (t.full_finetune || in.peft.adapters.empty()) return "full fine-tuning (LoRA only)";
  if (in.peft.quantization) return "quantised base weights";
  if (t.base_storage && *t.base_storage != DType::fp32 && *t.base_storage != DType::bf16)
    return fmt::format("base storage {} (supported: fp32, bf16)", peftplan::name_of(*t.base_storage));
  if (in.peft.adapters.size() != 1) return fmt::format("{} adapters (one LoRA adapter)", in.peft.adapters.size());
  const auto& a = in.peft.adapters[0];
  if (a.type != models::PeftType::lora) return fmt::format("adapter type {} (LoRA only)", models::name_of(a.type));
  if (a.lora.use_dora || a.lora.lora_bias || a.lora.bias != "none" || !a.lora.modules_to_save.empty())
    return "DoRA, LoRA bias, bias != \"none\" or modules_to_save";
  if (t.cross_entropy != CrossEntropy::standard) return "the chunked cross-entropy (use standard)";
  return {};
}

BuiltProgram build_program(const PlanInput& input, const BuildOptions& options) {
  validate(input);
  return Builder(input, options).build();
}

}  // namespace peftplan::planner
