// The step-program interpreter loop (see runner.h, session_impl.h): allocations as the program
// says, the kernel dispatch by the operand contract (sim/ops.h), one step's ops in order with
// their timing, and the optimizer step's checks.
#include "session_impl.h"

#include "peftplan/executor/kernels.h"

namespace peftplan::executor {

void Session::Impl::alloc_op(std::size_t i, const sim::Op& op) {
  const auto b = static_cast<std::size_t>(op.buffer);
  const sim::Buffer& buf = program.buffers[b];
  ptr[b] = alloc.allocate(buf.bytes, buf.category, static_cast<std::int32_t>(i));
  // Gradient buffers start at zero: kernels add into them (lora_bwd), and a bucket's padding
  // must reduce to zero.
  if (buf.category == sim::MemCategory::gradients) be.fill_zero(ptr[b], buf.bytes);
  if (tokens_mb[b] >= 0) {  // the data loader fills a micro-batch's tokens and targets
    PEFTPLAN_CHECK(buf.bytes == 8ull * static_cast<std::uint64_t>(M));
    host_tokens.resize(2 * static_cast<std::size_t>(M));
    data.micro_batch(step_index, rank, N, tokens_mb[b], A, B, {host_tokens.data(), static_cast<std::size_t>(M)},
                     {host_tokens.data() + M, static_cast<std::size_t>(M)});
    be.copy_to_device(ptr[b], host_tokens.data(), buf.bytes);
  }
}

// A device scalar (kLossSlot, kNormSlot) on the host: the queue drained, then one staged copy.
double Session::Impl::read_scalar(std::size_t slot) {
  double v = 0.0;
  be.synchronize();
  be.copy_to_host(&v, scalars + slot, sizeof v);
  return v;
}

double Session::Impl::finish_norm() {
  PEFTPLAN_CHECK_MSG(have_norm, "the program computes no gradient norm before the optimizer step");
  if (!norm_on_host) {  // one rank (or DDP): no grad_sumsq all_reduce has brought it over
    sumsq = read_scalar(kNormSlot);
    norm_on_host = true;
  }
  return global_grad_norm(sumsq);
}

// One compute op: the kernel its Op::kernel names on the operands, shape and scalars the op
// carries (sim/ops.h). The shapes the backend gets are the op's; a few are also the session's
// (the attention's batch and heads), which verify's size rule has tied to the buffers.
void Session::Impl::compute(const sim::Op& op) {
  namespace ops = sim::ops;
  switch (op.kernel) {
    case Kernel::embedding_fwd: {
      const auto o = ops::read<ops::EmbeddingFwd>(program, op);
      be.embedding_forward(dt, at<std::int32_t>(o.tokens), vp(o.table), vp(o.out), o.M, o.V, o.H);
      return;
    }
    case Kernel::norm_fwd: {
      const auto o = ops::read<ops::NormFwd>(program, op);
      be.rmsnorm_forward(dt, vp(o.x), vp(o.w), static_cast<float>(o.eps), vp(o.y), at(o.rstd), o.M, o.H);
      return;
    }
    case Kernel::norm_bwd: {
      const auto o = ops::read<ops::NormBwd>(program, op);
      be.rmsnorm_backward(dt, vp(o.dy), vp(o.x), vp(o.w), at(o.rstd), vp(o.dx), o.M, o.H, op.accumulate);
      return;
    }
    case Kernel::cast: {
      const auto o = ops::read<ops::Cast>(program, op);
      if (!be.supports_storage(o.from) || !be.supports_storage(o.to))
        throw InternalError(fmt::format("the {} backend has no cast from {} to {} ({})", be.name(), name_of(o.from), name_of(o.to), op.label));
      be.convert(at<std::byte>(o.src), o.from, at<std::byte>(o.dst), o.to, o.n);
      return;
    }
    case Kernel::linear_fwd: {
      const auto o = ops::read<ops::LinearFwd>(program, op);
      be.linear_forward(dt, vp(o.x), vp(o.w), opt<void>(o.bias), vp(o.y), o.M, o.K, o.N, op.accumulate);
      return;
    }
    case Kernel::linear_bwd_data: {
      const auto o = ops::read<ops::LinearBwdData>(program, op);
      be.linear_backward_input(dt, vp(o.dy), vp(o.w), vp(o.dx), o.M, o.K, o.N, op.accumulate);
      return;
    }
    case Kernel::dropout: {
      const auto o = ops::read<ops::Dropout>(program, op);
      be.dropout_forward(dt, vp(o.x), vp(o.out), o.n, dropout_key(o.p, o.adapter, op.micro_batch));
      return;
    }
    case Kernel::lora_fwd: {
      const auto o = ops::read<ops::LoraFwd>(program, op);
      be.lora_forward(dt, vp(o.x_in), vp(o.a), vp(o.b), static_cast<float>(o.scale), vp(o.u), vp(o.y), o.M, o.K, o.N, o.r);
      return;
    }
    case Kernel::lora_bwd: {
      const auto o = ops::read<ops::LoraBwd>(program, op);
      const DropoutKey key = o.p > 0.0 ? dropout_key(o.p, o.adapter, op.micro_batch) : DropoutKey{};
      be.lora_backward(dt, vp(o.dy), vp(o.x_in), vp(o.a), vp(o.b), vp(o.u), static_cast<float>(o.scale), key, vp(o.da), vp(o.db),
                       opt<void>(o.dx), vp(o.scratch), o.M, o.K, o.N, o.r);
      return;
    }
    case Kernel::rope_tables: {
      const auto o = ops::read<ops::RopeTables>(program, op);
      be.rope_tables(at(o.tables), o.S, o.d, o.theta);
      return;
    }
    case Kernel::rope_fwd: {
      const auto o = ops::read<ops::RopeFwd>(program, op);
      be.rope_forward(dt, vp(o.q), at(o.tables), o.B, o.S, o.nh, o.d);
      be.rope_forward(dt, vp(o.k), at(o.tables), o.B, o.S, o.nkv, o.d);
      return;
    }
    case Kernel::rope_bwd: {
      const auto o = ops::read<ops::RopeBwd>(program, op);
      be.rope_backward(dt, vp(o.q), at(o.tables), o.B, o.S, o.nh, o.d);
      be.rope_backward(dt, vp(o.k), at(o.tables), o.B, o.S, o.nkv, o.d);
      return;
    }
    case Kernel::attention_fwd: {
      const auto o = ops::read<ops::AttentionFwd>(program, op);
      be.attention_forward(dt, vp(o.q), vp(o.k), vp(o.v), vp(o.probs), vp(o.out), o.B, o.S, o.nh, o.nkv, o.d);
      return;
    }
    case Kernel::attention_bwd: {
      const auto o = ops::read<ops::AttentionBwd>(program, op);
      be.attention_backward(dt, vp(o.d_out), vp(o.q), vp(o.k), vp(o.v), vp(o.probs), vp(o.dq), vp(o.dk), vp(o.dv), vp(o.scratch),
                            elems(o.scratch), o.B, o.S, o.nh, o.nkv, o.d);
      return;
    }
    case Kernel::flash_attention_fwd: {
      const auto o = ops::read<ops::FlashAttentionFwd>(program, op);
      be.flash_attention_forward(dt, vp(o.q), vp(o.k), vp(o.v), at(o.lse), vp(o.out), o.B, o.S, o.nh, o.nkv, o.d);
      return;
    }
    case Kernel::flash_attention_bwd: {
      const auto o = ops::read<ops::FlashAttentionBwd>(program, op);
      be.flash_attention_backward(dt, vp(o.d_out), vp(o.q), vp(o.k), vp(o.v), vp(o.out), at(o.lse), vp(o.dq), vp(o.dk), vp(o.dv), o.B,
                                  o.S, o.nh, o.nkv, o.d);
      return;
    }
    case Kernel::residual_add: {
      const auto o = ops::read<ops::ResidualAdd>(program, op);
      if (o.out >= 0) be.add(dt, vp(o.a), vp(o.b), vp(o.out), o.n);
      return;
    }
    case Kernel::mlp_act_fwd: {
      const auto o = ops::read<ops::MlpActFwd>(program, op);
      be.swiglu_forward(dt, vp(o.gate), vp(o.up), vp(o.act), o.n);
      return;
    }
    case Kernel::mlp_act_bwd: {
      const auto o = ops::read<ops::MlpActBwd>(program, op);
      be.swiglu_backward(dt, vp(o.d_act), vp(o.gate), vp(o.up), vp(o.d_gate), vp(o.d_up), o.n);
      return;
    }
    case Kernel::cross_entropy_fwd: {  // the targets follow the ids in the tokens buffer; fp32 logits (ops.h)
      const auto o = ops::read<ops::CrossEntropyFwd>(program, op);
      be.cross_entropy_forward(DType::fp32, vp(o.logits), at<std::int32_t>(o.tokens) + o.M, o.M, o.V, scalars + kLossSlot);
      return;
    }
    case Kernel::cross_entropy_bwd: {
      const auto o = ops::read<ops::CrossEntropyBwd>(program, op);
      be.cross_entropy_backward(DType::fp32, vp(o.logits), at<std::int32_t>(o.tokens) + o.M, vp(o.d_logits), o.divisor, o.M, o.V);
      return;
    }
    case Kernel::grad_norm: {  // this rank's partition; a grad_sumsq all_reduce may follow
      const auto o = ops::read<ops::GradNorm>(program, op);
      be.sum_squares(dt, vp(o.grads), elems(o.grads), scalars + kNormSlot);
      have_norm = true;
      norm_on_host = false;
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
      // Mixed precision: AdamW steps the fp32 master over the gradients widened to fp32, and the
      // parameters are the master rounded back (DeepSpeed's bf16 optimizer step).
      const bool mixed = o.master >= 0;
      PEFTPLAN_CHECK_MSG(mixed == (dt != DType::fp32) && (!mixed || o.grads32 >= 0),
                         "a {} program's optimizer step {} an fp32 master", name_of(dt), mixed ? "has" : "lacks");
      std::byte* block = param_block(o.params, n);
      float* params = mixed ? at(o.master) : reinterpret_cast<float*>(block);
      float* grads = mixed ? at(o.grads32) : at(o.grads);
      // An offloaded optimizer's step (the program's cpu_adam, on the host stream) runs on the
      // host over its host buffers, as DeepSpeed's CPU Adam does, whatever the backend: once the
      // gradients' copies to the host have landed (waited for on the host, wait_for_copy_deps)
      // and the device's queues have drained. Elsewhere the backend's AdamW. Both are optim.h
      // adamw_step's arithmetic.
      const bool host_step = op.stream == sim::Stream::host;
      if (host_step) be.synchronize();
      if (mixed && host_step) cpu::bf16_to_fp32(at<const std::uint16_t>(o.grads), grads, n);
      else if (mixed) be.convert(vp(o.grads), dt, grads, DType::fp32, n);
      if (t.grad_clip > 0.0) {
        const double coef = clip_coefficient(norm, t.grad_clip);
        if (coef < 1.0) {
          if (host_step)
            cpu::scale_inplace(grads, static_cast<float>(coef), n);
          else
            be.scale(DType::fp32, grads, static_cast<float>(coef), n);
        }
      }
      const std::int64_t step1 = step_index + 1;
      const double lr = lr_for_step(schedule, t.lr, step1);
      if (!lr_logged) meas.lrs.push_back(lr);
      lr_logged = true;
      if (host_step)
        executor::adamw_step(params, grads, at(o.states), at(o.states) + n, n, step1, lr,
                             AdamWConfig{t.adam_beta1, t.adam_beta2, t.adam_eps, t.weight_decay});
      else
        be.adamw_step(params, grads, at(o.states), at(o.states) + n, n, step1, lr, t.adam_beta1, t.adam_beta2, t.adam_eps,
                      t.weight_decay);
      if (mixed && host_step) cpu::fp32_to_bf16(params, reinterpret_cast<std::uint16_t*>(block), n);
      else if (mixed) be.convert(params, DType::fp32, block, dt, n);
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
  const std::vector<float> g = read_compute(grad);
  const auto n = static_cast<std::int64_t>(g.size());
  std::int64_t bad = -1;
  for (std::int64_t i = 0; i < n && bad < 0; ++i)
    if (!std::isfinite(g[i])) bad = i;
  std::string where = "no element of this rank's gradients (another rank's shard holds it)";
  if (bad >= 0) {
    where = fmt::format("element {} of {}", bad, buffer_label(grad));
    const std::uint64_t byte = static_cast<std::uint64_t>(bad) * es();
    for (std::size_t v = 0; v < program.buffers.size(); ++v) {
      const sim::Buffer& b = program.buffers[v];
      if (b.view_of == grad && b.role == sim::BufferRole::adapter_grad && b.offset <= byte && byte < b.offset + b.bytes) {
        where = fmt::format("{} (element {} of {})", buffer_label(static_cast<std::int32_t>(v)), bad, buffer_label(grad));
        break;
      }
    }
  }
  return fmt::format("step {}: the gradient norm is {} (loss so far {}); the first non-finite gradient is {}. "
                     "Lower the learning rate, clip gradients (run.clip), or set run.on_nonfinite to skip",
                     step_index + 1, norm, step_loss_sum() / count, where);
}

void Session::Impl::run_ops(bool update) {
  // optimizer.zero_grad()
  if (grad_flat >= 0) be.fill_zero(at(grad_flat), bytes(grad_flat));
  if (grad_shard >= 0) be.fill_zero(at(grad_shard), bytes(grad_shard));
  be.fill_zero(scalars, kScalarSlots * sizeof(double));
  loss_sum = 0.0;
  loss_on_host = false;
  have_norm = false;
  norm_on_host = false;
  skipped = false;
  lr_logged = false;
  if (op_runs > 0) {
    op_cur.assign(program.ops.size(), 0.0);
    exposed_cur = 0.0;
  }
  // Compute ops are timed by marks on the compute stream (backend.h), read once the step's
  // queue has drained: no synchronize between ops, so a device overlaps them as it would.
  timed.clear();
  copies.clear();
  be.record_mark(kStartMark);
  for (std::size_t i = first_step_op; i < program.ops.size(); ++i) {
    const sim::Op& op = program.ops[i];
    if (board) board->post(step_index, static_cast<std::int64_t>(i));
    if (fault && fault->step == step_index && fault->op == i) {
      if (fault->stall)  // stops here until the job is ended (its peers' watchdog, then MPI_Abort)
        for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
      throw InternalError(fmt::format("injected fault (PEFTPLAN_FAULT) at step {}, {}", step_index, op_name(i)));
    }
    if (!update && op.phase == Phase::optimizer) {  // forward_backward: no update, no step
      if (op.kind == OpKind::free && ptr[static_cast<std::size_t>(op.buffer)] == nullptr) continue;
      if (op.kind != OpKind::alloc && op.kind != OpKind::free) continue;
    }
    switch (op.kind) {
      case OpKind::alloc: alloc_op(i, op); break;
      case OpKind::free:
        wait_for_buffer(op.buffer);
        wait_for_copies(op.buffer);
        alloc.release(ptr[static_cast<std::size_t>(op.buffer)]);
        ptr[static_cast<std::size_t>(op.buffer)] = nullptr;
        break;
      case OpKind::collective:
        wait_for_copy_deps(op);  // ZeRO-3's offloaded weights come through a copy to the device
        try {
          collective(i, op);
        } catch (const CommError&) {
          throw;  // the watchdog's error names the op already
        } catch (const std::exception& e) {
          throw InternalError(fmt::format("{}: {}", op_name(i), e.what()));
        }
        break;
      case OpKind::copy: {
        // On the copy queue, once the kernels enqueued so far (its source's writers among them)
        // have run; timed by marks around it on that queue.
        wait_through(i);
        be.record_mark(ready_mark(i));
        be.wait_mark(Backend::Queue::copy, ready_mark(i));
        be.record_copy_mark(begin_mark(i));
        copy(op);
        be.record_copy_mark(end_mark(i));
        copies.push_back({i, root_of(op.buffer), root_of(op.buffer_out)});
        timed.push_back(i);
        break;
      }
      case OpKind::compute: {
        for (std::int32_t dep : program.deps_of(op))
          if (program.ops[static_cast<std::size_t>(dep)].kind == OpKind::collective) wait_through(static_cast<std::size_t>(dep));
        wait_for_copy_deps(op);
        be.record_mark(begin_mark(i));
        compute(op);
        be.record_mark(end_mark(i));
        timed.push_back(i);
        break;
      }
    }
  }
  if (!pending.empty()) wait_through(pending.back().op);
  be.synchronize();
  copies.clear();
  if (board) board->post(step_index, static_cast<std::int64_t>(program.ops.size()));  // between steps
  for (std::size_t i : timed) {
    const double dur = be.seconds_between(begin_mark(i), end_mark(i));
    op_s[i] += dur;
    if (op_runs > 0) {
      op_warm_s[i] += dur;
      op_cur[i] += dur;
    }
    last_start_s[i] = be.seconds_between(kStartMark, begin_mark(i));
    last_dur_s[i] = dur;
    const sim::Op& op = program.ops[i];
    if (sim::is_gemm_kernel(op.kernel)) {
      meas.gemm_s += dur;
      meas.gemm_flops += op.work.flops;
    }
  }
  if (op_runs > 0 && !coll_ops.empty()) {
    coll_recent.push_back(coll_cur);
    if (coll_recent.size() > planner::kSteadyWindow) coll_recent.pop_front();
  }
  std::fill(coll_cur.begin(), coll_cur.end(), 0.0);
  ++op_runs;
}

StepStats Session::step() {
  Impl& s = *impl_;
  const auto t0 = Clock::now();  // the step's wall time: run_ops ends with the queue drained
  s.step_index = s.steps_done;
  s.run_ops(true);
  StepStats st;
  st.step = ++s.steps_done;
  st.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  st.loss = s.step_loss_sum() / s.count;
  st.grad_norm = s.have_norm ? s.finish_norm() : 0.0;
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
  return s.step_loss_sum() / s.count;
}


}  // namespace peftplan::executor
