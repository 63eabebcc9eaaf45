// The step-program interpreter (see runner.h). Reading order: the checks of what this executor
// runs, the Session's state (program, buffer pointers, per-op timing), setup (weights, adapter,
// state buffers), the per-step op loop and the kernel dispatch, then run_plan.
#include "peftplan/executor/runner.h"

#include <algorithm>
#include <numeric>
#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <deque>
#include <limits>
#include <functional>
#include <thread>
#include <unordered_map>

#include <fmt/format.h>

#include "peftplan/common/atomic_file.h"
#include "peftplan/common/error.h"
#include "peftplan/common/schemas.h"
#include "peftplan/executor/calibrate.h"
#include "peftplan/executor/communicator.h"
#include "peftplan/executor/model.h"
#include "peftplan/executor/optim.h"
#include "peftplan/executor/plan_file.h"
#include "peftplan/executor/safetensors.h"
#include "peftplan/models/config.h"
#include "peftplan/planner/validate.h"
#include "peftplan/sim/compute.h"
#include "peftplan/sim/ops.h"
#include "peftplan/sim/verify.h"

namespace peftplan::executor {
namespace {

using sim::Kernel;
using sim::OpKind;
using sim::Phase;
using Clock = std::chrono::steady_clock;

inline std::uint64_t mix(std::uint64_t z) {  // SplitMix64 finaliser
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

bool is_gemm(Kernel k) {
  return k == Kernel::linear_fwd || k == Kernel::linear_bwd_data || k == Kernel::lora_fwd || k == Kernel::lora_bwd ||
         k == Kernel::attention_fwd || k == Kernel::attention_bwd;
}

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
static std::string read_file_bytes(const std::filesystem::path& p) {
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
  if (plan.run.data.empty()) throw InputError("plan.json: run.data names no token file (peftplan run --data FILE)");
  return TokenData::load(plan.run.data, parse_data_format(plan.run.data_format, "run.data_format"), plan.input.model.vocab,
                         plan.input.training.seq_len);
}

// ------------------------------------------------------------------------------------- state

struct Session::Impl {
  planner::PlanFile plan;
  Backend& be;
  TokenData data;
  Communicator* comm;
  sim::Program program;
  TrackedAllocator alloc;
  std::vector<void*> ptr;                       // by buffer id (views resolved on use)
  std::vector<std::int32_t> tokens_mb;          // by buffer id: micro-batch of a token buffer
  std::unordered_map<std::int32_t, const models::TrainableTensor*> adapter_views;  // view id -> tensor
  std::vector<models::TrainableTensor> trainables;
  std::vector<models::TensorInfo> base_tensors;  // the inventory's (Buffer::tensor indexes them)
  std::size_t first_step_op = 0;                // ops before it are setup
  std::int32_t trainable_flat = -1, grad_flat = -1;
  // ZeRO-3: this rank's adapter partition, and what each shard an all_gather reads holds (its
  // unit's adapter tensors at byte offsets in the gathered region), to assemble the whole
  // adapter (trainable_weights, save_adapter).
  bool zero3 = false;
  std::int32_t trainable_shard = -1;
  struct ShardLayout {
    std::int32_t shard = -1;
    std::vector<std::pair<const models::TrainableTensor*, std::uint64_t>> adapters;
  };
  std::vector<ShardLayout> shard_layouts;
  std::vector<float> full_adapter;              // the whole adapter (flat, inventory order)
  std::int32_t grad_shard = -1;                 // persistent gradient partition (ZeRO-2)
  std::int32_t opt_states = -1, host_params = -1;  // optimizer.states, optimizer.params (offload)
  std::int32_t rank = 0, N = 1;                 // this rank, data-parallel size
  // Collectives in flight on the communication thread, in issue order.
  struct Pending {
    std::unique_ptr<CommRequest> req;
    std::size_t op = 0;                         // program op index
    std::int32_t root = -1;                     // the payload's allocated buffer (views resolved)
    std::int32_t root_in = -1;                  // a ZeRO-3 gather's input (its shard, or the
                                                // staging buffer under parameter offload)
    std::function<void()> after;                // completion work (accumulating reduce_scatter)
  };
  std::deque<Pending> pending;
  CommCounters base_counters;                   // the communicator's counters when setup ended
  double watchdog_s = 30.0;                     // a collective waiting longer is a failed peer
  std::optional<std::pair<std::int64_t, std::size_t>> fault;  // injected failure (step, op)
  LrSchedule schedule;
  // Dimensions.
  std::int64_t B = 0, S = 0, M = 0, H = 0, I = 0, V = 0, nh = 0, nkv = 0, d = 0, A = 1;
  double count = 0.0;                           // target tokens of a step on all ranks
  // Step state.
  std::int64_t steps_done = 0;
  std::int64_t step_index = 0;                  // the step being run (data, dropout)
  double loss_sum = 0.0, sumsq = 0.0;
  bool have_norm = false;
  bool skipped = false;  // this step's update was skipped (a non-finite gradient norm)
  bool lr_logged = false;                       // the step's lr is recorded once (ZeRO-2 steps
                                                // bucket by bucket)
  // Measurement.
  std::vector<double> op_s;                     // by op: seconds summed over steps
  std::vector<double> last_start_s, last_dur_s; // by op: the last step's timeline
  std::vector<double> op_warm_s;                // by op: seconds summed over this session's
                                                //   steps after its first (compute, copies,
                                                //   collectives' execution on the comm thread)
  std::int64_t op_runs = 0;                     // run_ops calls of this session
  double exposed_warm_s = 0.0;                  // compute thread's waits on collectives, summed
                                                //   over the steps after the first
  std::vector<double> op_cur;                   // by op: this run_ops' seconds (as op_warm_s)
  double exposed_cur = 0.0;                     // this run_ops' waits on collectives
  struct StepOps {
    std::size_t step;                           // index into meas.step_times_s
    std::vector<double> op_s;
    double exposed_s;
  };
  std::deque<StepOps> ops_recent;               // the last planner::kSteadyWindow steps after the
                                                //   first: measurement() keeps the steady ones
  std::vector<std::int32_t> coll_ordinal;       // by op: its index among the step's collectives
  std::vector<std::int32_t> coll_ops;           // the step's collective ops in program order
  std::vector<double> coll_cur;                 // this step's execution seconds per collective
  std::deque<std::vector<double>> coll_recent;  // the last steps' (after the first), at most 32
  Measurement meas;

  Impl(const planner::PlanFile& p, Backend& b, TokenData tokens, Communicator* c, const SessionOptions& o)
      : plan(p), be(b), data(std::move(tokens)), comm(c), alloc(b.device_memory(), b.host_memory()), watchdog_s(o.watchdog_s),
        options(o) {}
  SessionOptions options;
  mutable std::once_flag named_once;  // buffer_label's named twin of `program`
  mutable sim::Program named;

  // Resolves a buffer id (view or not) to its memory.
  template <typename T = float>
  T* at(std::int32_t id) const {
    PEFTPLAN_CHECK(id >= 0);
    const sim::Buffer& buf = program.buffers[static_cast<std::size_t>(id)];
    if (buf.view_of >= 0) return reinterpret_cast<T*>(static_cast<std::byte*>(ptr[static_cast<std::size_t>(buf.view_of)]) + buf.offset);
    PEFTPLAN_CHECK_MSG(ptr[static_cast<std::size_t>(id)] != nullptr, "{} used while not allocated", buffer_label(id));
    return static_cast<T*>(ptr[static_cast<std::size_t>(id)]);
  }
  template <typename T = float>
  T* opt(std::int32_t id) const { return id < 0 ? nullptr : at<T>(id); }
  std::uint64_t bytes(std::int32_t id) const { return program.buffers[static_cast<std::size_t>(id)].bytes; }
  std::int64_t floats(std::int32_t id) const { return static_cast<std::int64_t>(bytes(id) / 4); }

  void setup();
  std::span<float> gather_adapter();
  void run_ops(bool update);
  void collective(std::size_t i, const sim::Op& op);
  void copy(const sim::Op& op);
  void wait(CommRequest& req, std::size_t i);
  void wait_through(std::size_t i);
  void wait_for_buffer(std::int32_t root);
  std::int32_t root_of(std::int32_t id) const {
    const auto v = program.buffers[static_cast<std::size_t>(id)].view_of;
    return v >= 0 ? v : id;
  }
  std::string op_name(std::size_t i) const;
  std::string buffer_label(std::int32_t id) const;
  // The mask of an adapter's dropout: a hash of the seed, the step, the GLOBAL micro-batch
  // (rank·A + a: the same sequences get the same mask on any number of ranks) and the adapter's
  // place among the inventory's LoRA modules (the op's, sim/ops.h Dropout; not a buffer id,
  // which differs between strategies).
  DropoutKey dropout_key(double p, std::int32_t adapter, std::int32_t micro_batch) const {
    PEFTPLAN_CHECK(adapter >= 0);
    const auto global_mb = static_cast<std::uint64_t>(rank) * static_cast<std::uint64_t>(A) + static_cast<std::uint64_t>(micro_batch);
    return {p, mix(plan.run.seed ^ mix(static_cast<std::uint64_t>(step_index) * 0x100000001b3ull + global_mb) ^
                   mix(static_cast<std::uint64_t>(adapter) + 0x51ed27ull))};
  }
  void alloc_op(std::size_t i, const sim::Op& op);
  void compute(const sim::Op& op);
  double finish_norm();
  std::string first_nonfinite(std::int32_t grad, double norm);
};

void Session::Impl::setup() {
  const planner::PlanInput& in = plan.input;
  planner::PlanInput pin = in;
  pin.inventory = nullptr;
  // Built without names: the interpreter finds what it needs by role and slot (sim/ops.h).
  program = planner::build_program(pin, {.names = false}).program;
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
  if (options.fault && options.fault->rank == rank) fault = {{options.fault->step, options.fault->op}};
  for (const auto& op : program.ops)
    if (op.kind == OpKind::compute && op.kernel == Kernel::embedding_fwd)
      tokens_mb[static_cast<std::size_t>(sim::ops::read<sim::ops::EmbeddingFwd>(program, op).tokens)] = op.micro_batch;
  // Files: the base checkpoint and the adapter, opened once (validated on open).
  std::optional<SafetensorsFile> ckpt, adapter_file;
  if (!plan.run.weights.empty()) ckpt = SafetensorsFile::open(plan.run.weights);
  if (plan.run.adapter_init != "peft") adapter_file = SafetensorsFile::open(plan.run.adapter_init);
  const DType storage = t.base_storage.value_or(DType::fp32);
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
      // Linear weights are stored in the base dtype; embeddings, norms and biases in fp32
      // (planner frozen_bytes).
      const DType dt = ti.role == models::ParamRole::linear_weight ? storage : DType::fp32;
      init_base_tensor(ti, dt, {static_cast<std::byte*>(p), buf.bytes}, plan.run.seed, ckpt ? &*ckpt : nullptr);
    } else {
      be.fill_zero(p, buf.bytes);
    }
  }
  first_step_op = i;
  if (zero3) {
    // Persistent small tensors (views of a unit's persistent buffer) are filled whole. Each
    // shard an all_gather reads is this rank's block of its unit's flattened region, cut from
    // the same seeded full tensors every rank would have (DeepSpeed's zero.Init partitions the
    // module's parameters the same way).
    std::vector<std::vector<std::int32_t>> views_of(nbuf);
    for (std::size_t b = 0; b < nbuf; ++b)
      if (program.buffers[b].view_of >= 0) views_of[static_cast<std::size_t>(program.buffers[b].view_of)].push_back(static_cast<std::int32_t>(b));
    auto init_base = [&](const models::TensorInfo& ti, std::byte* p, std::uint64_t n) {
      const DType dt = ti.role == models::ParamRole::linear_weight ? storage : DType::fp32;
      init_base_tensor(ti, dt, {p, n}, plan.run.seed, ckpt ? &*ckpt : nullptr);
    };
    for (std::size_t b = 0; b < nbuf; ++b) {
      const sim::Buffer& buf = program.buffers[b];
      if (buf.view_of < 0 || program.buffers[static_cast<std::size_t>(buf.view_of)].category != sim::MemCategory::base_weights) continue;
      if (const models::TensorInfo* tp = tensor_of(buf)) init_base(*tp, at<std::byte>(static_cast<std::int32_t>(b)), buf.bytes);
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
          init_adapter_tensor(*tt, {reinterpret_cast<float*>(full.data() + off), static_cast<std::size_t>(tt->numel())}, plan.run.seed,
                              adapter_file ? &*adapter_file : nullptr);
          layout.adapters.emplace_back(tt, off);
        }
      }
      be.copy_to_device(at<std::byte>(shard), full.data() + static_cast<std::uint64_t>(rank) * bytes(shard), bytes(shard));
      if (!layout.adapters.empty()) shard_layouts.push_back(std::move(layout));
    }
  }
  for (std::size_t b = 0; b < nbuf; ++b)
    if (program.buffers[b].role == sim::BufferRole::grad_shard && ptr[b] != nullptr) grad_shard = static_cast<std::int32_t>(b);
  for (const auto& [id, tt] : adapter_views)
    init_adapter_tensor(*tt, {at(id), static_cast<std::size_t>(tt->numel())}, plan.run.seed,
                        adapter_file ? &*adapter_file : nullptr);
  if (comm) base_counters = comm->counters();
  // The offloaded step's host copy of this rank's partition: the step's param_h2d copies run
  // backwards (ZeRO-2 has one per bucket, from a view of optimizer.params into its region).
  if (host_params >= 0)
    for (std::size_t k = first_step_op; k < program.ops.size(); ++k) {
      const sim::Op& op = program.ops[k];
      if (op.kind != OpKind::copy || op.copy_dir != sim::CopyDir::host_to_device || root_of(op.buffer) != host_params) continue;
      auto block = [&](std::int32_t id) {
        auto* p = at<std::byte>(id);
        return bytes(id) == op.bytes ? p : p + static_cast<std::uint64_t>(rank) * op.bytes;
      };
      be.copy_to_host(block(op.buffer), block(op.buffer_out), op.bytes);
    }
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

