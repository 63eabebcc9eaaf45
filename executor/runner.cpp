// The step-program interpreter (see runner.h). Reading order: the checks of what this executor
// runs, the Session's state (program, buffer pointers, per-op timing), setup (weights, adapter,
// state buffers), the per-step op loop and the kernel dispatch, then run_plan.
#include "peftplan/executor/runner.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <optional>
#include <unordered_map>

#include <fmt/format.h>

#include "peftplan/common/error.h"
#include "peftplan/executor/communicator.h"
#include "peftplan/executor/model.h"
#include "peftplan/executor/optim.h"
#include "peftplan/executor/plan_file.h"
#include "peftplan/executor/safetensors.h"
#include "peftplan/models/config.h"
#include "peftplan/sim/compute.h"

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

void check_executable(const planner::PlanFile& plan) {
  const planner::PlanInput& in = plan.input;
  auto refuse = [](const std::string& what) { throw InputError("the executor cannot run this plan: " + what); };
  if (in.profile != planner::RuntimeProfile::executor)
    refuse(fmt::format("profile is {}; plans for the executor use the executor profile", planner::name_of(in.profile)));
  const auto arch = in.model.arch;
  if (arch != models::Arch::llama && arch != models::Arch::mistral && arch != models::Arch::qwen2)
    refuse(fmt::format("model_type {} (supported: llama, mistral, qwen2)", models::name_of(arch)));
  if (in.model.is_moe()) refuse("mixture-of-experts models");
  if (in.model.sliding_window && *in.model.sliding_window < in.training.seq_len)
    refuse(fmt::format("sliding_window {} < seq_len {} (the executor attends over the whole sequence)", *in.model.sliding_window,
                       in.training.seq_len));
  if (in.model.out_bias || in.model.mlp_bias) refuse("bias on o_proj or the MLP");
  if (in.strategy.ranks != 1 || in.strategy.stage != planner::Stage::ddp)
    refuse(fmt::format("{} ranks with {}: this version runs one rank with ddp", in.strategy.ranks, planner::name_of(in.strategy.stage)));
  if (in.strategy.offload_optimizer != planner::OffloadDevice::none || in.strategy.offload_param != planner::OffloadDevice::none)
    refuse("CPU offload");
  const auto& t = in.training;
  if (t.attention != planner::Attention::eager) refuse("flash attention (use eager)");
  if (t.optimizer != planner::Optimizer::adamw) refuse(fmt::format("optimizer {} (supported: adamw)", planner::name_of(t.optimizer)));
  if (t.full_finetune || in.peft.adapters.empty()) refuse("full fine-tuning (LoRA only)");
  if (in.peft.quantization) refuse("quantised base weights");
  if (t.base_storage && *t.base_storage != DType::fp32 && *t.base_storage != DType::bf16)
    refuse(fmt::format("base storage {} (supported: fp32, bf16)", name_of(*t.base_storage)));
  if (in.peft.adapters.size() != 1) refuse(fmt::format("{} adapters (one LoRA adapter)", in.peft.adapters.size()));
  const auto& a = in.peft.adapters[0];
  if (a.type != models::PeftType::lora) refuse(fmt::format("adapter type {} (LoRA only)", models::name_of(a.type)));
  if (a.lora.use_dora || a.lora.lora_bias || a.lora.bias != "none" || !a.lora.modules_to_save.empty())
    refuse("DoRA, LoRA bias, bias != \"none\" or modules_to_save");
  if (plan.run.steps <= 0) refuse("run.steps must be positive");
}

planner::PlanFile load_plan(const std::filesystem::path& path) {
  planner::PlanFile p = planner::read_plan_file(path);
  check_executable(p);
  return p;
}

TokenData load_data(const planner::PlanFile& plan) {
  if (plan.run.data.empty()) throw InputError("plan.json: run.data names no token file (peftplan run --data FILE)");
  return TokenData::load(plan.run.data, parse_data_format(plan.run.data_format, "run.data_format"), plan.input.model.vocab,
                         plan.input.training.seq_len);
}

// ------------------------------------------------------------------------------------- state

struct LoraInfo {
  std::int64_t in = 0, out = 0, r = 0;
  double scale = 0.0, dropout = 0.0;
};

