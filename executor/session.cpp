// A Session's setup (runner.h, session_impl.h): what this executor runs, the plan and data it
// loads, the program built without names, its state buffers found by role and filled, and the
// accessors; messages' buffer names.
#include "session_impl.h"

namespace peftplan::executor {

namespace {

LrSchedule schedule_of(const std::optional<planner::SchedulerSpec>& s, std::int64_t steps) {
  if (!s) return ConstantLR{};
  const WarmupType wt = s->warmup_type == "linear" ? WarmupType::linear : WarmupType::log;
  switch (s->type) {
    case planner::SchedulerType::warmup_lr:
      return WarmupLR{s->warmup_min_lr, s->warmup_max_lr, s->warmup_num_steps, wt};
    case planner::SchedulerType::warmup_decay_lr:
      return WarmupDecayLR{s->total_num_steps.value_or(steps), s->warmup_min_lr, s->warmup_max_lr, s->warmup_num_steps, wt};
    case planner::SchedulerType::warmup_cosine_lr:
      return WarmupCosineLR{s->total_num_steps.value_or(steps), s->warmup_min_ratio, s->warmup_num_steps, s->cos_min_ratio, wt};
  }
  return ConstantLR{};
}


}  // namespace

// A whole file's bytes (checkpoint checksums); throws InputError naming it when unreadable.
std::string read_file_bytes(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  if (!f) throw InputError(fmt::format("{}: cannot be read", p.string()));
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

void check_executable(const planner::PlanFile& plan) {
  // What the executor's kernels cover is one rule, the planner's (it marks such programs
  // executable, and sim::verify then holds them to the operand contract).
  if (const std::string why = planner::executor_limitation(plan.input); !why.empty())
    throw InputError("the executor cannot run this plan: " + why);
  if (plan.run.steps <= 0) throw InputError("the executor cannot run this plan: run.steps must be positive");
}

planner::PlanFile load_plan(const std::filesystem::path& path) {
  planner::PlanFile p = planner::read_plan_file(path);
  check_executable(p);
  planner::check_program_hash(p, path.string());
  return p;
}

TokenData load_data(const planner::PlanFile& plan) {
  if (plan.run.data.empty()) throw InputError("plan.json: run.data names no token file");
  return TokenData::load(plan.run.data, parse_data_format(plan.run.data_format, "run.data_format"), plan.input.model.vocab,
                         plan.input.training.seq_len);
}

void Session::Impl::setup() {
  const planner::PlanInput& in = plan.input;
  planner::PlanInput pin = in;
  pin.inventory = nullptr;
  // Built without names: the interpreter finds what it needs by role and slot (sim/ops.h).
  planner::BuiltProgram built = planner::build_program(pin, {.names = false});
  program = std::move(built.program);
  const planner::ProgramFacts facts = built.facts;
  dt = facts.compute_dtype;
  if (!be.supports_compute(dt))
    throw InputError(fmt::format("the {} backend does not compute on {} storage (training.precision)", be.name(), name_of(dt)));
  sim::verify_or_throw(program);  // what the interpreter loop below may assume (sim/verify.h)
  const auto inv = planner::make_inventory(in.model, in.peft);
  trainables = inv.trainables;
  base_tensors = inv.tensors;
  const auto& t = in.training;
  B = t.micro_batch;
  S = t.seq_len;
  M = B * S;
  A = t.grad_accum;
  H = in.model.hidden;
  I = in.model.intermediate;
  V = in.model.vocab;
  nh = in.model.heads;
  nkv = in.model.kv_heads;
  d = in.model.head_dim;
  count = static_cast<double>(B * A * in.strategy.ranks * S);
  schedule = schedule_of(plan.extras.scheduler, plan.run.steps);
  const std::size_t nbuf = program.buffers.size();
  ptr.assign(nbuf, nullptr);
  tokens_mb.assign(nbuf, -1);
  op_s.assign(program.ops.size(), 0.0);
  op_warm_s.assign(program.ops.size(), 0.0);
  coll_ordinal.assign(program.ops.size(), -1);
  for (std::size_t i = 0; i < program.ops.size(); ++i)
    if (program.ops[i].kind == OpKind::collective && program.ops[i].phase != Phase::setup) {
      coll_ordinal[i] = static_cast<std::int32_t>(coll_ops.size());
      coll_ops.push_back(static_cast<std::int32_t>(i));
    }
  coll_cur.assign(coll_ops.size(), 0.0);
  last_start_s.assign(program.ops.size(), 0.0);
  last_dur_s.assign(program.ops.size(), -1.0);
  be.reserve_marks(mark_slots(program.ops.size()));
  // The state buffers by role; adapter tensors: views of trainable.flat, or (ZeRO-3) of a unit's
  // gathered buffer, the latter filled through the shards the gathers read (below).
  zero3 = in.strategy.stage == planner::Stage::zero3;
  auto tensor_of = [&](const sim::Buffer& buf) -> const models::TensorInfo* {
    return buf.role == sim::BufferRole::base_tensor ? &base_tensors.at(static_cast<std::size_t>(buf.tensor)) : nullptr;
  };
  auto adapter_of = [&](const sim::Buffer& buf) -> const models::TrainableTensor* {
    return buf.role == sim::BufferRole::adapter_tensor ? &trainables.at(static_cast<std::size_t>(buf.tensor)) : nullptr;
  };
  for (std::size_t b = 0; b < nbuf; ++b) {
    const sim::Buffer& buf = program.buffers[b];
    const auto id = static_cast<std::int32_t>(b);
    switch (buf.role) {
      case sim::BufferRole::trainable_flat: trainable_flat = id; break;
      case sim::BufferRole::trainable_shard: trainable_shard = id; break;
      case sim::BufferRole::grad_flat: grad_flat = id; break;
      case sim::BufferRole::optimizer_states: opt_states = id; break;
      case sim::BufferRole::optimizer_params: host_params = id; break;
      default: break;
    }
  }
  for (std::size_t b = 0; b < nbuf; ++b) {
    const sim::Buffer& buf = program.buffers[b];
    if (buf.view_of == trainable_flat && trainable_flat >= 0 && adapter_of(buf) != nullptr)
      adapter_views[static_cast<std::int32_t>(b)] = adapter_of(buf);
  }
  PEFTPLAN_CHECK((trainable_flat >= 0 || (zero3 && trainable_shard >= 0)) && opt_states >= 0);
  rank = comm ? comm->rank() : 0;
  N = in.strategy.ranks;
  if (options.fault && options.fault->rank == rank) fault = options.fault;
  board = comm ? comm->progress() : nullptr;
  for (const auto& op : program.ops)
    if (op.kind == OpKind::compute && op.kernel == Kernel::embedding_fwd)
      tokens_mb[static_cast<std::size_t>(sim::ops::read<sim::ops::EmbeddingFwd>(program, op).tokens)] = op.micro_batch;
  // Files: the base checkpoint and the adapter, opened once (validated on open).
  std::optional<SafetensorsFile> ckpt, adapter_file;
  if (!plan.run.weights.empty()) ckpt = SafetensorsFile::open(plan.run.weights);
  if (plan.run.adapter_init != "peft") adapter_file = SafetensorsFile::open(plan.run.adapter_init);
  const DType storage = facts.base_dtype;  // Linear weights' storage (fp32 unless base_storage says)
  // Setup ops: the persistent buffers, filled as they are allocated.
  std::size_t i = 0;
  for (; i < program.ops.size() && program.ops[i].phase == Phase::setup; ++i) {
    const sim::Op& op = program.ops[i];
    PEFTPLAN_CHECK_MSG(op.kind == OpKind::alloc, "setup op {} is not an alloc", i);
    alloc_op(i, op);
    const sim::Buffer& buf = program.buffers[static_cast<std::size_t>(op.buffer)];
    void* p = ptr[static_cast<std::size_t>(op.buffer)];
    if (const models::TensorInfo* tp = tensor_of(buf)) {
      PEFTPLAN_CHECK_MSG(buf.category == sim::MemCategory::base_weights, "{} holds a model tensor outside base_weights", buffer_label(op.buffer));
      const models::TensorInfo& ti = *tp;
      // Stored as the builder sized it (planner::frozen_storage_dtype). Made on the host,
      // staged to the device.
      const DType tensor_dt = planner::frozen_storage_dtype(ti, storage, facts.compute_dtype);
      std::vector<std::byte> host(buf.bytes);
      init_base_tensor(ti, tensor_dt, host, plan.run.seed, ckpt ? &*ckpt : nullptr);
      be.copy_to_device(p, host.data(), buf.bytes);
    } else {
      be.fill_zero(p, buf.bytes);
    }
  }
  first_step_op = i;
  // An injected fault at an op no step runs would never fire, and the fault test that set it
  // would pass without testing anything: refuse it (the same on every rank).
  if (options.fault && (options.fault->op < first_step_op || options.fault->op >= program.ops.size()))
    throw InputError(fmt::format("PEFTPLAN_FAULT: op {} is not one a step runs; this program's step ops are {}..{}",
                                 options.fault->op, first_step_op, program.ops.size() - 1));
  if (zero3) {
    // Persistent small tensors (views of a unit's persistent buffer) are filled whole. Each
    // shard an all_gather reads is this rank's block of its unit's flattened region, cut from
    // the same seeded full tensors every rank would have (DeepSpeed's zero.Init partitions the
    // module's parameters the same way).
    std::vector<std::vector<std::int32_t>> views_of(nbuf);
    for (std::size_t b = 0; b < nbuf; ++b)
      if (program.buffers[b].view_of >= 0) views_of[static_cast<std::size_t>(program.buffers[b].view_of)].push_back(static_cast<std::int32_t>(b));
    auto init_base = [&](const models::TensorInfo& ti, std::byte* p, std::uint64_t n) {
      init_base_tensor(ti, planner::frozen_storage_dtype(ti, storage, facts.compute_dtype), {p, n}, plan.run.seed, ckpt ? &*ckpt : nullptr);
    };
    for (std::size_t b = 0; b < nbuf; ++b) {
      const sim::Buffer& buf = program.buffers[b];
      if (buf.view_of < 0 || program.buffers[static_cast<std::size_t>(buf.view_of)].category != sim::MemCategory::base_weights) continue;
      if (const models::TensorInfo* tp = tensor_of(buf)) {
        std::vector<std::byte> host(buf.bytes);
        init_base(*tp, host.data(), buf.bytes);
        write_bytes(static_cast<std::int32_t>(b), host.data(), buf.bytes);
      }
    }
    // Parameter offload: a gather reads a view of a staging buffer that a param_h2d copy fills
    // from the persistent (host) shard; that shard is the one to fill.
    std::unordered_map<std::int32_t, std::int32_t> staged_from;
    for (std::size_t k = i; k < program.ops.size(); ++k) {
      const sim::Op& op = program.ops[k];
      if (op.kind == OpKind::copy && op.copy_dir == sim::CopyDir::host_to_device && op.buffer_out >= 0 &&
          program.buffers[static_cast<std::size_t>(root_of(op.buffer_out))].category == sim::MemCategory::comm_buffers)
        staged_from[op.buffer_out] = op.buffer;
    }
    std::vector<bool> done(nbuf, false);
    for (std::size_t k = i; k < program.ops.size(); ++k) {
      const sim::Op& op = program.ops[k];
      if (op.kind != OpKind::collective || op.collective != sim::Collective::all_gather || op.buffer_in < 0) continue;
      std::int32_t shard = op.buffer_in;
      if (auto it = staged_from.find(shard); it != staged_from.end()) shard = it->second;
      if (done[static_cast<std::size_t>(shard)]) continue;
      done[static_cast<std::size_t>(shard)] = true;
      const sim::Buffer& pay = program.buffers[static_cast<std::size_t>(op.buffer)];
      PEFTPLAN_CHECK(pay.view_of >= 0 && bytes(shard) * static_cast<std::uint64_t>(N) == pay.bytes);
      std::vector<std::byte> full(pay.bytes);
      ShardLayout layout;
      layout.shard = shard;
      for (std::int32_t v : views_of[static_cast<std::size_t>(pay.view_of)]) {
        const sim::Buffer& vb = program.buffers[static_cast<std::size_t>(v)];
        if (vb.offset < pay.offset || vb.offset >= pay.offset + pay.bytes) continue;
        const std::uint64_t off = vb.offset - pay.offset;
        PEFTPLAN_CHECK(off + vb.bytes <= pay.bytes);
        if (const models::TensorInfo* tp = tensor_of(vb)) {
          init_base(*tp, full.data() + off, vb.bytes);
        } else if (const models::TrainableTensor* tt = adapter_of(vb)) {
          std::vector<float> w(static_cast<std::size_t>(tt->numel()));
          init_adapter_tensor(*tt, w, plan.run.seed, adapter_file ? &*adapter_file : nullptr);
          PEFTPLAN_CHECK(w.size() * es() == vb.bytes);
          to_storage(w, full.data() + off);
          layout.adapters.emplace_back(tt, off);
        }
      }
      be.copy_to_device(at<std::byte>(shard), full.data() + static_cast<std::uint64_t>(rank) * bytes(shard), bytes(shard));
      if (!layout.adapters.empty()) shard_layouts.push_back(std::move(layout));
    }
  }
  for (std::size_t b = 0; b < nbuf; ++b)
    if (program.buffers[b].role == sim::BufferRole::grad_shard && ptr[b] != nullptr) grad_shard = static_cast<std::int32_t>(b);
  for (const auto& [id, tt] : adapter_views) {
    std::vector<float> host(static_cast<std::size_t>(tt->numel()));
    init_adapter_tensor(*tt, host, plan.run.seed, adapter_file ? &*adapter_file : nullptr);
    write_compute(id, host);
  }
  if (comm) base_counters = comm->counters();
  refresh_host_params();
  for (std::size_t k = first_step_op; k < program.ops.size(); ++k)
    if (program.ops[k].kind == OpKind::compute && program.ops[k].kernel == Kernel::optimizer_step)
      if (const auto o = sim::ops::read<sim::ops::OptimizerStep>(program, program.ops[k]); o.master >= 0) masters.push_back(o.master);
  init_masters();
  if (adapter_file)  // every tensor of the file must belong to the adapter
    for (const auto& st : adapter_file->tensors())
      if (std::none_of(trainables.begin(), trainables.end(), [&](const models::TrainableTensor& tt) { return tt.name == st.name; }))
        throw InputError(fmt::format("{}: tensor {} is not part of the adapter the plan describes", adapter_file->path().string(), st.name));
  meas.backend = be.description();
  meas.ranks = in.strategy.ranks;
  meas.tokens_per_step = B * S * A * in.strategy.ranks;
  meas.model_flops_per_step = program.model_flops_per_step;
  for (const auto& op : program.ops)
    if (op.kind == OpKind::compute && op.work.gemm_m > 0)
      meas.untracked_gemm_scratch_bytes = std::max(meas.untracked_gemm_scratch_bytes,
                                                   be.gemm_library_scratch_bytes(op.work.gemm_m, op.work.gemm_n, op.work.gemm_k));
}

// A buffer as messages name it: the program's name when it was built with names, else what its
// role says (a state buffer's conventional name, a tensor's checkpoint or PEFT name).
// (The interpreter never reads names; messages are for people, so they take the name from the
// same program built with names, made only when a message needs one: names change no buffer.)
std::string Session::Impl::buffer_label(std::int32_t id) const {
  const sim::Buffer& b = program.buffers[static_cast<std::size_t>(id)];
  if (!b.name.empty()) return b.name;
  std::call_once(named_once, [&] {
    planner::PlanInput pin = plan.input;
    pin.inventory = nullptr;
    named = planner::build_program(pin, {.names = true}).program;
  });
  if (named.buffers.size() == program.buffers.size() && !named.buffers[static_cast<std::size_t>(id)].name.empty())
    return named.buffers[static_cast<std::size_t>(id)].name;
  switch (b.role) {
    case sim::BufferRole::base_tensor: return base_tensors.at(static_cast<std::size_t>(b.tensor)).name;
    case sim::BufferRole::adapter_tensor: return trainables.at(static_cast<std::size_t>(b.tensor)).name;
    case sim::BufferRole::adapter_grad: return "grad." + trainables.at(static_cast<std::size_t>(b.tensor)).name;
    case sim::BufferRole::none:
      if (b.view_of >= 0) return fmt::format("{}[bytes {}:{}]", buffer_label(b.view_of), b.offset, b.offset + b.bytes);
      return fmt::format("buffer #{} ({}, {} B)", id, sim::name_of(b.category), b.bytes);
    default: return std::string(sim::state_buffer_name(b.role));
  }
}

std::string Session::Impl::op_name(std::size_t i) const {
  const sim::Op& op = program.ops[i];
  std::string what;
  switch (op.kind) {
    case OpKind::alloc: what = "alloc"; break;
    case OpKind::free: what = "free"; break;
    case OpKind::compute: what = std::string(sim::name_of(op.kernel)); break;
    case OpKind::collective: what = std::string(sim::name_of(op.collective)); break;
    case OpKind::copy: what = "copy"; break;
  }
  if (!op.label.empty()) what += " " + std::string(op.label);
  if (op.buffer >= 0) what += " " + buffer_label(op.buffer);
  return fmt::format("op {} ({}, {}{})", i, what, sim::name_of(op.phase),
                     op.layer >= 0 ? fmt::format(", layer {}", op.layer) : std::string());
}

Session::Session(const planner::PlanFile& plan, Backend& backend, TokenData data, Communicator* comm, const SessionOptions& options)
    : impl_(std::make_unique<Impl>(plan, backend, std::move(data), comm, options)) {
  check_executable(plan);
  const int world = comm ? comm->size() : 1;
  if (world != plan.input.strategy.ranks)
    throw InputError(fmt::format("the plan is for {} ranks, the job has {} (mpirun -np {})", plan.input.strategy.ranks, world,
                                 plan.input.strategy.ranks));
  if (impl_->data.seq_len() != plan.input.training.seq_len)
    throw InternalError("token data cut for another sequence length");
  impl_->setup();
}

Session::~Session() = default;

// The offloaded step's host copy of this rank's partition (optimizer.params) from the device's
// weights: the step's param_h2d copies run backwards (ZeRO-2 has one per bucket, from a view of
// optimizer.params into its region). At setup and whenever the weights are set.
void Session::Impl::refresh_host_params() {
  if (host_params < 0) return;
  for (std::size_t k = first_step_op; k < program.ops.size(); ++k) {
    const sim::Op& op = program.ops[k];
    if (op.kind != OpKind::copy || op.copy_dir != sim::CopyDir::host_to_device || root_of(op.buffer) != host_params) continue;
    auto block = [&](std::int32_t id) {
      auto* p = at<std::byte>(id);
      return bytes(id) == op.bytes ? p : p + static_cast<std::uint64_t>(rank) * op.bytes;
    };
    be.synchronize();
    be.copy_to_host(block(op.buffer), block(op.buffer_out), op.bytes);
  }
}

// Mixed precision: each optimizer op's fp32 master is its parameter block widened (DeepSpeed
// copies the bf16 module's partition to fp32 the same way, stage_1_and_2.py
// single_partition_of_fp32_groups), at setup and whenever the weights are set. The offloaded
// step's master and parameters (optimizer.params) are host memory, widened on the host.
void Session::Impl::init_masters() {
  for (std::size_t k = first_step_op; k < program.ops.size() && !masters.empty(); ++k) {
    const sim::Op& op = program.ops[k];
    if (op.kind != OpKind::compute || op.kernel != Kernel::optimizer_step) continue;
    const auto o = sim::ops::read<sim::ops::OptimizerStep>(program, op);
    if (o.master < 0) continue;
    if (op.stream == sim::Stream::host) {
      be.synchronize();
      from_storage(param_block(o.params, o.n), {at(o.master), static_cast<std::size_t>(o.n)});
    } else {
      be.convert(param_block(o.params, o.n), dt, at<std::byte>(o.master), DType::fp32, o.n);
    }
  }
}

// ZeRO-3: the whole adapter, all_gathered from the ranks' shards (a collective outside the
// step: its bytes are not counted in the step's measurement).
void Session::Impl::gather_adapter() {
  std::unordered_map<std::string, std::int64_t> flat_offset;
  std::int64_t total = 0;
  for (const auto& tt : trainables) {
    flat_offset[tt.name] = total;
    total += tt.numel();
  }
  full_adapter.assign(static_cast<std::size_t>(total), 0.0f);
  const CommCounters before = comm ? comm->counters() : CommCounters{};
  for (const ShardLayout& l : shard_layouts) {
    // This rank's shard staged to the host, then every rank's gathered there (a host
    // collective outside the step).
    std::vector<std::byte> region(bytes(l.shard) * static_cast<std::uint64_t>(N));
    std::byte* mine = region.data() + static_cast<std::uint64_t>(rank) * bytes(l.shard);
    read_bytes(l.shard, mine, bytes(l.shard));
    if (N > 1) comm->all_gather(mine, region.data(), bytes(l.shard), CommDType::uint8);
    for (const auto& [tt, off] : l.adapters)
      from_storage(region.data() + off, {full_adapter.data() + flat_offset.at(tt->name), static_cast<std::size_t>(tt->numel())});
  }
  if (comm) {
    const CommCounters after = comm->counters();
    for (std::size_t k = 0; k < after.by_kind.size(); ++k) {
      base_counters.by_kind[k].calls += after.by_kind[k].calls - before.by_kind[k].calls;
      base_counters.by_kind[k].bytes += after.by_kind[k].bytes - before.by_kind[k].bytes;
      base_counters.by_kind[k].seconds += after.by_kind[k].seconds - before.by_kind[k].seconds;
    }
  }
}
// The adapter tensors that are views of trainable.flat, in trainable-inventory order.
std::vector<std::pair<std::int32_t, const models::TrainableTensor*>> Session::Impl::adapter_views_in_order() const {
  std::vector<std::pair<std::int32_t, const models::TrainableTensor*>> out;
  for (const auto& tt : trainables)
    for (const auto& [id, t] : adapter_views)
      if (t == &tt) out.emplace_back(id, t);
  return out;
}

std::vector<float> Session::trainable_weights() {
  Impl& s = *impl_;
  if (s.zero3) {
    s.gather_adapter();
    return s.full_adapter;
  }
  // In inventory order: ZeRO-2's bucket-partitioned trainable.flat keeps padding between
  // buckets, so each tensor is read from its own view.
  std::vector<float> out;
  for (const auto& [id, t] : s.adapter_views_in_order()) {
    const std::size_t at = out.size();
    out.resize(at + static_cast<std::size_t>(t->numel()));
    const std::vector<float> w = s.read_compute(id);
    std::copy(w.begin(), w.end(), out.begin() + static_cast<std::ptrdiff_t>(at));
  }
  return out;
}

void Session::set_trainable_weights(std::span<const float> w) {
  Impl& s = *impl_;
  std::int64_t total = 0;
  for (const auto& tt : s.trainables) total += tt.numel();
  if (static_cast<std::int64_t>(w.size()) != total)
    throw InternalError(fmt::format("set_trainable_weights: {} values for an adapter of {}", w.size(), total));
  if (s.zero3) {  // each rank writes what its shards hold of each tensor
    std::vector<std::byte> stored(w.size() * s.es());
    s.to_storage(w, stored.data());
    std::unordered_map<const models::TrainableTensor*, std::int64_t> flat;
    std::int64_t off = 0;
    for (const auto& tt : s.trainables) {
      flat[&tt] = off;
      off += tt.numel();
    }
    for (const Impl::ShardLayout& l : s.shard_layouts) {
      const std::uint64_t lo = static_cast<std::uint64_t>(s.rank) * s.bytes(l.shard), hi = lo + s.bytes(l.shard);
      for (const auto& [tt, at] : l.adapters) {
        const std::uint64_t a = std::max(lo, at), b = std::min(hi, at + s.es() * static_cast<std::uint64_t>(tt->numel()));
        if (a >= b) continue;
        const std::byte* src = stored.data() + s.es() * static_cast<std::uint64_t>(flat.at(tt)) + (a - at);
        s.write_bytes(l.shard, src, b - a, a - lo);
      }
    }
  } else {
    std::size_t at = 0;
    for (const auto& [id, t] : s.adapter_views_in_order()) {
      s.write_compute(id, w.subspan(at, static_cast<std::size_t>(t->numel())));
      at += static_cast<std::size_t>(t->numel());
    }
  }
  s.refresh_host_params();  // the offloaded step's copy and the masters follow the weights set
  s.init_masters();
}

std::vector<float> Session::gradients() const {
  PEFTPLAN_CHECK_MSG(impl_->grad_flat >= 0, "this strategy keeps no full gradient buffer");
  return impl_->read_compute(impl_->grad_flat);
}
std::int64_t Session::steps_done() const { return impl_->steps_done; }

const sim::Program& Session::program() const { return impl_->program; }
const MemoryStats& Session::memory() const { return impl_->alloc.stats(); }

void Session::save_adapter(const std::filesystem::path& dir) const {
  const Impl& s = *impl_;
  std::vector<AdapterTensor> out;
  if (s.zero3) {  // from the adapter trainable_weights() gathered on every rank
    PEFTPLAN_CHECK_MSG(!s.full_adapter.empty(), "ZeRO-3: gather the adapter (trainable_weights) on every rank before saving it");
    std::size_t off = 0;
    for (const auto& tt : s.trainables) {
      out.push_back({&tt, {s.full_adapter.data() + off, static_cast<std::size_t>(tt.numel())}});
      off += static_cast<std::size_t>(tt.numel());
    }
    executor::save_adapter(dir, s.plan.input.peft.adapters.at(0), s.plan.input.model.name, out);
    return;
  }
  std::vector<std::vector<float>> host;  // each tensor staged to the host
  for (const auto& [id, t] : s.adapter_views_in_order()) {
    host.push_back(s.read_compute(id));
    out.push_back({t, host.back()});
  }
  executor::save_adapter(dir, s.plan.input.peft.adapters.at(0), s.plan.input.model.name, out);
}


}  // namespace peftplan::executor