void Session::Impl::alloc_op(std::size_t i, const sim::Op& op) {
  const auto b = static_cast<std::size_t>(op.buffer);
  const sim::Buffer& buf = program.buffers[b];
  ptr[b] = alloc.allocate(buf.bytes, buf.category, static_cast<std::int32_t>(i));
  // Gradient buffers start at zero: kernels add into them (lora_bwd), and a bucket's padding
  // must reduce to zero.
  if (buf.category == sim::MemCategory::gradients) be.fill_zero(ptr[b], buf.bytes);
  if (tokens_mb[b] >= 0) {  // the data loader fills a micro-batch's tokens and targets
    auto* tok = static_cast<std::int32_t*>(ptr[b]);
    PEFTPLAN_CHECK(buf.bytes == 8ull * static_cast<std::uint64_t>(M));
    data.micro_batch(step_index, rank, N, tokens_mb[b], A, B, {tok, static_cast<std::size_t>(M)},
                     {tok + M, static_cast<std::size_t>(M)});
  }
}

double Session::Impl::finish_norm() {
  PEFTPLAN_CHECK_MSG(have_norm, "the program computes no gradient norm before the optimizer step");
  return global_grad_norm(sumsq);
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

// Waits for a collective with a watchdog: a peer that died or stopped calling collectives
// leaves this rank waiting, and after watchdog_s the wait becomes an error naming the op (main
// then ends the job with MPI_Abort).
void Session::Impl::wait(CommRequest& req, std::size_t i) {
  const auto t0 = Clock::now();
  const bool was_done = req.done();
  for (int spin = 0; !req.done(); ++spin) {
    if (spin > 1000) std::this_thread::sleep_for(std::chrono::microseconds(200));
    if (std::chrono::duration<double>(Clock::now() - t0).count() > watchdog_s)
      throw CommError(fmt::format("rank {}: {} waited more than {:.0f} s for its peers (a rank failed or stopped)", rank,
                                  op_name(i), watchdog_s));
  }
  req.wait();  // rethrows the operation's error
  if (op_runs > 0 && !was_done) {
    const double waited = std::chrono::duration<double>(Clock::now() - t0).count();
    exposed_warm_s += waited;
    exposed_cur += waited;
  }
  if (const double t = req.seconds(); t >= 0.0 && op_runs > 0) {
    op_warm_s[i] += t;
    if (i < op_cur.size()) op_cur[i] += t;  // (a collective outside the step ops has no slot)
    if (i < coll_ordinal.size() && coll_ordinal[i] >= 0) coll_cur[static_cast<std::size_t>(coll_ordinal[i])] = t;
  }
}

void Session::Impl::wait_through(std::size_t i) {
  while (!pending.empty() && pending.front().op <= i) {
    Pending p = std::move(pending.front());
    pending.pop_front();
    wait(*p.req, p.op);
    if (p.after) p.after();
  }
}

void Session::Impl::wait_for_buffer(std::int32_t root) {
  std::size_t last = 0;
  bool any = false;
  for (const Pending& p : pending)
    if (p.root == root || p.root_in == root) {
      last = p.op;
      any = true;
    }
  if (any) wait_through(last);
}

// A collective of the program: the payload (Op::buffer, a view or a buffer) is the whole array
// of nccl-tests "size" Op::bytes; buffer -1 names the step's scalars (the loss sum, the squared
// gradient norm), all-reduced as one fp64. Array collectives run asynchronously; compute ops that
// depend on them, and frees of their buffers, wait.
void Session::Impl::collective(std::size_t i, const sim::Op& op) {
  if (N == 1 && comm == nullptr) {  // one rank, no communicator: a ZeRO-3 gather is a copy of the shard
    if (op.collective == sim::Collective::all_gather && op.buffer_in >= 0)
      be.copy_to_device(at<std::byte>(op.buffer), at<std::byte>(op.buffer_in), bytes(op.buffer_in));
    return;
  }
  PEFTPLAN_CHECK_MSG(comm != nullptr && comm->size() == N, "a {}-rank program needs a communicator of {} ranks", N, N);
  if (op.buffer < 0) {  // a scalar reduction (sim::verify: an 8-byte all_reduce)
    double* v = op.reduction == sim::ScalarReduction::loss_sum ? &loss_sum : op.reduction == sim::ScalarReduction::grad_sumsq ? &sumsq : nullptr;
    PEFTPLAN_CHECK_MSG(v != nullptr, "{} reduces no scalar the executor knows", op_name(i));
    wait_through(i);
    auto req = comm->all_reduce_async(v, v, 1, CommDType::fp64, ReduceOp::sum);
    wait(*req, i);
    return;
  }
  PEFTPLAN_CHECK_MSG(bytes(op.buffer) == op.bytes, "{}: payload {} bytes, op {} bytes", op_name(i), bytes(op.buffer), op.bytes);
  float* p = at(op.buffer);
  const std::size_t n = op.bytes / 4;
  Pending pd;
  pd.op = i;
  pd.root = root_of(op.buffer);
  switch (op.collective) {
    case sim::Collective::all_reduce:
      pd.req = comm->all_reduce_async(p, p, n, CommDType::fp32, ReduceOp::sum);
      break;
    case sim::Collective::reduce_scatter: {
      const std::size_t rc = n / static_cast<std::size_t>(N);
      float* mine = p + static_cast<std::size_t>(rank) * rc;
      if (op.buffer_out >= 0) PEFTPLAN_CHECK(static_cast<std::size_t>(floats(op.buffer_out)) == rc);
      if (op.buffer_out >= 0 && !op.accumulate) {
        pd.req = comm->reduce_scatter_async(p, at(op.buffer_out), rc, CommDType::fp32, ReduceOp::sum);
      } else {
        pd.req = comm->reduce_scatter_async(p, mine, rc, CommDType::fp32, ReduceOp::sum);
        if (op.buffer_out >= 0) {
          const std::int32_t out = op.buffer_out;
          pd.after = [this, out, mine, rc] { be.add(at(out), mine, at(out), static_cast<std::int64_t>(rc)); };
        }
      }
      break;
    }
    case sim::Collective::all_gather: {
      if (op.buffer_in >= 0) {  // ZeRO-3: this rank's shard into block `rank` of the payload
        PEFTPLAN_CHECK(bytes(op.buffer_in) * static_cast<std::uint64_t>(N) == op.bytes);
        pd.root_in = root_of(op.buffer_in);
        pd.req = comm->all_gather_async(at<std::byte>(op.buffer_in), at<std::byte>(op.buffer), bytes(op.buffer_in), CommDType::uint8);
        break;
      }
      const std::size_t sc = n / static_cast<std::size_t>(N);
      pd.req = comm->all_gather_async(p + static_cast<std::size_t>(rank) * sc, p, sc, CommDType::fp32);
      break;
    }
    case sim::Collective::broadcast:
      throw InternalError(fmt::format("the executor's programs have no broadcast ({})", op_name(i)));
  }
  pending.push_back(std::move(pd));
}

// A copy between device and host buffers (optimizer offload): Op::buffer to Op::buffer_out; a
// side N times the copy's bytes contributes this rank's block.
void Session::Impl::copy(const sim::Op& op) {
  PEFTPLAN_CHECK_MSG(op.buffer >= 0 && op.buffer_out >= 0, "a copy of the executor's program names no source or destination");
  auto block = [&](std::int32_t id) {
    auto* p = at<std::byte>(id);
    if (bytes(id) == op.bytes) return p;
    PEFTPLAN_CHECK(bytes(id) == op.bytes * static_cast<std::uint64_t>(N));
    return p + static_cast<std::uint64_t>(rank) * op.bytes;
  };
  if (op.copy_dir == sim::CopyDir::device_to_host) be.copy_to_host(block(op.buffer_out), block(op.buffer), op.bytes);
  else be.copy_to_device(block(op.buffer_out), block(op.buffer), op.bytes);
}

// One compute op: the kernel its Op::kernel names on the operands, shape and scalars the op
// carries (sim/ops.h). The shapes the backend gets are the op's; a few are also the session's
// (the attention's batch and heads), which verify's size rule has tied to the buffers.
void Session::Impl::compute(const sim::Op& op) {
  namespace ops = sim::ops;
  switch (op.kernel) {
    case Kernel::embedding_fwd: {
      const auto o = ops::read<ops::EmbeddingFwd>(program, op);
      be.embedding_forward(at<std::int32_t>(o.tokens), at(o.table), at(o.out), o.M, o.V, o.H);
      return;
    }
    case Kernel::norm_fwd: {
      const auto o = ops::read<ops::NormFwd>(program, op);
      be.rmsnorm_forward(at(o.x), at(o.w), static_cast<float>(o.eps), at(o.y), at(o.rstd), o.M, o.H);
      return;
    }
    case Kernel::norm_bwd: {
      const auto o = ops::read<ops::NormBwd>(program, op);
      be.rmsnorm_backward(at(o.dy), at(o.x), at(o.w), at(o.rstd), at(o.dx), o.M, o.H, op.accumulate);
      return;
    }
    case Kernel::cast: {
      const auto o = ops::read<ops::Cast>(program, op);
      if (o.from == DType::bf16 && o.to == DType::fp32) be.bf16_to_fp32(at<std::uint16_t>(o.src), at(o.dst), o.n);
      else if (o.from == o.to) be.copy_device(at<std::byte>(o.dst), at<std::byte>(o.src), storage_bytes(o.to, o.n));
      else throw InternalError(fmt::format("the executor has no cast from {} to {} ({})", name_of(o.from), name_of(o.to), op.label));
      return;
    }
    case Kernel::linear_fwd: {
      const auto o = ops::read<ops::LinearFwd>(program, op);
      be.linear_forward(at(o.x), at(o.w), opt(o.bias), at(o.y), o.M, o.K, o.N, op.accumulate);
      return;
    }
    case Kernel::linear_bwd_data: {
      const auto o = ops::read<ops::LinearBwdData>(program, op);
      be.linear_backward_input(at(o.dy), at(o.w), at(o.dx), o.M, o.K, o.N, op.accumulate);
      return;
    }
    case Kernel::dropout: {
      const auto o = ops::read<ops::Dropout>(program, op);
      be.dropout_forward(at(o.x), at(o.out), o.n, dropout_key(o.p, o.adapter, op.micro_batch));
      return;
    }
    case Kernel::lora_fwd: {
      const auto o = ops::read<ops::LoraFwd>(program, op);
      be.lora_forward(at(o.x_in), at(o.a), at(o.b), static_cast<float>(o.scale), at(o.u), at(o.y), o.M, o.K, o.N, o.r);
      return;
    }
    case Kernel::lora_bwd: {
      const auto o = ops::read<ops::LoraBwd>(program, op);
      const DropoutKey key = o.p > 0.0 ? dropout_key(o.p, o.adapter, op.micro_batch) : DropoutKey{};
      be.lora_backward(at(o.dy), at(o.x_in), at(o.a), at(o.b), at(o.u), static_cast<float>(o.scale), key, at(o.da), at(o.db), opt(o.dx),
                       at(o.scratch), o.M, o.K, o.N, o.r);
      return;
    }
    case Kernel::rope_tables: {
      const auto o = ops::read<ops::RopeTables>(program, op);
      be.rope_tables(at(o.tables), o.S, o.d, o.theta);
      return;
    }
    case Kernel::rope_fwd: {
      const auto o = ops::read<ops::RopeFwd>(program, op);
      be.rope_forward(at(o.q), at(o.tables), o.B, o.S, o.nh, o.d);
      be.rope_forward(at(o.k), at(o.tables), o.B, o.S, o.nkv, o.d);
      return;
    }
    case Kernel::rope_bwd: {
      const auto o = ops::read<ops::RopeBwd>(program, op);
      be.rope_backward(at(o.q), at(o.tables), o.B, o.S, o.nh, o.d);
      be.rope_backward(at(o.k), at(o.tables), o.B, o.S, o.nkv, o.d);
      return;
    }
    case Kernel::attention_fwd: {
      const auto o = ops::read<ops::AttentionFwd>(program, op);
      be.attention_forward(at(o.q), at(o.k), at(o.v), at(o.probs), at(o.out), o.B, o.S, o.nh, o.nkv, o.d);
      return;
    }
    case Kernel::attention_bwd: {
      const auto o = ops::read<ops::AttentionBwd>(program, op);
      be.attention_backward(at(o.d_out), at(o.q), at(o.k), at(o.v), at(o.probs), at(o.dq), at(o.dk), at(o.dv), at(o.scratch),
                            floats(o.scratch), o.B, o.S, o.nh, o.nkv, o.d);
      return;
    }
    case Kernel::residual_add: {
      const auto o = ops::read<ops::ResidualAdd>(program, op);
      if (o.out >= 0) be.add(at(o.a), at(o.b), at(o.out), o.n);
      return;
    }
    case Kernel::mlp_act_fwd: {
      const auto o = ops::read<ops::MlpActFwd>(program, op);
      be.swiglu_forward(at(o.gate), at(o.up), at(o.act), o.n);
      return;
    }
    case Kernel::mlp_act_bwd: {
      const auto o = ops::read<ops::MlpActBwd>(program, op);
      be.swiglu_backward(at(o.d_act), at(o.gate), at(o.up), at(o.d_gate), at(o.d_up), o.n);
      return;
    }
    case Kernel::cross_entropy_fwd: {  // the targets follow the ids in the tokens buffer
      const auto o = ops::read<ops::CrossEntropyFwd>(program, op);
      loss_sum += be.cross_entropy_forward(at(o.logits), at<std::int32_t>(o.tokens) + o.M, o.M, o.V);
      return;
    }
    case Kernel::cross_entropy_bwd: {
      const auto o = ops::read<ops::CrossEntropyBwd>(program, op);
      be.cross_entropy_backward(at(o.logits), at<std::int32_t>(o.tokens) + o.M, at(o.d_logits), o.divisor, o.M, o.V);
      return;
    }
    case Kernel::grad_norm: {  // this rank's partition; a grad_sumsq all_reduce may follow
      const auto o = ops::read<ops::GradNorm>(program, op);
      sumsq = be.sum_squares(at(o.grads), floats(o.grads));
      have_norm = true;
      return;
    }
    case Kernel::optimizer_step: {
      const auto o = ops::read<ops::OptimizerStep>(program, op);
      const auto& t = plan.input.training;
      const double norm = finish_norm();
      if (!std::isfinite(norm)) {  // the all-reduced norm: every rank takes the same branch
        if (plan.run.on_nonfinite == "skip") {
          if (!skipped) ++meas.skipped_steps;
          skipped = true;
          return;  // weights and optimizer states stay as they were
        }
        throw NonFiniteError(first_nonfinite(o.grads, norm));
      }
      const std::int64_t n = o.n;
      float* params = at(o.params);
      if (floats(o.params) != n) {  // this rank's block of trainable.flat
        PEFTPLAN_CHECK(floats(o.params) == n * N);
        params += static_cast<std::int64_t>(rank) * n;
      }
      if (t.grad_clip > 0.0) {
        const double coef = clip_coefficient(norm, t.grad_clip);
        if (coef < 1.0) be.scale(at(o.grads), static_cast<float>(coef), n);
      }
      const std::int64_t step1 = step_index + 1;
      const double lr = lr_for_step(schedule, t.lr, step1);
      if (!lr_logged) meas.lrs.push_back(lr);
      lr_logged = true;
      be.adamw_step(params, at(o.grads), at(o.states), at(o.states) + n, n, step1, lr, t.adam_beta1, t.adam_beta2, t.adam_eps,
                    t.weight_decay);
      return;
    }
    case Kernel::embedding_bwd:
    case Kernel::linear_bwd_weight:
    case Kernel::accumulate:
    case Kernel::none:
      break;
  }
  throw InternalError(fmt::format("the executor has no kernel for {} ({})", sim::name_of(op.kernel), op.label));
}

// The message of a non-finite step: the norm, the loss so far and the first gradient element that
// is not finite in this rank's gradient buffer, named by the program's view that holds it.
std::string Session::Impl::first_nonfinite(std::int32_t grad, double norm) {
  const float* g = at(grad);
  const std::int64_t n = floats(grad);
  std::int64_t bad = -1;
  for (std::int64_t i = 0; i < n && bad < 0; ++i)
    if (!std::isfinite(g[i])) bad = i;
  std::string where = "no element of this rank's gradients (another rank's shard holds it)";
  if (bad >= 0) {
    where = fmt::format("element {} of {}", bad, buffer_label(grad));
    const std::uint64_t byte = static_cast<std::uint64_t>(bad) * sizeof(float);
    for (std::size_t v = 0; v < program.buffers.size(); ++v) {
      const sim::Buffer& b = program.buffers[v];
      if (b.view_of == grad && b.role == sim::BufferRole::adapter_grad && b.offset <= byte && byte < b.offset + b.bytes) {
        where = fmt::format("{} (element {} of {})", buffer_label(static_cast<std::int32_t>(v)), bad, buffer_label(grad));
        break;
      }
    }
  }
  return fmt::format("step {}: the gradient norm is {} (loss so far {}); the first non-finite gradient is {}. "
                     "Lower the learning rate, clip gradients (run.clip), or run with --on-nonfinite skip",
                     step_index + 1, norm, count > 0 ? loss_sum / count : loss_sum, where);
}

void Session::Impl::run_ops(bool update) {
  // optimizer.zero_grad()
  if (grad_flat >= 0) be.fill_zero(at(grad_flat), bytes(grad_flat));
  if (grad_shard >= 0) be.fill_zero(at(grad_shard), bytes(grad_shard));
  loss_sum = 0.0;
  have_norm = false;
  skipped = false;
  lr_logged = false;
  if (op_runs > 0) {
    op_cur.assign(program.ops.size(), 0.0);
    exposed_cur = 0.0;
  }
  const auto t0 = Clock::now();
  for (std::size_t i = first_step_op; i < program.ops.size(); ++i) {
    const sim::Op& op = program.ops[i];
    if (fault && fault->first == step_index && fault->second == i)
      throw InternalError(fmt::format("rank {}: injected fault (PEFTPLAN_FAULT) at step {}, {}", rank, step_index, op_name(i)));
    if (!update && op.phase == Phase::optimizer) {  // forward_backward: no update, no step
      if (op.kind == OpKind::free && ptr[static_cast<std::size_t>(op.buffer)] == nullptr) continue;
      if (op.kind != OpKind::alloc && op.kind != OpKind::free) continue;
    }
    switch (op.kind) {
      case OpKind::alloc: alloc_op(i, op); break;
      case OpKind::free:
        wait_for_buffer(op.buffer);
        alloc.release(ptr[static_cast<std::size_t>(op.buffer)]);
        ptr[static_cast<std::size_t>(op.buffer)] = nullptr;
        break;
      case OpKind::collective:
        try {
          collective(i, op);
        } catch (const CommError&) {
          throw;  // the watchdog's and MPI's errors name the rank and op already
        } catch (const std::exception& e) {
          throw InternalError(fmt::format("rank {}: {}: {}", rank, op_name(i), e.what()));
        }
        break;
      case OpKind::copy: {
        wait_through(i);
        const auto s = Clock::now();
        copy(op);
        if (op_runs > 0) {
          const double dur = std::chrono::duration<double>(Clock::now() - s).count();
          op_warm_s[i] += dur;
          op_cur[i] += dur;
        }
        break;
      }
      case OpKind::compute: {
        for (std::int32_t dep : program.deps_of(op))
          if (program.ops[static_cast<std::size_t>(dep)].kind == OpKind::collective) wait_through(static_cast<std::size_t>(dep));
        const auto s = Clock::now();
        compute(op);
        be.synchronize();
        const auto e = Clock::now();
        const double dur = std::chrono::duration<double>(e - s).count();
        op_s[i] += dur;
        if (op_runs > 0) {
          op_warm_s[i] += dur;
          op_cur[i] += dur;
        }
        last_start_s[i] = std::chrono::duration<double>(s - t0).count();
        last_dur_s[i] = dur;
        if (is_gemm(op.kernel)) {
          meas.gemm_s += dur;
          meas.gemm_flops += op.work.flops;
        }
        break;
      }
    }
  }
  if (!pending.empty()) wait_through(pending.back().op);
  if (op_runs > 0 && !coll_ops.empty()) {
    coll_recent.push_back(coll_cur);
    if (coll_recent.size() > planner::kSteadyWindow) coll_recent.pop_front();
  }
  std::fill(coll_cur.begin(), coll_cur.end(), 0.0);
  ++op_runs;
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

StepStats Session::step() {
  Impl& s = *impl_;
  const auto t0 = Clock::now();
  s.step_index = s.steps_done;
  s.run_ops(true);
  StepStats st;
  st.step = ++s.steps_done;
  st.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  st.loss = s.loss_sum / s.count;
  st.grad_norm = global_grad_norm(s.sumsq);
  st.lr = s.meas.lrs.empty() ? 0.0 : s.meas.lrs.back();
  s.meas.losses.push_back(st.loss);
  s.meas.grad_norms.push_back(st.grad_norm);
  if (s.op_runs > 1) {  // not the session's first run of the ops (warm-up)
    s.ops_recent.push_back({s.meas.step_times_s.size(), std::move(s.op_cur), s.exposed_cur});
    if (s.ops_recent.size() > planner::kSteadyWindow) s.ops_recent.pop_front();
  }
  s.meas.step_times_s.push_back(st.seconds);
  return st;
}

double Session::forward_backward(std::int64_t step_index) {
  Impl& s = *impl_;
  s.step_index = step_index;
  s.run_ops(false);
  return s.loss_sum / s.count;
}

// ZeRO-3: the whole adapter, all_gathered from the ranks' shards (a collective outside the
// step: its bytes are not counted in the step's measurement).
std::span<float> Session::Impl::gather_adapter() {
  std::unordered_map<std::string, std::int64_t> flat_offset;
  std::int64_t total = 0;
  for (const auto& tt : trainables) {
    flat_offset[tt.name] = total;
    total += tt.numel();
  }
  full_adapter.assign(static_cast<std::size_t>(total), 0.0f);
  const CommCounters before = comm ? comm->counters() : CommCounters{};
  for (const ShardLayout& l : shard_layouts) {
    std::vector<std::byte> region(bytes(l.shard) * static_cast<std::uint64_t>(N));
    if (N > 1) comm->all_gather(at<std::byte>(l.shard), region.data(), bytes(l.shard), CommDType::uint8);
    else std::memcpy(region.data(), at<std::byte>(l.shard), bytes(l.shard));
    for (const auto& [tt, off] : l.adapters)
      std::memcpy(full_adapter.data() + flat_offset.at(tt->name), region.data() + off, 4 * static_cast<std::size_t>(tt->numel()));
  }
  if (comm) {
    const CommCounters after = comm->counters();
    for (std::size_t k = 0; k < after.by_kind.size(); ++k) {
      base_counters.by_kind[k].calls += after.by_kind[k].calls - before.by_kind[k].calls;
      base_counters.by_kind[k].bytes += after.by_kind[k].bytes - before.by_kind[k].bytes;
      base_counters.by_kind[k].seconds += after.by_kind[k].seconds - before.by_kind[k].seconds;
    }
  }
  return full_adapter;
}
std::span<float> Session::trainable_weights() {
  Impl& s = *impl_;
  if (s.zero3) return s.gather_adapter();
  // ZeRO-2's bucket-partitioned trainable.flat keeps padding between buckets: the adapter in
  // inventory order is a copy.
  std::int64_t natural = 0;
  bool in_place = true;
  for (const auto& tt : s.trainables) {
    for (const auto& [id, t] : s.adapter_views)
      if (t == &tt && s.program.buffers[static_cast<std::size_t>(id)].offset != 4 * static_cast<std::uint64_t>(natural)) in_place = false;
    natural += tt.numel();
  }
  if (!in_place) {
    s.full_adapter.assign(static_cast<std::size_t>(natural), 0.0f);
    std::size_t off = 0;
    for (const auto& tt : s.trainables) {
      for (const auto& [id, t] : s.adapter_views)
        if (t == &tt) std::memcpy(s.full_adapter.data() + off, s.at(id), 4 * static_cast<std::size_t>(tt.numel()));
      off += static_cast<std::size_t>(tt.numel());
    }
    return s.full_adapter;
  }
  return {impl_->at(impl_->trainable_flat), static_cast<std::size_t>(impl_->floats(impl_->trainable_flat))};
}
std::span<const float> Session::gradients() const {
  PEFTPLAN_CHECK_MSG(impl_->grad_flat >= 0, "this strategy keeps no full gradient buffer");
  return {impl_->at(impl_->grad_flat), static_cast<std::size_t>(impl_->floats(impl_->grad_flat))};
}
std::int64_t Session::steps_done() const { return impl_->steps_done; }

// ------------------------------------------------------------------------------- checkpoints
//
// <checkpoint_dir>/step-<k>/ holds adapter_model.safetensors + adapter_config.json (the whole
// adapter, as every rank has it after the step; under ZeRO-3 all_gathered from the ranks'
// shards first, outside the step's counted collectives), optimizer.rank<r>.bin (rank r's
// optimizer states, then its host parameter copy under offload: a header of two uint64 element
// counts, then fp32), and trainer_state.json (step, data position, seed, ranks, strategy).
// ZeRO-3 adds trainable.rank<r>.bin: rank r's adapter partition exactly as trainable.shard
// holds it (its block of every unit's flattened, padded adapter, in unit order; a header of one
// uint64 element count, then fp32). Resume restores each rank's partition from it bit for bit
// (not from the adapter file, whose tensors do not carry the padding); the frozen shards are
// not trained and are rebuilt from the seed or the weights file as at the start. Ranks write
// into step-<k>.tmp/, rank 0 renames it to step-<k> and then rewrites <checkpoint_dir>/latest
// (temporary name, then rename): a crash leaves the previous checkpoint whole.
// The data position is the step (step k reads global sequences k·G …); dropout masks are a
// counter-based hash of (seed, step, micro-batch, adapter), so the seed and the step are all the
// random state there is.

void Session::save_checkpoint(const std::filesystem::path& dir) const {
  namespace fs = std::filesystem;
  Impl& s = *impl_;
  if (s.zero3) s.gather_adapter();  // a collective: every rank, before rank 0 writes the adapter
  const std::string name = fmt::format("step-{}", s.steps_done);
  const fs::path tmp = dir / (name + ".tmp"), final_dir = dir / name;
  if (s.rank == 0) {
    fs::create_directories(dir);
    fs::remove_all(tmp);
    fs::create_directories(tmp);
  }
  if (s.comm) s.comm->barrier();
  {
    const std::uint64_t ns = static_cast<std::uint64_t>(s.floats(s.opt_states));
    const std::uint64_t np = s.host_params >= 0 ? static_cast<std::uint64_t>(s.floats(s.host_params)) : 0;
    std::string blob(16 + 4 * (ns + np), '\0');
    std::memcpy(blob.data(), &ns, 8);
    std::memcpy(blob.data() + 8, &np, 8);
    std::memcpy(blob.data() + 16, s.at(s.opt_states), 4 * ns);
    if (np) std::memcpy(blob.data() + 16 + 4 * ns, s.at(s.host_params), 4 * np);
    write_text_atomic(tmp / fmt::format("optimizer.rank{}.bin", s.rank), blob);
    if (s.zero3) {
      const std::uint64_t nt = static_cast<std::uint64_t>(s.floats(s.trainable_shard));
      std::string shard(8 + 4 * nt, '\0');
      std::memcpy(shard.data(), &nt, 8);
      std::memcpy(shard.data() + 8, s.at(s.trainable_shard), 4 * nt);
      write_text_atomic(tmp / fmt::format("trainable.rank{}.bin", s.rank), shard);
    }
  }
  if (s.comm) s.comm->barrier();
  if (s.rank == 0) {
    save_adapter(tmp);
    const auto& t = s.plan.input.training;
    // A checksum of every file (every rank's are written by now): resume verifies them, so a
    // corrupt or partial checkpoint is refused rather than loaded.
    nlohmann::json files = nlohmann::json::object();
    for (const auto& e : fs::directory_iterator(tmp))
      if (e.is_regular_file()) files[e.path().filename().string()] = models::sha256_hex(read_file_bytes(e.path()));
    const nlohmann::json state = {{"schema", schemas::kCheckpoint},
                                  {"sha256", files},
                                  {"step", s.steps_done},
                                  {"next_sequence", s.steps_done * t.micro_batch * t.grad_accum * s.N},
                                  {"seed", s.plan.run.seed},
                                  {"ranks", s.N},
                                  {"strategy", planner::name_of(s.plan.input.strategy.stage)},
                                  {"offload_optimizer", s.host_params >= 0}};
    write_text_atomic(tmp / "trainer_state.json", state.dump(1) + "\n");
    replace_directory(tmp, final_dir);
    write_text_atomic(dir / "latest", name + "\n");
  }
  if (s.comm) s.comm->barrier();
}

// A checkpoint folder's files against the checksums its trainer_state.json records: "" when they
// all match, else what is wrong, naming the file.
static std::string checkpoint_problem(const std::filesystem::path& dir) {
  namespace fs = std::filesystem;
  if (!fs::exists(dir / "trainer_state.json")) return fmt::format("{}/trainer_state.json: missing (a partial checkpoint)", dir.string());
  const nlohmann::json st = nlohmann::json::parse(std::ifstream(dir / "trainer_state.json"), nullptr, false);
  if (st.is_discarded() || !st.contains("step")) return fmt::format("{}/trainer_state.json: not a peftplan checkpoint", dir.string());
  if (!st.contains("sha256") || !st["sha256"].is_object())
    return fmt::format("{}/trainer_state.json: sha256 is missing (a checkpoint without checksums cannot be verified)", dir.string());
  for (const auto& [name, want] : st["sha256"].items()) {
    const fs::path f = dir / name;
    if (!fs::is_regular_file(f)) return fmt::format("{}: missing (the checkpoint is partial)", f.string());
    if (!want.is_string() || models::sha256_hex(read_file_bytes(f)) != want.get<std::string>())
      return fmt::format("{}: its SHA-256 differs from trainer_state.json's (the file is corrupt)", f.string());
  }
  return "";
}

void Session::resume(const std::filesystem::path& where_in) {
  namespace fs = std::filesystem;
  Impl& s = *impl_;
  // "<dir>/latest-good": the newest step-<k> folder of <dir> whose files all verify.
  fs::path where = where_in;
  std::string skipped;
  if (where.filename() == "latest-good") {
    const fs::path base = where.parent_path();
    std::vector<std::pair<std::int64_t, fs::path>> steps;
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(base, ec)) {
      const std::string n = e.path().filename().string();
      if (e.is_directory() && n.rfind("step-", 0) == 0 && n.find(".tmp") == std::string::npos) {
        try {
          steps.push_back({std::stoll(n.substr(5)), e.path()});
        } catch (const std::exception&) {
        }
      }
    }
    std::sort(steps.rbegin(), steps.rend());
    std::optional<fs::path> good;
    for (const auto& [k, d] : steps) {
      const std::string problem = checkpoint_problem(d);
      if (problem.empty()) {
        good = d;
        break;
      }
      skipped += (skipped.empty() ? "" : "; ") + problem;
    }
    if (!good) throw InputError(fmt::format("{}: no checkpoint under {} verifies{}", where.string(), base.string(), skipped.empty() ? "" : ": " + skipped));
    where = *good;
  }
  fs::path dir = where;
  if (!fs::exists(dir / "trainer_state.json") && fs::exists(dir / "latest")) {
    std::ifstream f(dir / "latest");
    std::string name;
    f >> name;
    dir /= name;
  }
  if (!fs::exists(dir / "trainer_state.json"))
    throw InputError(fmt::format("{}: no checkpoint here (no trainer_state.json, no latest)", where.string()));
  if (const std::string problem = checkpoint_problem(dir); !problem.empty())
    throw InputError(problem + "; resume from <checkpoint_dir>/latest-good to fall back to the newest checkpoint that verifies");
  const nlohmann::json st = nlohmann::json::parse(std::ifstream(dir / "trainer_state.json"), nullptr, false);
  auto same = [&](const char* key, const nlohmann::json& want) {
    if (st.value(key, nlohmann::json()) != want)
      throw InputError(fmt::format("{}/trainer_state.json: {} is {}, this run has {}", dir.string(), key, st.value(key, nlohmann::json()).dump(),
                                   want.dump()));
  };
  same("ranks", s.N);
  same("strategy", std::string(planner::name_of(s.plan.input.strategy.stage)));
  same("seed", s.plan.run.seed);
  same("offload_optimizer", s.host_params >= 0);
  const SafetensorsFile adapter = SafetensorsFile::open(dir / "adapter_model.safetensors");
  for (const auto& [id, tt] : s.adapter_views)
    init_adapter_tensor(*tt, {s.at(id), static_cast<std::size_t>(tt->numel())}, s.plan.run.seed, &adapter);
  const fs::path opt = dir / fmt::format("optimizer.rank{}.bin", s.rank);
  std::ifstream f(opt, std::ios::binary);
  std::uint64_t ns = 0, np = 0;
  f.read(reinterpret_cast<char*>(&ns), 8);
  f.read(reinterpret_cast<char*>(&np), 8);
  const std::uint64_t want_np = s.host_params >= 0 ? static_cast<std::uint64_t>(s.floats(s.host_params)) : 0;
  if (!f || ns != static_cast<std::uint64_t>(s.floats(s.opt_states)) || np != want_np)
    throw InputError(fmt::format("{}: optimizer states of another shape (or missing)", opt.string()));
  f.read(reinterpret_cast<char*>(s.at(s.opt_states)), static_cast<std::streamsize>(4 * ns));
  if (np) f.read(reinterpret_cast<char*>(s.at(s.host_params)), static_cast<std::streamsize>(4 * np));
  if (!f) throw InputError(fmt::format("{}: truncated", opt.string()));
  if (s.zero3) {  // this rank's adapter partition, padding included
    const fs::path tp = dir / fmt::format("trainable.rank{}.bin", s.rank);
    std::ifstream tf(tp, std::ios::binary);
    std::uint64_t nt = 0;
    tf.read(reinterpret_cast<char*>(&nt), 8);
    if (!tf || nt != static_cast<std::uint64_t>(s.floats(s.trainable_shard)))
      throw InputError(fmt::format("{}: adapter partition of another shape (or missing)", tp.string()));
    tf.read(reinterpret_cast<char*>(s.at(s.trainable_shard)), static_cast<std::streamsize>(4 * nt));
    if (!tf) throw InputError(fmt::format("{}: truncated", tp.string()));
  }
  s.steps_done = st.at("step").get<std::int64_t>();
}
const sim::Program& Session::program() const { return impl_->program; }
const MemoryStats& Session::memory() const { return impl_->alloc.stats(); }

Measurement Session::measurement() const {
  const Impl& s = *impl_;
  Measurement m = s.meas;
  m.memory = s.alloc.stats();
  auto op_name = [&](std::int32_t i) -> std::string {
    if (i < 0) return "";
    const auto& op = s.program.ops[static_cast<std::size_t>(i)];
    return op.buffer >= 0 ? "alloc " + s.buffer_label(op.buffer) : std::string(op.label);
  };
  m.device_peak_op = op_name(m.memory.device_peak_op);
  m.host_peak_op = op_name(m.memory.host_peak_op);
  // Per program op: mean seconds per step over the steady steps (planner::steady_samples, as
  // validation takes the step: the fastest of the recent steps after the first), so the
  // op times add up to the step they are compared with; over every step after the first when
  // the session ran its ops outside step() (forward_backward) and kept no steps to choose from.
  m.op_s.assign(s.program.ops.size(), 0.0);
  const std::vector<std::size_t> steady_steps = planner::steady_samples(s.meas.step_times_s, 1);
  std::vector<const Impl::StepOps*> steady;
  for (std::size_t k : steady_steps)
    for (const auto& r : s.ops_recent)
      if (r.step == k) steady.push_back(&r);
  if (!steady.empty() && steady.size() == steady_steps.size()) {
    for (const auto* r : steady) {
      for (std::size_t i = 0; i < m.op_s.size(); ++i) m.op_s[i] += r->op_s[i];
      m.exposed_comm_s += r->exposed_s;
    }
    for (double& x : m.op_s) x /= static_cast<double>(steady.size());
    m.exposed_comm_s /= static_cast<double>(steady.size());
    m.op_s_steps = static_cast<std::int64_t>(steady.size());
  } else if (s.op_runs > 1) {
    for (std::size_t i = 0; i < m.op_s.size(); ++i) m.op_s[i] = s.op_warm_s[i] / static_cast<double>(s.op_runs - 1);
    m.op_s_steps = s.op_runs - 1;
    m.exposed_comm_s = s.exposed_warm_s / static_cast<double>(s.op_runs - 1);
  }
  m.collective_ops = s.coll_ops;
  m.collective_op_s_by_step.assign(s.coll_recent.begin(), s.coll_recent.end());
  // Time per (phase, kernel, label), in first-appearance order.
  std::map<std::tuple<std::string, std::string, std::string>, std::size_t> index;
  nlohmann::json events = nlohmann::json::array();
  for (std::size_t i = s.first_step_op; i < s.program.ops.size(); ++i) {
    const sim::Op& op = s.program.ops[i];
    if (op.kind != OpKind::compute) continue;
    auto key = std::make_tuple(std::string(sim::name_of(op.phase)), std::string(sim::name_of(op.kernel)), std::string(op.label));
    auto [it, inserted] = index.emplace(key, m.op_times.size());
    if (inserted) m.op_times.push_back({std::get<0>(key), std::get<1>(key), std::get<2>(key), 0, 0.0, 0.0});
    OpTime& o = m.op_times[it->second];
    o.calls += static_cast<std::int64_t>(s.steps_done);
    o.total_s += s.op_s[i];
    o.flops += op.work.flops * static_cast<double>(s.steps_done);
    if (s.last_dur_s[i] >= 0.0)
      events.push_back({{"name", op.label.empty() ? std::string(sim::name_of(op.kernel)) : std::string(op.label)},
                        {"cat", sim::name_of(op.kernel)},
                        {"ph", "X"},
                        {"ts", s.last_start_s[i] * 1e6},
                        {"dur", s.last_dur_s[i] * 1e6},
                        {"pid", 0},
                        {"tid", 0},
                        {"args", {{"op", i}, {"phase", sim::name_of(op.phase)}, {"layer", op.layer}, {"micro_batch", op.micro_batch},
                                  {"flops", op.work.flops}}}});
  }
  // Collectives: measured (the communicator's counters) and the program's, per step.
  const auto steps = static_cast<std::uint64_t>(s.meas.step_times_s.size());
  CommCounters cc;
  if (s.comm) cc = s.comm->counters();
  for (int k = 0; k < sim::kNumCollectives; ++k) {
    CollectiveStat c;
    c.kind = std::string(sim::name_of(static_cast<sim::Collective>(k)));
    for (std::size_t i = s.first_step_op; i < s.program.ops.size(); ++i) {
      const sim::Op& op = s.program.ops[i];
      if (op.kind == OpKind::collective && static_cast<int>(op.collective) == k && s.N > 1) {
        c.predicted_calls_per_step += 1;
        c.predicted_bytes_per_step += op.bytes;
      }
    }
    const CommCounter& got = cc[static_cast<CommKind>(k)];  // CommKind shares NCCL's order
    const CommCounter& before = s.base_counters[static_cast<CommKind>(k)];
    c.calls = got.calls - before.calls;
    c.bytes = got.bytes - before.bytes;
    c.seconds = got.seconds - before.seconds;
    c.bytes_per_step = steps ? c.bytes / steps : 0;
    m.collectives.push_back(c);
  }
  m.rank = s.rank;
  m.trace = {{"traceEvents", events}, {"displayTimeUnit", "ms"},
             {"otherData", {{"process", "peftplan measured step"}, {"backend", m.backend}}}};
  return m;
}

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
  for (const auto& tt : s.trainables)
    for (const auto& [id, t] : s.adapter_views)
      if (t == &tt) out.push_back({t, {s.at(id), static_cast<std::size_t>(t->numel())}});
  executor::save_adapter(dir, s.plan.input.peft.adapters.at(0), s.plan.input.model.name, out);
}