struct Session::Impl {
  planner::PlanFile plan;
  Backend& be;
  TokenData data;
  Communicator* comm;
  sim::Program program;
  TrackedAllocator alloc;
  std::vector<void*> ptr;                       // by buffer id (views resolved on use)
  std::vector<std::int32_t> tokens_mb;          // by buffer id: micro-batch of a token buffer
  std::vector<std::int32_t> lora_of;            // by buffer id of an A view: index into loras
  std::vector<LoraInfo> loras;
  std::unordered_map<std::int32_t, const models::TrainableTensor*> adapter_views;  // view id -> tensor
  std::vector<models::TrainableTensor> trainables;
  std::size_t first_step_op = 0;                // ops before it are setup
  std::int32_t trainable_flat = -1, grad_flat = -1;
  LrSchedule schedule;
  // Dimensions.
  std::int64_t B = 0, S = 0, M = 0, H = 0, I = 0, V = 0, nh = 0, nkv = 0, d = 0, A = 1;
  double count = 0.0;                           // target tokens of a step on all ranks
  // Step state.
  std::int64_t steps_done = 0;
  std::int64_t step_index = 0;                  // the step being run (data, dropout)
  double loss_sum = 0.0, sumsq = 0.0;
  bool have_norm = false;
  // Measurement.
  std::vector<double> op_s;                     // by op: seconds summed over steps
  std::vector<double> last_start_s, last_dur_s; // by op: the last step's timeline
  Measurement meas;

  Impl(const planner::PlanFile& p, Backend& b, TokenData tokens, Communicator* c)
      : plan(p), be(b), data(std::move(tokens)), comm(c), alloc(b.device_memory(), b.host_memory()) {}

  // Resolves a buffer id (view or not) to its memory.
  template <typename T = float>
  T* at(std::int32_t id) const {
    PEFTPLAN_CHECK(id >= 0);
    const sim::Buffer& buf = program.buffers[static_cast<std::size_t>(id)];
    if (buf.view_of >= 0) return reinterpret_cast<T*>(static_cast<std::byte*>(ptr[static_cast<std::size_t>(buf.view_of)]) + buf.offset);
    PEFTPLAN_CHECK_MSG(ptr[static_cast<std::size_t>(id)] != nullptr, "buffer {} used while not allocated", buf.name);
    return static_cast<T*>(ptr[static_cast<std::size_t>(id)]);
  }
  template <typename T = float>
  T* opt(std::int32_t id) const { return id < 0 ? nullptr : at<T>(id); }
  std::uint64_t bytes(std::int32_t id) const { return program.buffers[static_cast<std::size_t>(id)].bytes; }
  std::int64_t floats(std::int32_t id) const { return static_cast<std::int64_t>(bytes(id) / 4); }

  void setup();
  void run_ops(bool update);
  void alloc_op(std::size_t i, const sim::Op& op);
  void compute(const sim::Op& op);
  double finish_norm();
};

