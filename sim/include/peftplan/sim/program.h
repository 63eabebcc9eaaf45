// The step program: what one rank does in one optimizer step (all micro-batches), as ordered SPMD
// ops with dependencies. The planner builds it; two interpreters read it: the simulator (memory
// walk and timeline, sim/) and the executor (real allocations, kernels and collectives).
// This header only defines the data; it knows nothing about models, strategies or costs.
#pragma once

#include <array>
#include <initializer_list>
#include <span>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "peftplan/common/dtype.h"

namespace peftplan::sim {

// Memory categories of ../shared/DESIGN.md, the same names everywhere (planner, executor,
// reports, GUI). The first nine live on the device, the last four on the host.
enum class MemCategory : std::uint8_t {
  base_weights,        // frozen model (full or ZeRO-3 shard) in its storage dtype
  gathered_weights,    // ZeRO-3 layers gathered for compute, incl. prefetch
  trainable_weights,   // adapters, or every weight in full fine-tuning
  gradients,           // gradients of trainable weights (full or shard)
  optimizer_states,    // optimizer moments and fp32 master copies
  activations,         // tensors saved for backward, incl. checkpoints
  workspace,           // transient: logits, scores, recompute, backward temporaries, GEMM scratch
  comm_buffers,        // buckets, flat buffers, library buffers
  runtime_overhead,    // CUDA context, library handles, allocator reserve
  host_optimizer_states,
  host_weights,
  host_pinned_buffers,
  host_other,
};
inline constexpr int kNumCategories = 13;
inline constexpr int kNumDeviceCategories = 9;

constexpr bool on_host(MemCategory c) {
  return static_cast<int>(c) >= kNumDeviceCategories;
}

constexpr std::string_view name_of(MemCategory c) {
  constexpr std::array<std::string_view, kNumCategories> names = {
      "base_weights",     "gathered_weights",      "trainable_weights", "gradients",
      "optimizer_states", "activations",           "workspace",         "comm_buffers",
      "runtime_overhead", "host_optimizer_states", "host_weights",      "host_pinned_buffers",
      "host_other"};
  return names[static_cast<std::size_t>(c)];
}
// The name tables below are tied to their enums: a new enumerator (or a name out of place)
// fails to compile rather than printing an empty or wrong name.
static_assert(static_cast<int>(MemCategory::host_other) + 1 == kNumCategories && name_of(MemCategory::host_other) == "host_other" &&
              name_of(MemCategory::runtime_overhead) == "runtime_overhead" && !on_host(MemCategory::runtime_overhead) &&
              on_host(MemCategory::host_optimizer_states));

// Resources that run ops; ops on one stream run in program order (like a CUDA stream).
enum class Stream : std::uint8_t { compute, comm, copy, host };
inline constexpr int kNumStreams = 4;
constexpr std::string_view name_of(Stream s) {
  constexpr std::array<std::string_view, kNumStreams> names = {"compute", "comm", "copy", "host"};
  return names[static_cast<std::size_t>(s)];
}
static_assert(static_cast<int>(Stream::host) + 1 == kNumStreams && name_of(Stream::host) == "host");

enum class OpKind : std::uint8_t { alloc, free, compute, collective, copy };

// setup: persistent buffers that exist before the step starts (weights, optimizer states);
// the timeline gives setup ops zero time, the memory walk counts them.
enum class Phase : std::uint8_t { setup, forward, backward, recompute, loss, optimizer };
inline constexpr int kNumPhases = 6;
constexpr std::string_view name_of(Phase p) {
  constexpr std::array<std::string_view, kNumPhases> names = {"setup",    "forward", "backward",
                                                              "recompute", "loss",   "optimizer"};
  return names[static_cast<std::size_t>(p)];
}
static_assert(static_cast<int>(Phase::optimizer) + 1 == kNumPhases && name_of(Phase::optimizer) == "optimizer" &&
              name_of(Phase::recompute) == "recompute");

// NCCL's names (nccl-tests doc/PERFORMANCE.md).
enum class Collective : std::uint8_t { all_reduce, reduce_scatter, all_gather, broadcast };
inline constexpr int kNumCollectives = 4;
constexpr std::string_view name_of(Collective c) {
  constexpr std::array<std::string_view, kNumCollectives> names = {"all_reduce", "reduce_scatter",
                                                                   "all_gather", "broadcast"};
  return names[static_cast<std::size_t>(c)];
}
static_assert(static_cast<int>(Collective::broadcast) + 1 == kNumCollectives && name_of(Collective::broadcast) == "broadcast" &&
              name_of(Collective::reduce_scatter) == "reduce_scatter");

enum class CopyDir : std::uint8_t { device_to_host, host_to_device };

// What a collective with no buffer reduces: a scalar the interpreter keeps itself (one fp64 per
// rank, summed). `none` for a collective of a buffer.
enum class ScalarReduction : std::uint8_t {
  none,
  loss_sum,    // the micro-batches' loss sums (the executor reports the step's loss on every rank)
  grad_sumsq,  // the partitions' sums of squares of the gradients (global-norm clipping)
};

// Buffers an interpreter must find without reading names (a program may be built without them).
enum class BufferRole : std::uint8_t {
  none,
  base_tensor,       // one frozen model tensor: Buffer::tensor is its index in the inventory's
                     //   tensors (models::make_inventory, the order of the checkpoint's names)
  adapter_tensor,    // one trainable adapter tensor: Buffer::tensor is its index in the
                     //   inventory's trainables
  adapter_grad,      // the gradient of one (a view of the gradients; Buffer::tensor as above)
  trainable_flat,    // every trainable weight, flat in inventory order (replicated strategies)
  trainable_shard,   // this rank's partition of them (ZeRO-3)
  grad_flat,         // the gradients, flat like trainable_flat
  grad_shard,        // this rank's gradient partition (ZeRO-1/2/3)
  optimizer_states,  // the optimizer's moments (and master weights) of this rank's partition
  optimizer_params,  // the host copy of the partition the offloaded optimizer steps
};
inline constexpr int kNumBufferRoles = 10;
constexpr std::string_view name_of(BufferRole r) {
  constexpr std::array<std::string_view, kNumBufferRoles> names = {
      "none",           "base_tensor", "adapter_tensor", "adapter_grad",     "trainable_flat",
      "trainable_shard", "grad_flat",  "grad_shard",     "optimizer_states", "optimizer_params"};
  return names[static_cast<std::size_t>(r)];
}
// The name a program built with names gives the buffer of a state role (the builder names them
// so, and an interpreter of a program built without names says them so); empty for the others.
constexpr std::string_view state_buffer_name(BufferRole r) {
  constexpr std::array<std::string_view, kNumBufferRoles> names = {
      "", "", "", "", "trainable.flat", "trainable.shard", "grad.flat", "grad.shard", "optimizer.states", "optimizer.params"};
  return names[static_cast<std::size_t>(r)];
}
static_assert(name_of(BufferRole::optimizer_params) == "optimizer_params" && state_buffer_name(BufferRole::optimizer_params) == "optimizer.params",
              "the role tables follow the enum");

// What a compute op does. The executor maps it to a kernel, the simulator to a cost class.
// The meaning of each kernel's operands, shape and scalars is sim/ops.h.
enum class Kernel : std::uint8_t {
  none,
  embedding_fwd, embedding_bwd,
  norm_fwd, norm_bwd,
  linear_fwd, linear_bwd_data, linear_bwd_weight,
  lora_fwd, lora_bwd,
  rope_fwd, rope_bwd,
  attention_fwd, attention_bwd,
  mlp_act_fwd, mlp_act_bwd,
  residual_add,
  cross_entropy_fwd, cross_entropy_bwd,
  cast,            // dtype conversion (bf16 base weight -> fp32 compute copy, grad casts)
  grad_norm,       // sum of squares over gradients (global-norm clipping)
  optimizer_step,  // AdamW / SGD update of a parameter range
  accumulate,      // gradient accumulation / bucket packing (elementwise add or copy)
  dropout,         // inverted dropout of an adapter input (mask from a counter-based hash)
  rope_tables,     // fill the RoPE cos/sin tables for positions 0..S-1
  flash_attention_fwd, flash_attention_bwd,  // fused, tiled attention: log-sum-exp, no S x S scores
};
inline constexpr int kNumKernels = 27;
// The kernel's name as traces, measurements and reports print it ("linear_fwd").
constexpr std::string_view name_of(Kernel k) {
  constexpr std::array<std::string_view, kNumKernels> names = {
      "none",          "embedding_fwd",    "embedding_bwd",     "norm_fwd",
      "norm_bwd",      "linear_fwd",       "linear_bwd_data",   "linear_bwd_weight",
      "lora_fwd",      "lora_bwd",         "rope_fwd",          "rope_bwd",
      "attention_fwd", "attention_bwd",    "mlp_act_fwd",       "mlp_act_bwd",
      "residual_add",  "cross_entropy_fwd", "cross_entropy_bwd", "cast",
      "grad_norm",     "optimizer_step",   "accumulate",        "dropout",
      "rope_tables",   "flash_attention_fwd", "flash_attention_bwd"};
  const auto i = static_cast<std::size_t>(k);
  return i < names.size() ? names[i] : "unknown";
}
static_assert(static_cast<int>(Kernel::flash_attention_bwd) + 1 == kNumKernels &&
                  name_of(Kernel::flash_attention_bwd) == "flash_attention_bwd",
              "the kernel name table follows the enum");

// Cost-relevant description of a compute op: work and traffic, and the GEMM shape when it is one
// (the simulator's efficiency depends on it). m, n, k follow BLAS: [m,k]·[k,n].
struct ComputeWork {
  double flops = 0.0;               // floating-point operations
  std::uint64_t bytes_moved = 0;    // bytes read + written from memory (roofline)
  std::int64_t gemm_m = 0, gemm_n = 0, gemm_k = 0;  // 0 when not a GEMM
  std::int32_t gemm_count = 1;      // identical GEMMs in this op (attention: batch × heads)
  std::int64_t params = 0;          // optimizer_step: parameters updated (a host-stream step is
                                    //   costed per parameter, at the CPU-Adam rate)
  bool fp32_math = false;           // a GEMM in fp32 although the step computes in 16 bits (an
                                    //   fp32 adapter without autocast): the fp32 peak applies
};

struct Buffer {
  std::string name;          // e.g. "layers.3.attn.probs.mb0"
  MemCategory category = MemCategory::workspace;
  std::uint64_t bytes = 0;
  // A view is a named byte range [offset, offset + bytes) inside another buffer (one adapter
  // tensor inside "trainable.flat"): it has no alloc/free ops of its own and costs no memory; it
  // is valid while its parent is live.
  std::int32_t view_of = -1;
  std::uint64_t offset = 0;  // bytes from the parent's start (views only)
  // The separate tensors a runtime allocates for this buffer, in order, tiling [0, bytes) (one
  // gradient per parameter under AccumulateGrad, one exp_avg and one exp_avg_sq per parameter in
  // torch.optim); empty = one allocation. Only the caching-allocator replay reads them: each
  // piece is allocated at the first op that touches its bytes after the buffer's alloc op, as
  // PyTorch creates such a tensor when it is first needed, and every piece is freed with the
  // buffer. A setup buffer's pieces are therefore created in the first step and then persist
  // (torch.optim's lazily created states). Sums to `bytes`; views have none.
  std::vector<std::uint64_t> pieces;
  // Freed while another stream may still be using it (the runtime called record_stream): the
  // caching allocator takes the block back only when the GPU has passed the free
  // (CUDACachingAllocator.cpp free: insert_events when stream_uses is not empty; process_events
  // at the next malloc). The replay returns it at the next free of such a buffer: FSDP1's rate
  // limiter lets one reshard's free event be unfinished when it issues the next all-gather
  // (torch/distributed/fsdp/_limiter_utils.py _FreeEventQueue, _max_num_inflight_all_gathers = 2,
  // dequeued and synchronised in _runtime_utils.py _unshard). Only the allocator replay reads it;
  // allocated bytes drop at the free as PyTorch counts them.
  bool reuse_after_next_recorded_free = false;
  BufferRole role = BufferRole::none;  // what an interpreter finds this buffer as
  std::int32_t tensor = -1;            // base_tensor / adapter_tensor: the inventory index
};

struct Op {
  OpKind kind = OpKind::compute;
  Stream stream = Stream::compute;
  Phase phase = Phase::forward;
  Kernel kernel = Kernel::none;        // compute ops only
  Collective collective = Collective::all_reduce;  // collective ops only
  CopyDir copy_dir = CopyDir::device_to_host;      // copy ops only
  std::int32_t layer = -1;             // transformer layer, -1 for embedding/head/optimizer
  std::int32_t micro_batch = -1;       // -1 when not tied to a micro-batch
  std::int32_t buffer = -1;            // alloc/free: the buffer; collective/copy: the payload
  std::int32_t group_size = 1;         // collective: ranks taking part
  std::int32_t group_stride = 1;       // collective: rank distance between members (1: packed onto
                                       //   nodes; FSDP HYBRID_SHARD's cross-node groups: a node's
                                       //   GPUs, one member per node)
  std::uint64_t bytes = 0;             // collective: nccl-tests "size" S — all_reduce and
                                       //   broadcast: the buffer each rank holds;
                                       //   reduce_scatter and all_gather: the TOTAL (gathered,
                                       //   unscattered) array, i.e. shard bytes × group_size
                                       //   (nccl-tests doc/PERFORMANCE.md);
                                       // copy: bytes copied
  std::int32_t buffer_out = -1;        // collective: the receive buffer when the result does
                                       //   not stay in `buffer` (a reduce_scatter into a
                                       //   gradient partition); copy: the destination (-1: none
                                       //   named, as in the cost-only profiles)
  std::int32_t buffer_in = -1;         // all_gather: the shard this rank contributes, when it
                                       //   is not this rank's block of `buffer` (ZeRO-3 in the
                                       //   executor profile: a unit's frozen or trainable shard
                                       //   gathered into a view of the unit's gathered buffer)
  ComputeWork work;                    // compute ops
  bool accumulate = false;             // compute: add into the (first) output instead of
                                       //   overwriting it (several contributions to one grad)
  ScalarReduction reduction = ScalarReduction::none;  // collective with no buffer: what it sums
  std::int32_t operands = -1;          // compute ops: where its operands start in
                                       //   Program::operands
  std::uint32_t deps_begin = 0;        // explicit cross-stream dependencies: indices into
  std::uint32_t deps_count = 0;        //   Program::deps, each an earlier op index
  std::string_view label;              // static text naming the op ("q_proj", "attention")
};

struct Program {
  std::vector<Buffer> buffers;
  std::vector<Op> ops;
  std::vector<std::int32_t> deps;      // flattened dependency lists (see Op::deps_begin)
  // The compute ops' operands, one after another: each op's buffer ids (-1 when absent), shape,
  // scalars and integer parameters, as many of each as its kernel has, in the order sim/ops.h
  // names them (write and read them only through ops::emit and ops::read). Kept beside the ops,
  // not in them: the memory walk and the timeline read every op and none of this.
  std::vector<std::int64_t> operands;
  std::int32_t ranks = 1;              // data-parallel size N
  std::int32_t micro_batches = 1;      // gradient-accumulation steps in this program
  std::int64_t tokens_per_step = 0;    // tokens this rank processes in the step
  double model_flops_per_step = 0.0;   // useful model FLOPs (no recompute) for MFU, this rank
  // Built for the executor: every required operand slot is filled and sized for compute_dtype,
  // and sim::verify checks them (ops::SlotSpec); the cost-only profiles name only what their
  // interpreters read (liveness and the caching-allocator replay).
  bool executable = false;
  // The storage of an executable program's compute operands (ops::Elem::compute): fp32, or bf16
  // in mixed precision (the fp32 master weights and moments are ops::Elem::f32 slots).
  DType compute_dtype = DType::fp32;