namespace {

// Every rank's measurement JSON on rank 0 (null elsewhere): lengths, then the texts padded to
// the longest, with all_gather.
nlohmann::json gather_measurements(Communicator& comm, const nlohmann::json& mine) {
  const std::string text = mine.dump();
  const auto n = static_cast<std::size_t>(comm.size());
  std::vector<std::int64_t> lengths(n);
  const auto len = static_cast<std::int64_t>(text.size());
  comm.all_gather(&len, lengths.data(), 1, CommDType::int64);
  const auto longest = static_cast<std::size_t>(*std::max_element(lengths.begin(), lengths.end()));
  std::vector<char> send(longest, ' '), all(longest * n);
  std::copy(text.begin(), text.end(), send.begin());
  comm.all_gather(send.data(), all.data(), longest, CommDType::uint8);
  if (comm.rank() != 0) return nullptr;
  nlohmann::json ranks = nlohmann::json::array();
  for (std::size_t r = 0; r < n; ++r)
    ranks.push_back(nlohmann::json::parse(all.begin() + static_cast<std::ptrdiff_t>(r * longest),
                                          all.begin() + static_cast<std::ptrdiff_t>(r * longest + static_cast<std::size_t>(lengths[r]))));
  return ranks;
}

// Rank 0: each collective's transfer (the shortest rank's execution, step by step: the rank
// that arrived last waited for nobody) and the time ranks waited for the last one to arrive,
// per collective op and in total, from every rank's collective_op_s_by_step (see Measurement).
// Each is the mean over rank 0's steady steps (planner::steady_samples), the steps its step time
// and op_s are taken over: a collective's share of the steps it is compared with.
void split_collective_time(Measurement& m) {
  const auto& ranks = m.per_rank;
  if (!ranks.is_array() || ranks.empty() || m.collective_ops.empty()) return;
  std::vector<std::vector<std::vector<double>>> d;  // [rank][step][collective]
  for (const auto& r : ranks) {
    if (!r.contains("collective_op_s_by_step") || r.at("collective_ops") != nlohmann::json(m.collective_ops)) return;
    d.push_back(r.at("collective_op_s_by_step").get<std::vector<std::vector<double>>>());
  }
  std::size_t steps = d.front().size();
  for (const auto& r : d) steps = std::min(steps, r.size());
  if (steps == 0) return;
  // Row k of the last `steps` rows is step n - steps + k of rank 0's step_times_s.
  const std::size_t n = m.step_times_s.size();
  std::vector<std::size_t> rows;
  for (std::size_t k : planner::steady_samples(m.step_times_s, 1))
    if (n >= steps && k >= n - steps) rows.push_back(k - (n - steps));
  if (rows.empty())  // steps run outside step() (forward_backward): every row
    for (std::size_t k = 0; k < steps; ++k) rows.push_back(k);
  const std::size_t C = m.collective_ops.size();
  m.collective_transfer_s.assign(C, 0.0);
  m.collective_wait_s.assign(C, 0.0);
  for (std::size_t c = 0; c < C; ++c) {
    for (std::size_t k : rows) {
      double lo = std::numeric_limits<double>::max(), sum = 0.0;
      for (const auto& r : d) {
        const std::size_t kk = r.size() - steps + k;  // align the last `steps` steps
        lo = std::min(lo, r[kk][c]);
        sum += r[kk][c];
      }
      m.collective_transfer_s[c] += lo;
      m.collective_wait_s[c] += sum / static_cast<double>(d.size()) - lo;
    }
    m.collective_transfer_s[c] /= static_cast<double>(rows.size());
    m.collective_wait_s[c] /= static_cast<double>(rows.size());
  }
  m.sync_wait_s = std::accumulate(m.collective_wait_s.begin(), m.collective_wait_s.end(), 0.0);
}

}  // namespace