void Session::Impl::setup() {
  const planner::PlanInput& in = plan.input;
  planner::PlanInput pin = in;
  pin.inventory = nullptr;
  program = planner::build_program(pin, {.names = true}).program;
  const auto inv = planner::make_inventory(in.model, in.peft);
  trainables = inv.trainables;
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
  lora_of.assign(nbuf, -1);
  op_s.assign(program.ops.size(), 0.0);
  last_start_s.assign(program.ops.size(), 0.0);
  last_dur_s.assign(program.ops.size(), -1.0);
  // Name tables: base tensors (HF names), adapter tensors (PEFT names), LoRA modules.
  std::unordered_map<std::string, const models::TensorInfo*> base;
  for (const auto& ti : inv.tensors) base[ti.name] = &ti;
  std::unordered_map<std::string, const models::TrainableTensor*> adapter;
  for (const auto& tt : trainables) adapter[tt.name] = &tt;
  std::unordered_map<std::string, const models::LoraModule*> lora_by_path;
  for (const auto& lm : inv.loras) lora_by_path[lm.linear.path] = &lm;
  for (std::size_t b = 0; b < nbuf; ++b) {
    const sim::Buffer& buf = program.buffers[b];
    if (buf.name == "trainable.flat") trainable_flat = static_cast<std::int32_t>(b);
    if (buf.name == "grad.flat") grad_flat = static_cast<std::int32_t>(b);
    if (buf.view_of < 0 || buf.view_of != trainable_flat) continue;
    auto it = adapter.find(buf.name);
    PEFTPLAN_CHECK_MSG(it != adapter.end(), "view {} is no adapter tensor", buf.name);
    adapter_views[static_cast<std::int32_t>(b)] = it->second;
    if (buf.name.find(".lora_A") != std::string::npos) {
      const models::LoraModule* lm = lora_by_path.at(it->second->module);
      lora_of[b] = static_cast<std::int32_t>(loras.size());
      loras.push_back({lm->linear.in, lm->linear.out, lm->r, lm->scale, lm->dropout});
    }
  }
  PEFTPLAN_CHECK(trainable_flat >= 0 && grad_flat >= 0);
  for (const auto& op : program.ops)
    if (op.kind == OpKind::compute && op.kernel == Kernel::embedding_fwd) tokens_mb[static_cast<std::size_t>(op.args[0])] = op.micro_batch;
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
    if (buf.category == sim::MemCategory::base_weights) {
      auto it = base.find(buf.name);
      PEFTPLAN_CHECK_MSG(it != base.end(), "base buffer {} is no model tensor", buf.name);
      const models::TensorInfo& ti = *it->second;
      // Linear weights are stored in the base dtype; embeddings, norms and biases in fp32
      // (planner frozen_bytes).
      const DType dt = ti.role == models::ParamRole::linear_weight ? storage : DType::fp32;
      init_base_tensor(ti, dt, {static_cast<std::byte*>(p), buf.bytes}, plan.run.seed, ckpt ? &*ckpt : nullptr);
    } else {
      be.fill_zero(p, buf.bytes);
    }
  }
  first_step_op = i;
  for (const auto& [id, tt] : adapter_views)
    init_adapter_tensor(*tt, {at(id), static_cast<std::size_t>(tt->numel())}, plan.run.seed,
                        adapter_file ? &*adapter_file : nullptr);
  if (adapter_file)  // every tensor of the file must belong to the adapter
    for (const auto& st : adapter_file->tensors())
      if (adapter.find(st.name) == adapter.end())
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
  if (tokens_mb[b] >= 0) {  // the data loader fills a micro-batch's tokens and targets
    auto* tok = static_cast<std::int32_t*>(ptr[b]);
    PEFTPLAN_CHECK(buf.bytes == 8ull * static_cast<std::uint64_t>(M));
    const std::int32_t rank = comm ? comm->rank() : 0, ranks = comm ? comm->size() : 1;
    data.micro_batch(step_index, rank, ranks, tokens_mb[b], A, B, {tok, static_cast<std::size_t>(M)},
                     {tok + M, static_cast<std::size_t>(M)});
  }
}

double Session::Impl::finish_norm() {
  if (!have_norm) {
    sumsq = be.sum_squares(at(grad_flat), floats(grad_flat));
    have_norm = true;
  }
  return global_grad_norm(sumsq);
}

