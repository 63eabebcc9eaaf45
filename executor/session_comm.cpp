// A Session's communication (session_impl.h): collectives issued to the communication thread
// and waited for under the watchdog, scalar reductions, and the optimizer offload's copies.
#include "session_impl.h"

namespace peftplan::executor {

// Who this rank is waiting for at collective op i, from the ranks' posted positions: the rank
// furthest behind (step, op) that has not reached op i, with the op it stopped at.
std::string Session::Impl::laggard(std::size_t i) const {
  if (!board || !comm) return "a rank failed or stopped";
  int worst = -1;
  ProgressBoard::Position at;
  bool unknown = false;
  for (int r = 0; r < comm->size(); ++r) {
    if (r == rank) continue;
    const ProgressBoard::Position p = board->position(r);
    if (!p.known) {
      unknown = true;
      continue;
    }
    const bool behind = p.step < step_index || (p.step == step_index && p.op < static_cast<std::int64_t>(i));
    if (behind && (worst < 0 || p.step < at.step || (p.step == at.step && p.op < at.op))) {
      worst = r;
      at = p;
    }
  }
  if (worst < 0)
    return unknown ? "no rank on this node is behind it: a rank on another node failed or stopped, or the transport did"
                   : "every rank reached it: the collective itself did not complete (the transport failed or stopped)";
  const std::string where = at.op >= static_cast<std::int64_t>(program.ops.size())
                                ? "between steps (checkpoint, logging or the next batch)"
                                : at.op < 0 ? "before its first op" : op_name(static_cast<std::size_t>(at.op));
  return fmt::format("rank {} stalled at step {}, {}, {:.1f} s ago", worst, at.step, where, at.age_s);
}

// Waits for a collective with a watchdog: a peer that died or stopped calling collectives
// leaves this rank waiting, and after options.watchdog_s the wait becomes an error naming the op
// and the rank it waits for (main then ends the job with MPI_Abort).
void Session::Impl::wait(CommRequest& req, std::size_t i) {
  const auto t0 = Clock::now();
  const bool was_done = req.done();
  for (int spin = 0; !req.done(); ++spin) {
    if (spin > 1000) std::this_thread::sleep_for(std::chrono::microseconds(200));
    if (std::chrono::duration<double>(Clock::now() - t0).count() > options.watchdog_s)
      throw CommError(fmt::format("{} waited more than {:.0f} s for its peers: {}", op_name(i),
                                  options.watchdog_s, laggard(i)));
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
      be.copy_device(at<std::byte>(op.buffer), at<std::byte>(op.buffer_in), bytes(op.buffer_in));
    return;
  }
  PEFTPLAN_CHECK_MSG(comm != nullptr && comm->size() == N, "a {}-rank program needs a communicator of {} ranks", N, N);
  if (op.buffer < 0) {  // a scalar reduction (sim::verify: an 8-byte all_reduce), on the host
    const bool loss = op.reduction == sim::ScalarReduction::loss_sum;
    PEFTPLAN_CHECK_MSG(loss || op.reduction == sim::ScalarReduction::grad_sumsq, "{} reduces no scalar the executor knows", op_name(i));
    wait_through(i);
    double* v = loss ? &loss_sum : &sumsq;  // this rank's sum, staged from its device scalar
    *v = read_scalar(loss ? kLossSlot : kNormSlot);
    (loss ? loss_on_host : norm_on_host) = true;
    auto req = comm->all_reduce_async(v, v, 1, CommDType::fp64, ReduceOp::sum);
    wait(*req, i);
    return;
  }
  PEFTPLAN_CHECK_MSG(bytes(op.buffer) == op.bytes, "{}: payload {} bytes, op {} bytes", op_name(i), bytes(op.buffer), op.bytes);
  // The payload is ready once the kernels before it have run: this communicator reads memory
  // from its own thread, so the compute queue is drained first (a no-op on the CPU backend).
  be.synchronize();
  // The arrays are the compute dtype's: gradients and the adapter's parameters (fp32, or bf16
  // in mixed precision, summed in fp32 and rounded as NCCL's bf16 reductions do).
  const CommDType cdt = dt == DType::bf16 ? CommDType::bf16 : CommDType::fp32;
  const std::uint64_t e = es();
  std::byte* p = at<std::byte>(op.buffer);
  const std::size_t n = op.bytes / e;
  Pending pd;
  pd.op = i;
  pd.root = root_of(op.buffer);
  switch (op.collective) {
    case sim::Collective::all_reduce:
      pd.req = comm->all_reduce_async(p, p, n, cdt, ReduceOp::sum);
      break;
    case sim::Collective::reduce_scatter: {
      const std::size_t rc = n / static_cast<std::size_t>(N);
      std::byte* mine = p + static_cast<std::size_t>(rank) * rc * e;
      if (op.buffer_out >= 0) PEFTPLAN_CHECK(static_cast<std::size_t>(elems(op.buffer_out)) == rc);
      if (op.buffer_out >= 0 && !op.accumulate) {
        pd.req = comm->reduce_scatter_async(p, vp(op.buffer_out), rc, cdt, ReduceOp::sum);
      } else {
        pd.req = comm->reduce_scatter_async(p, mine, rc, cdt, ReduceOp::sum);
        if (op.buffer_out >= 0) {
          const std::int32_t out = op.buffer_out;
          pd.after = [this, out, mine, rc] { be.add(dt, vp(out), mine, vp(out), static_cast<std::int64_t>(rc)); };
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
      pd.req = comm->all_gather_async(p + static_cast<std::size_t>(rank) * sc * e, p, sc, cdt);
      break;
    }
    case sim::Collective::broadcast:
      throw InternalError(fmt::format("the executor's programs have no broadcast ({})", op_name(i)));
  }
  pending.push_back(std::move(pd));
}

// A copy between device and host buffers (offload), on the backend's copy queue: Op::buffer to
// Op::buffer_out; a side N times the copy's bytes contributes this rank's block.
void Session::Impl::copy(const sim::Op& op) {
  PEFTPLAN_CHECK_MSG(op.buffer >= 0 && op.buffer_out >= 0, "a copy of the executor's program names no source or destination");
  auto block = [&](std::int32_t id) {
    auto* p = at<std::byte>(id);
    if (bytes(id) == op.bytes) return p;
    PEFTPLAN_CHECK(bytes(id) == op.bytes * static_cast<std::uint64_t>(N));
    return p + static_cast<std::uint64_t>(rank) * op.bytes;
  };
  be.copy_async(block(op.buffer_out), block(op.buffer), op.bytes);
}

// Before an op that reads what a copy it depends on wrote: the compute queue waits for the copy,
// or, for an op on the host (the offloaded optimizer's step), the host does.
void Session::Impl::wait_for_copy_deps(const sim::Op& op) {
  for (std::int32_t dep : program.deps_of(op)) {
    if (program.ops[static_cast<std::size_t>(dep)].kind != OpKind::copy) continue;
    if (op.stream == sim::Stream::host) be.wait_mark_on_host(end_mark(static_cast<std::size_t>(dep)));
    else be.wait_mark(Backend::Queue::compute, end_mark(static_cast<std::size_t>(dep)));
  }
}

// Before a buffer's memory goes back to the allocator: the queued copies that read or write it
// have finished. A device buffer's next user is a kernel, or a copy ordered after the kernels, so
// the compute queue waits; a host buffer's is the host (the offloaded optimizer), which waits.
void Session::Impl::wait_for_copies(std::int32_t root) {
  const bool host = sim::on_host(program.buffers[static_cast<std::size_t>(root)].category);
  for (const QueuedCopy& c : copies)
    if (c.from == root || c.to == root) {
      if (host) be.wait_mark_on_host(end_mark(c.op));
      else be.wait_mark(Backend::Queue::compute, end_mark(c.op));
    }
}


}  // namespace peftplan::executor