  std::int32_t add_buffer(std::string name, MemCategory category, std::uint64_t bytes) {
    Buffer b;
    b.name = std::move(name);
    b.category = category;
    b.bytes = bytes;
    buffers.push_back(std::move(b));
    return static_cast<std::int32_t>(buffers.size() - 1);
  }
  std::int32_t add_view(std::string name, std::int32_t parent, std::uint64_t offset,
                        std::uint64_t bytes) {
    Buffer b;
    b.name = std::move(name);
    b.category = buffers[static_cast<std::size_t>(parent)].category;
    b.bytes = bytes;
    b.view_of = parent;
    b.offset = offset;
    buffers.push_back(std::move(b));
    return static_cast<std::int32_t>(buffers.size() - 1);
  }
  std::int32_t add_op(Op op, std::initializer_list<std::int32_t> op_deps = {}) {
    op.deps_begin = static_cast<std::uint32_t>(deps.size());
    op.deps_count = static_cast<std::uint32_t>(op_deps.size());
    deps.insert(deps.end(), op_deps.begin(), op_deps.end());
    ops.push_back(op);
    return static_cast<std::int32_t>(ops.size() - 1);
  }
  std::int32_t add_op(Op op, std::span<const std::int32_t> op_deps) {
    op.deps_begin = static_cast<std::uint32_t>(deps.size());
    op.deps_count = static_cast<std::uint32_t>(op_deps.size());
    deps.insert(deps.end(), op_deps.begin(), op_deps.end());
    ops.push_back(op);
    return static_cast<std::int32_t>(ops.size() - 1);
  }
  std::span<const std::int32_t> deps_of(const Op& op) const {
    return {deps.data() + op.deps_begin, op.deps_count};
  }
};

}  // namespace peftplan::sim