// One compute op: the kernel its Op::kernel names on the buffers its Op::args name.
void Session::Impl::compute(const sim::Op& op) {
  const auto& a = op.args;
  const auto& model = plan.input.model;
  switch (op.kernel) {
    case Kernel::embedding_fwd:
      be.embedding_forward(at<std::int32_t>(a[0]), at(a[1]), at(a[2]), M, V, H);
      return;
    case Kernel::norm_fwd:
      be.rmsnorm_forward(at(a[0]), at(a[1]), static_cast<float>(model.norm_eps), at(a[2]), at(a[3]), M, H);
      return;
    case Kernel::norm_bwd:
      be.rmsnorm_backward(at(a[0]), at(a[1]), at(a[2]), at(a[3]), at(a[4]), M, H, op.accumulate);
      return;
    case Kernel::cast: {
      const std::int64_t n = floats(a[1]);
      if (bytes(a[0]) * 2 == bytes(a[1])) be.bf16_to_fp32(at<std::uint16_t>(a[0]), at(a[1]), n);
      else be.copy_to_device(at(a[1]), at(a[0]), bytes(a[1]));
      return;
    }
    case Kernel::linear_fwd:  // gemm(M, out, in)
      be.linear_forward(at(a[0]), at(a[1]), opt(a[3]), at(a[2]), op.work.gemm_m, op.work.gemm_k, op.work.gemm_n, op.accumulate);
      return;
    case Kernel::linear_bwd_data:  // gemm(M, in, out)
      be.linear_backward_input(at(a[0]), at(a[1]), at(a[2]), op.work.gemm_m, op.work.gemm_n, op.work.gemm_k, op.accumulate);
      return;
    case Kernel::dropout: {
      const LoraInfo& l = loras.at(static_cast<std::size_t>(lora_of.at(static_cast<std::size_t>(a[2]))));
      const DropoutKey key{l.dropout, mix(plan.run.seed ^ mix(static_cast<std::uint64_t>(step_index) * 0x100000001b3ull +
                                                                static_cast<std::uint64_t>(op.micro_batch)) ^
                                          mix(static_cast<std::uint64_t>(a[2])))};
      be.dropout_forward(at(a[0]), at(a[1]), floats(a[1]), key);
      return;
    }
    case Kernel::lora_fwd: {
      const LoraInfo& l = loras.at(static_cast<std::size_t>(lora_of.at(static_cast<std::size_t>(a[1]))));
      be.lora_forward(at(a[0]), at(a[1]), at(a[2]), static_cast<float>(l.scale), at(a[3]), at(a[4]), M, l.in, l.out, l.r);
      return;
    }
    case Kernel::lora_bwd: {
      const LoraInfo& l = loras.at(static_cast<std::size_t>(lora_of.at(static_cast<std::size_t>(a[2]))));
      DropoutKey key{};
      if (l.dropout > 0.0)
        key = {l.dropout, mix(plan.run.seed ^ mix(static_cast<std::uint64_t>(step_index) * 0x100000001b3ull +
                                                  static_cast<std::uint64_t>(op.micro_batch)) ^
                              mix(static_cast<std::uint64_t>(a[2])))};
      PEFTPLAN_CHECK(floats(a[5]) == M * (l.r + (l.dropout > 0.0 ? l.in : 0)));
      be.lora_backward(at(a[0]), at(a[1]), at(a[2]), at(a[3]), at(a[4]), static_cast<float>(l.scale), key, at(a[7]), at(a[8]),
                       opt(a[6]), at(a[5]), M, l.in, l.out, l.r);
      return;
    }
    case Kernel::rope_tables:
      be.rope_tables(at(a[0]), S, d, model.rope_theta);
      return;
    case Kernel::rope_fwd:
      be.rope_forward(at(a[0]), at(a[2]), B, S, nh, d);
      be.rope_forward(at(a[1]), at(a[2]), B, S, nkv, d);
      return;
    case Kernel::rope_bwd:
      be.rope_backward(at(a[0]), at(a[2]), B, S, nh, d);
      be.rope_backward(at(a[1]), at(a[2]), B, S, nkv, d);
      return;
    case Kernel::attention_fwd:
      be.attention_forward(at(a[0]), at(a[1]), at(a[2]), at(a[3]), at(a[4]), B, S, nh, nkv, d);
      return;
    case Kernel::attention_bwd:
      be.attention_backward(at(a[0]), at(a[2]), at(a[3]), at(a[4]), at(a[1]), at(a[5]), at(a[6]), at(a[7]), at(a[8]), floats(a[8]),
                            B, S, nh, nkv, d);
      return;
    case Kernel::residual_add:
      if (a[2] >= 0) be.add(at(a[0]), at(a[1]), at(a[2]), M * H);
      return;
    case Kernel::mlp_act_fwd:
      be.swiglu_forward(at(a[0]), at(a[1]), at(a[2]), M * I);
      return;
    case Kernel::mlp_act_bwd:
      be.swiglu_backward(at(a[0]), at(a[1]), at(a[2]), at(a[3]), at(a[4]), M * I);
      return;
    case Kernel::cross_entropy_fwd:
      loss_sum += be.cross_entropy_forward(at(a[0]), at<std::int32_t>(a[1]) + M, M, V);
      return;
    case Kernel::cross_entropy_bwd:
      be.cross_entropy_backward(at(a[0]), at<std::int32_t>(a[1]) + M, at(a[2]), count, M, V);
      return;
    case Kernel::grad_norm:
      sumsq = be.sum_squares(at(a[0]), floats(a[0]));
      have_norm = true;
      return;
    case Kernel::optimizer_step: {
      const auto& t = plan.input.training;
      const double norm = finish_norm();
      const std::int64_t n = floats(a[0]);
      PEFTPLAN_CHECK(floats(a[1]) == n && floats(a[2]) == 2 * n);
      if (t.grad_clip > 0.0) {
        const double coef = clip_coefficient(norm, t.grad_clip);
        if (coef < 1.0) be.scale(at(a[1]), static_cast<float>(coef), n);
      }
      const std::int64_t step1 = step_index + 1;
      const double lr = lr_for_step(schedule, t.lr, step1);
      meas.lrs.push_back(lr);
      be.adamw_step(at(a[0]), at(a[1]), at(a[2]), at(a[2]) + n, n, step1, lr, t.adam_beta1, t.adam_beta2, t.adam_eps,
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

void Session::Impl::run_ops(bool update) {
  be.fill_zero(at(grad_flat), bytes(grad_flat));  // optimizer.zero_grad()
  loss_sum = 0.0;
  have_norm = false;
  const auto t0 = Clock::now();
  for (std::size_t i = first_step_op; i < program.ops.size(); ++i) {
    const sim::Op& op = program.ops[i];
    switch (op.kind) {
      case OpKind::alloc: alloc_op(i, op); break;
      case OpKind::free:
        alloc.release(ptr[static_cast<std::size_t>(op.buffer)]);
        ptr[static_cast<std::size_t>(op.buffer)] = nullptr;
        break;
      case OpKind::collective:  // one rank: nothing to exchange
      case OpKind::copy:        // no offload in this version (check_executable)
        break;
      case OpKind::compute: {
        if (!update && op.kernel == Kernel::optimizer_step) break;
        const auto s = Clock::now();
        compute(op);
        be.synchronize();
        const auto e = Clock::now();
        const double dur = std::chrono::duration<double>(e - s).count();
        op_s[i] += dur;
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
}

Session::Session(const planner::PlanFile& plan, Backend& backend, TokenData data, Communicator* comm)
    : impl_(std::make_unique<Impl>(plan, backend, std::move(data), comm)) {
  check_executable(plan);
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
  s.meas.step_times_s.push_back(st.seconds);
  return st;
}

double Session::forward_backward(std::int64_t step_index) {
  Impl& s = *impl_;
  s.step_index = step_index;
  s.run_ops(false);
  return s.loss_sum / s.count;
}

std::span<float> Session::trainable_weights() {
  return {impl_->at(impl_->trainable_flat), static_cast<std::size_t>(impl_->floats(impl_->trainable_flat))};
}
std::span<const float> Session::gradients() const {
  return {impl_->at(impl_->grad_flat), static_cast<std::size_t>(impl_->floats(impl_->grad_flat))};
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
    return op.buffer >= 0 ? "alloc " + s.program.buffers[static_cast<std::size_t>(op.buffer)].name : std::string(op.label);
  };
  m.device_peak_op = op_name(m.memory.device_peak_op);
  m.host_peak_op = op_name(m.memory.host_peak_op);
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
  m.trace = {{"traceEvents", events}, {"displayTimeUnit", "ms"},
             {"otherData", {{"process", "peftplan measured step"}, {"backend", m.backend}}}};
  return m;
}

void Session::save_adapter(const std::filesystem::path& dir) const {
  const Impl& s = *impl_;
  std::vector<AdapterTensor> out;
  for (const auto& tt : s.trainables)
    for (const auto& [id, t] : s.adapter_views)
      if (t == &tt) out.push_back({t, {s.at(id), static_cast<std::size_t>(t->numel())}});
  executor::save_adapter(dir, s.plan.input.peft.adapters.at(0), s.plan.input.model.name, out);
}

Measurement run_plan(const planner::PlanFile& plan, Backend& backend, const std::filesystem::path& out_dir,
                     std::FILE* progress) {
  check_executable(plan);
  Session session(plan, backend, load_data(plan));
  const auto& t = plan.input.training;
  if (progress)
    std::fprintf(progress, "peftplan-exec: %s, %s, B=%lld S=%lld accum=%lld, %lld steps\n", plan.input.model.name.c_str(),
                 backend.description().c_str(), static_cast<long long>(t.micro_batch), static_cast<long long>(t.seq_len),
                 static_cast<long long>(t.grad_accum), static_cast<long long>(plan.run.steps));
  for (std::int64_t k = 0; k < plan.run.steps; ++k) {
    const StepStats st = session.step();
    if (progress) {
      std::fprintf(progress, "step %lld/%lld  loss %.4f  grad_norm %.4f  lr %.3g  %.3f s  %.0f tokens/s\n",
                   static_cast<long long>(st.step), static_cast<long long>(plan.run.steps), st.loss, st.grad_norm, st.lr,
                   st.seconds, static_cast<double>(t.micro_batch * t.seq_len * t.grad_accum) / st.seconds);
      std::fflush(progress);
    }
  }
  Measurement m = session.measurement();
  std::filesystem::create_directories(out_dir);
  auto write = [](const std::filesystem::path& p, const nlohmann::json& j) {
    const std::filesystem::path tmp = p.string() + ".tmp";
    {
      std::ofstream f(tmp, std::ios::trunc);
      if (!f) throw InputError(fmt::format("{}: cannot write", p.string()));
      f << j.dump(1) << "\n";
    }
    std::filesystem::rename(tmp, p);
  };
  write(out_dir / "measurement.json", measurement_to_json(m));
  write(out_dir / "trace.json", m.trace);
  if (!plan.run.save_adapter.empty()) session.save_adapter(plan.run.save_adapter);
  return m;
}

}  // namespace peftplan::executor
