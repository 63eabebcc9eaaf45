// State: the persistent buffers each strategy sets up (weights, adapter, gradients, optimizer
// states, offload buffers) and the optimizer step (builder.h).
#include "builder.h"

namespace peftplan::planner::builder {

// Library buffers inside the caching allocator (they count in torch.cuda.memory_allocated):
// cuBLAS's workspaces, one per (handle, stream) (runtime.cpp). The CUDA context lies outside the
// allocator and outside the program (RuntimeRules::context_bytes).
void Builder::add_cuda_runtime() {
  const std::uint64_t ws = cublas_workspace_bytes(in_.device_sm);
  for (int i = 0; i < rules_.cublas_workspaces; ++i)
    alloc([&] { return i < 2 ? std::string(i == 0 ? "cublas.workspace.forward" : "cublas.workspace.backward") : name_cat("cublas.workspace.", i); },
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
    for (std::size_t u = 0; u < lay_.units.size(); ++u) {
      Unit& un = lay_.units[u];
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
        un.part_offset = lay_.part_numel;
        lay_.part_numel += shard(un.trainable_numel);
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
    const std::int64_t padded = exec_z2() ? lay_.part_numel * N : sharded_optimizer() ? shard(lay_.trainable_numel) * N : lay_.trainable_numel;
    trainable_flat_ = state_buffer(sim::BufferRole::trainable_flat, Cat::trainable_weights, tw * static_cast<std::uint64_t>(padded), S);
    if (full) {  // every weight lives in the flat trainable buffer
      embed_buf_ = trainable_flat_;
      for (auto& lv : lay_.layer_linears)
        for (auto& lp : lv) lp.weight_buf = trainable_flat_;
      for (auto& lp : lay_.head_linears) lp.weight_buf = trainable_flat_;
    }
    // Gradients: full on every rank for DDP / ZeRO-1, a partition for ZeRO-2.
    if (exec_z2()) {
      grad_shard_ = state_buffer(sim::BufferRole::grad_shard, Cat::gradients, tw * static_cast<std::uint64_t>(lay_.part_numel), S);
      for (std::size_t b = 0; b < lay_.buckets.size(); ++b) {
        GradBucket& bk = lay_.buckets[b];
        const std::uint64_t sb = static_cast<std::uint64_t>(shard(bk.numel));
        bk.grad_view = p_.add_view(names_ ? name_cat("grad.shard[bucket", b, ']') : std::string(), grad_shard_, tw * static_cast<std::uint64_t>(bk.part_offset), tw * sb);
        bk.param_view = p_.add_view(names_ ? name_cat("trainable.flat[bucket", b, ']') : std::string(), trainable_flat_, tw * static_cast<std::uint64_t>(bk.region), tw * sb * static_cast<std::uint64_t>(N));
      }
    } else if (sharded_grads())
      grad_shard_ = state_grad(sim::BufferRole::grad_shard, tw * static_cast<std::uint64_t>(shard(lay_.trainable_numel)));
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
          for (const auto& lp : lay_.head_linears)
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
                                  tw * static_cast<std::uint64_t>(lay_.part_numel), S);
    grad_shard_ = state_buffer(sim::BufferRole::grad_shard, Cat::gradients, tw * static_cast<std::uint64_t>(lay_.part_numel), S);
    for (Unit& un : lay_.units) {
      if (un.trainable_numel == 0) continue;
      const std::uint64_t off = tw * static_cast<std::uint64_t>(un.part_offset), bytes = tw * static_cast<std::uint64_t>(shard(un.trainable_numel));
      un.trainable_shard = p_.add_view(names_ ? un.name + ".trainable.shard" : std::string(), trainable_shard_, off, bytes);
      un.grad_shard_view = p_.add_view(names_ ? un.name + ".grad.shard" : std::string(), grad_shard_, off, bytes);
    }
  } else if (zero3()) {
    grad_shard_ = state_grad(sim::BufferRole::grad_shard, tw * static_cast<std::uint64_t>(trainable_shard_total()));
  }
  // Optimizer states for this rank's partition (all of it for DDP), on the device or the host.
  const std::int64_t opt_numel = exec_z3() || exec_z2() ? lay_.part_numel : sharded_optimizer() ? trainable_shard_total() : lay_.trainable_numel;
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
    for (GradBucket& bk : lay_.buckets)
      bk.state_view = p_.add_view(std::string(), opt_states_, 2 * static_cast<std::uint64_t>(state) * static_cast<std::uint64_t>(bk.part_offset),
                                  2 * static_cast<std::uint64_t>(state) * static_cast<std::uint64_t>(shard(bk.numel)));
  if (f_.master_weights) master_ = alloc([&] { return "optimizer.master_fp32"; }, opt_cat, f32(opt_numel), S);
  if (exec_z2() && master_ >= 0)  // per bucket: its block of the partition, like the states
    for (GradBucket& bk : lay_.buckets)
      bk.master_view = p_.add_view(std::string(), master_, 4 * static_cast<std::uint64_t>(bk.part_offset), 4 * static_cast<std::uint64_t>(shard(bk.numel)));
  // Runtime profile: buffers outside the model.
  if (in_.profile == RuntimeProfile::deepspeed) {
    const bool overlap = s_.ds.overlap(zero3());
    // stage_1_and_2.py: with contiguous_gradients an ipg buffer of reduce_bucket_size elements
    // (two when overlap_comm) in the gradient dtype; we cap it at the trainable size.
    if (s_.stage != Stage::ddp && s_.ds.contiguous_gradients) {
      const std::int64_t elems = std::min<std::int64_t>(s_.ds.reduce_bucket_size, lay_.trainable_numel);
      alloc([&] { return "deepspeed.ipg_buffer"; }, Cat::comm_buffers, tw * static_cast<std::uint64_t>(elems) * (overlap ? 2 : 1), S);
    }
    add_cuda_runtime();
    if (host_opt && s_.ds.offload_pin_memory)
      alloc([&] { return "deepspeed.pinned_grads"; }, Cat::host_pinned_buffers, f32(opt_numel), S);
  } else if (in_.profile == RuntimeProfile::hf) {
    // torch.nn.parallel.DistributedDataParallel: gradient buckets of bucket_cap_mb = 25 MiB each,
    // together as large as the gradients (gradient_as_bucket_view=False copies into them).
    if (s_.ranks > 1 && s_.stage == Stage::ddp)
      alloc([&] { return "ddp.buckets"; }, Cat::comm_buffers, tw * static_cast<std::uint64_t>(lay_.trainable_numel), S);
    add_cuda_runtime();
  }
  if (host_opt) staging_ = alloc([&] { return "host.staging"; }, Cat::host_pinned_buffers, tw * static_cast<std::uint64_t>(opt_numel), S);
  // The executor's offloaded step updates a host copy of this rank's parameter partition (in fp32
  // the "master" DeepSpeed keeps on the CPU; in bf16 the weights its fp32 master rounds into) and
  // copies it back.
  if (host_opt && in_.profile == RuntimeProfile::executor)
    host_params_ = state_buffer(sim::BufferRole::optimizer_params, Cat::host_optimizer_states, tw * static_cast<std::uint64_t>(opt_numel), S);
  if (exec_z2() && host_params_ >= 0)
    for (GradBucket& bk : lay_.buckets)
      bk.host_view = p_.add_view(std::string(), host_params_, tw * static_cast<std::uint64_t>(bk.part_offset), tw * static_cast<std::uint64_t>(shard(bk.numel)));
}

// The buffer kernels read a frozen tensor from: its own buffer, a ZeRO-3 persistent view, or a
// view of its unit's gathered buffer.
void Builder::bind_base(const models::TensorInfo& t, std::int32_t b) {
  PEFTPLAN_CHECK(&t >= tensors_->data() && &t < tensors_->data() + tensors_->size());
  role(b, sim::BufferRole::base_tensor, static_cast<std::int32_t>(&t - tensors_->data()));
  if (t.role == models::ParamRole::embedding) {
    embed_buf_ = b;
    // A tied head (GPT-2, Gemma) has no weight of its own: it computes with the embedding's, so it
    // is bound with it — at every rebinding, as under the executor's ZeRO-3, where each gather of
    // the embedding unit (forward, backward) is a view of a new buffer.
    if (m_.tie_embeddings)
      for (auto& lp : lay_.head_linears)
        if (lp.mod->is_output) lp.weight_buf = b;
  }
  if (t.role == models::ParamRole::norm_weight) {  // Llama-family names (transformers)
    if (t.layer < 0) final_norm_ = b;
    else if (t.module.ends_with("input_layernorm")) norm1_[static_cast<std::size_t>(t.layer)] = b;
    else if (t.module.ends_with("post_attention_layernorm")) norm2_[static_cast<std::size_t>(t.layer)] = b;
  }
  if (LinearPlan* lp = linear_at(t.module)) (t.role == models::ParamRole::linear_bias ? lp->bias_buf : lp->weight_buf) = b;
}

void Builder::optimizer_step() {
  mb_ = -1;
  const Phase O = Phase::optimizer;
  const std::uint64_t tw = bytes_of(f_.trainable_dtype);
  const std::int64_t part = exec_z3() || exec_z2() ? lay_.part_numel : sharded_optimizer() ? trainable_shard_total() : lay_.trainable_numel;
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
    // Mixed precision: the gradients widened into grad.fp32 on the host, the host master
    // stepped and rounded into host_params_, which the copies bring back.
    if (exec)
      dep = compute("cpu_adam", -1, O, w,
                    ops::OptimizerStep{.params = host_params_, .grads = staging_, .states = opt_states_, .master = master_, .grads32 = g32, .n = part},
                    {d2h}, Stream::host);
    else
      dep = compute("cpu_adam", -1, O, w, ops::OptimizerStep{.n = part}, {d2h}, Stream::host);
    if (exec_z2()) {  // bucket by bucket: this rank's block of each bucket's region
      const std::int32_t step = dep;
      for (const GradBucket& bk : lay_.buckets) {
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
      for (const GradBucket& bk : lay_.buckets) {
        const std::int64_t sb = shard(bk.numel);
        sim::ComputeWork wb = elementwise(static_cast<std::uint64_t>(state_rw * 2.0 * static_cast<double>(sb)), 10.0 * static_cast<double>(sb));
        wb.params = sb;
        const std::int32_t g32v = g32 >= 0 ? p_.add_view(std::string(), g32, 4 * static_cast<std::uint64_t>(bk.part_offset), 4 * static_cast<std::uint64_t>(sb)) : -1;
        dep = compute("adamw", -1, O, wb,
                      ops::OptimizerStep{.params = bk.param_view, .grads = bk.grad_view, .states = bk.state_view, .master = bk.master_view, .grads32 = g32v,
                                         .n = sb},
                      {before});
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
                                       .master = exec ? master_ : -1, .grads32 = exec ? g32 : -1, .n = part},
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
    for (const GradBucket& bk : lay_.buckets)
      collective(Collective::all_gather, "all_gather_params", tw * static_cast<std::uint64_t>(shard(bk.numel) * N), -1, O, bk.param_view, {dep});
  } else if ((s_.stage == Stage::zero1 || s_.stage == Stage::zero2) && N > 1)
    collective(Collective::all_gather, "all_gather_params", tw * static_cast<std::uint64_t>(part * N), -1, O, trainable_flat_, {dep});
  if (s_.stage == Stage::zero1 && N > 1) {
    free(grad_shard_, O);
    grad_shard_ = -1;
  }
}

}  // namespace peftplan::planner::builder
