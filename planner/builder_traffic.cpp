// The strategy's traffic: ZeRO-3 / FSDP gathers (with prefetch chunks) and releases, FSDP2's
// copy-out, and the gradient reductions per bucket as backward completes units (builder.h).
#include "builder.h"

namespace peftplan::planner::builder {

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
  Unit& un = lay_.units[u];
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
  gathered_[u] = alloc([&] { return name_cat(un.name, ".gathered.", name_of(phase)); }, Cat::gathered_weights, frozen_full + train_full, phase);
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
    if (u == lay_.units.size() - 1) for (auto& lp : lay_.head_linears) bind_adapter(lp);
    else if (u >= 1) for (auto& lp : lay_.layer_linears[u - 1]) bind_adapter(lp);
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
  const std::int32_t unsharded = alloc([&] { return name_cat(lay_.units[u].name, ".unsharded.", name_of(phase)); }, Cat::gathered_weights, bytes, phase);
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

// ZeRO-2/3 with several ranks: a bucket's full gradients live from its first unit's backward
// until its reduce_scatter. The buffer holds the bucket's flat range [flat_lo, flat_lo + numel)
// padded to a multiple of N; the adapters' gradient views point into it.
void Builder::begin_unit_gradients(std::size_t u) {
  if (!sharded_grads() || s_.ranks == 1 || lay_.bucket_of.empty() || lay_.bucket_of[u] < 0) return;
  const auto b = static_cast<std::size_t>(lay_.bucket_of[u]);
  const GradBucket& bk = lay_.buckets[b];
  if (bk.units.front() != u || bucket_buf_[b] >= 0) return;
  const std::uint64_t tw = bytes_of(f_.trainable_dtype);
  bucket_buf_[b] = alloc([&] { return name_cat("grad.bucket", b, ".mb", mb_); }, Cat::gradients,
                         tw * static_cast<std::uint64_t>(bucket_shard_numel(bk) * group()), Phase::backward);
  if (bk.flat_lo < 0) return;
  auto views = [&](LinearPlan& lp) {
    if (!lp.adapter || lp.adapter->a_off < 0) return;
    Adapter& a = *lp.adapter;
    const std::string base = names_ ? name_cat("grad.", lp.mod->path, ".mb", mb_) : std::string();
    a.ga_buf = role(p_.add_view(names_ ? base + ".lora_A" : std::string(), bucket_buf_[b], tw * static_cast<std::uint64_t>(a.a_off - bk.flat_lo),
                                tw * static_cast<std::uint64_t>(a.a_numel)),
                    sim::BufferRole::adapter_grad, a.a_tensor);
    a.gb_buf = role(p_.add_view(names_ ? base + ".lora_B" : std::string(), bucket_buf_[b], tw * static_cast<std::uint64_t>(a.b_off - bk.flat_lo),
                                tw * static_cast<std::uint64_t>(a.b_numel)),
                    sim::BufferRole::adapter_grad, a.b_tensor);
  };
  for (std::size_t v : bk.units) {
    if (v == lay_.units.size() - 1) for (auto& lp : lay_.head_linears) views(lp);
    else if (v >= 1) for (auto& lp : lay_.layer_linears[v - 1]) views(lp);
  }
}

// A unit's gradients are complete for this micro-batch: bucket them for reduction.
void Builder::unit_gradients_done(std::size_t u, std::int32_t after_op) {
  const Unit& un = lay_.units[u];
  const std::uint64_t tw = bytes_of(f_.trainable_dtype);
  const bool last_mb = mb_ == p_.micro_batches - 1;
  if (un.trainable_numel == 0 && u != 0) return;
  if (s_.ranks == 1) return;
  if (zero3() || s_.stage == Stage::zero2) {
    // DeepSpeed reduces during every micro-batch's backward for ZeRO-2/3: each bucket is
    // reduce-scattered into this rank's gradient partition, adding to the earlier micro-batches'.
    const std::int32_t b = lay_.flush_of[u];
    if (b < 0) return;
    const GradBucket& bk = lay_.buckets[static_cast<std::size_t>(b)];
    const std::int64_t padded = bucket_shard_numel(bk) * group();
    std::int32_t payload = bucket_buf_[static_cast<std::size_t>(b)];
    if (fsdp2()) {
      // FSDP2's foreach_reduce (_fsdp_collectives.py): the unsharded gradients are copied into
      // one padded reduce-scatter input (_chunk_cat, on the default stream) and freed; that input
      // is held in comm_ctx.reduce_scatter_state until the next unit's post-backward (the root's
      // final callback drops the last).
      const std::int32_t rs_in = alloc([&] { return name_cat("grad.reduce_scatter_input", b, ".mb", mb_); }, Cat::comm_buffers,
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
    const std::int64_t lo = lay_.units[bucket_units_.back()].flat_offset;
    if (lo >= 0 && lay_.units[bucket_units_.front()].flat_offset + lay_.units[bucket_units_.front()].trainable_numel - lo == bucket_numel_)
      payload = p_.add_view(names_ ? name_cat("grad.flat[", lo, ':', lo + bucket_numel_, ']') : std::string(), grad_flat_,
                            tw * static_cast<std::uint64_t>(lo), tw * static_cast<std::uint64_t>(bucket_numel_));
    reduce_ops_.push_back(collective(Collective::all_reduce, "all_reduce_grads", tw * static_cast<std::uint64_t>(bucket_numel_), -1,
                                     Phase::backward, payload, {after_op}));
    bucket_units_.clear();
    bucket_numel_ = 0;
  }
}

}  // namespace peftplan::planner::builder
