// The one-rank Communicator (communicator.h make_self_communicator): what a job of one rank runs
// on when the build has no MPI, and what tests of code above the Communicator can use without
// mpirun. With one rank every collective's result is this rank's own input, so an operation is a
// copy from send to recv (none when it is in place) done on the calling thread before the async
// form returns; its request is already complete.
//
// Deliberately not here: a communication thread (nothing waits on a peer, so there is nothing to
// overlap), a progress board (no peer to name), and MPI's int-count limit (no library under it).
// What the MPI communicator refuses as a misuse (reducing fp16, bf16 but by a sum, a root that is not a rank),
// this one refuses too, so that code tried on one rank does not first fail on two.
#include <chrono>
#include <cstring>
#include <memory>
#include <mutex>
#include <utility>

#include <fmt/format.h>

#include "peftplan/common/error.h"
#include "peftplan/executor/communicator.h"

namespace peftplan::executor {
namespace {

class DoneRequest final : public CommRequest {
 public:
  explicit DoneRequest(double seconds) : seconds_(seconds) {}
  void wait() override {}
  bool done() override { return true; }
  double seconds() override { return seconds_; }

 private:
  double seconds_;
};

void check_reducible(CommDType t, ReduceOp op) {
  PEFTPLAN_CHECK_MSG(t != CommDType::fp16 && (t != CommDType::bf16 || op == ReduceOp::sum),
                     "the communicator cannot reduce {} by anything but a bf16 sum (what the MPI one reduces)", name_of(t));
}

class SelfCommunicator final : public Communicator {
 public:
  explicit SelfCommunicator(MemoryCopy copy) : copy_(std::move(copy)) {}
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string_view backend() const override { return "self"; }

  std::unique_ptr<CommRequest> all_reduce_async(const void* send, void* recv, std::size_t count, CommDType dtype,
                                                ReduceOp op) override {
    check_reducible(dtype, op);
    return run(CommKind::all_reduce, send, recv, count * bytes_of(dtype));
  }

  // One rank receives block 0, the whole array; in place means recv == send (+ 0 · recv_count).
  std::unique_ptr<CommRequest> reduce_scatter_async(const void* send, void* recv, std::size_t recv_count,
                                                    CommDType dtype, ReduceOp op) override {
    check_reducible(dtype, op);
    return run(CommKind::reduce_scatter, send, recv, recv_count * bytes_of(dtype));
  }

  // The gathered array is this rank's block alone; in place means send == recv (+ 0 · send_count).
  std::unique_ptr<CommRequest> all_gather_async(const void* send, void* recv, std::size_t send_count,
                                                CommDType dtype) override {
    return run(CommKind::all_gather, send, recv, send_count * bytes_of(dtype));
  }

  std::unique_ptr<CommRequest> broadcast_async(const void* send, void* recv, std::size_t count, CommDType dtype,
                                               int root) override {
    PEFTPLAN_CHECK_MSG(root == 0, "broadcast root {} of 1 rank", root);
    return run(CommKind::broadcast, send, recv, count * bytes_of(dtype));
  }

  std::unique_ptr<CommRequest> barrier_async() override { return run(CommKind::barrier, nullptr, nullptr, 0); }

  std::unique_ptr<Communicator> split(int color, int) override {
    if (color < 0) return nullptr;
    return make_self_communicator(copy_);
  }

  CommCounters counters() const override {
    std::lock_guard lock(m_);
    return counters_;
  }
  void reset_counters() override {
    std::lock_guard lock(m_);
    counters_ = CommCounters{};
  }

 private:
  MemoryCopy copy_;  // empty: memmove (host memory)
  // Copies `bytes` from send to recv unless they are one buffer, and counts it under `kind`
  // (nccl-tests sizes: with one rank the whole array is the one block).
  std::unique_ptr<CommRequest> run(CommKind kind, const void* send, void* recv, std::size_t bytes) {
    const auto t0 = std::chrono::steady_clock::now();
    if (send != recv && bytes > 0) {
      if (copy_)
        copy_(recv, send, bytes);
      else
        std::memmove(recv, send, bytes);
    }
    const std::chrono::duration<double> dt = std::chrono::steady_clock::now() - t0;
    {
      std::lock_guard lock(m_);
      CommCounter& k = counters_[kind];
      ++k.calls;
      k.bytes += bytes;
      k.seconds += dt.count();
    }
    return std::make_unique<DoneRequest>(dt.count());
  }

  mutable std::mutex m_;
  CommCounters counters_;
};

}  // namespace

std::unique_ptr<Communicator> make_self_communicator(MemoryCopy copy) {
  return std::make_unique<SelfCommunicator>(std::move(copy));
}

}  // namespace peftplan::executor