void gather_ranks(Measurement& m, Communicator& comm) {
  if (comm.size() <= 1) return;
  nlohmann::json mine = measurement_to_json(m);
  mine.erase("per_rank");
  m.per_rank = gather_measurements(comm, mine);
  if (comm.rank() == 0) split_collective_time(m);
}

Measurement run_plan(const planner::PlanFile& plan, Backend& backend, const std::filesystem::path& out_dir,
                     std::FILE* progress, Communicator* comm, const SessionOptions& options) {
  check_executable(plan);
  // The machine's speed as calibration measures it (calibrate.h), before the session: its
  // all_reduce is not the program's and must not reach the session's collective counters.
  const double probe = speed_probe(comm, kProbeWindowS);
  Session session(plan, backend, load_data(plan), comm, options);
  const bool root = !comm || comm->rank() == 0;
  if (!root) progress = nullptr;
  const auto& t = plan.input.training;
  if (!plan.run.resume.empty()) {
    session.resume(plan.run.resume);
    if (progress) std::fprintf(progress, "peftplan-exec: resumed from %s at step %lld\n", plan.run.resume.c_str(),
                               static_cast<long long>(session.steps_done()));
  }
  if (progress)
    std::fprintf(progress, "peftplan-exec: %s, %s, %d rank(s) %s, B=%lld S=%lld accum=%lld, %lld steps\n", plan.input.model.name.c_str(),
                 backend.description().c_str(), plan.input.strategy.ranks, std::string(planner::name_of(plan.input.strategy.stage)).c_str(),
                 static_cast<long long>(t.micro_batch), static_cast<long long>(t.seq_len),
                 static_cast<long long>(t.grad_accum), static_cast<long long>(plan.run.steps));
  while (session.steps_done() < plan.run.steps) {
    const StepStats st = session.step();
    if (progress) {
      std::fprintf(progress, "step %lld/%lld  loss %.6f  grad_norm %.4f  lr %.3g  %.3f s  %.0f tokens/s\n",
                   static_cast<long long>(st.step), static_cast<long long>(plan.run.steps), st.loss, st.grad_norm, st.lr,
                   st.seconds, static_cast<double>(t.micro_batch * t.seq_len * t.grad_accum * plan.input.strategy.ranks) / st.seconds);
      std::fflush(progress);
    }
    if (plan.run.checkpoint_every > 0 && st.step % plan.run.checkpoint_every == 0) {
      session.save_checkpoint(plan.run.checkpoint_dir);
      if (progress) {
        std::fprintf(progress, "checkpoint %s/step-%lld\n", plan.run.checkpoint_dir.c_str(), static_cast<long long>(st.step));
        std::fflush(progress);
      }
    }
  }
  Measurement m = session.measurement();
  m.speed_probe_flops_per_s = probe;
  // ZeRO-3: the adapter is sharded; every rank takes part in gathering it.
  if (plan.input.strategy.stage == planner::Stage::zero3 && !plan.run.save_adapter.empty()) session.trainable_weights();
  if (comm) gather_ranks(m, *comm);
  if (!root) return m;
  std::filesystem::create_directories(out_dir);
  auto write = [](const std::filesystem::path& p, const nlohmann::json& j) { write_text_atomic(p, j.dump(1) + "\n"); };
  write(out_dir / "measurement.json", measurement_to_json(m));
  write(out_dir / "trace.json", m.trace);
  if (!plan.run.save_adapter.empty()) session.save_adapter(plan.run.save_adapter);
  return m;
}

}  // namespace peftplan::executor
