// The NCCL communicator (communicator.h make_nccl_communicator), compiled where the CUDA toolkit
// and NCCL are found (comm/nccl_absent.cpp elsewhere).
//
// Streams and events (CUDA Runtime API, "Stream Management" and "Event Management"; NCCL docs,
// "CUDA Stream Semantics"): every operation runs on the communicator's own stream, made
// non-blocking so that it never serialises with the legacy default stream. Before the library
// call that stream waits for an event recorded on the backend's compute stream, so a collective
// sees every kernel the runner enqueued before it and overlaps the ones enqueued after; its
// completion is an event on the communicator's stream, which the request polls (done) and the
// host waits for (wait) before the runner's next use of the buffer. Operations are issued in call
// order on that one stream, as NCCL requires of every rank.
//
// Host buffers (the runner's scalar reductions, a checkpoint's gathered shards) are staged: NCCL
// moves device memory only, so such an operation copies its input into a pinned buffer of its own
// on the host at the call, from there into a device scratch buffer on the communicator's stream,
// runs in place there, copies the result back into the pinned buffer before its completion event,
// and into the caller's memory when the request sees that event. Pinned memory keeps every copy
// asynchronous: a copy between the device and pageable memory returns only when it is done (CUDA
// Runtime API, "API synchronization behavior"), which would block the call until the collective
// finished, before the runner's watchdog could time it. The device scratch grows stream-ordered
// (cudaFreeAsync, cudaMallocAsync), so nothing waits for the device.
//
// Timing: a request's seconds are cudaEventElapsedTime between events recorded just before and
// just after the library call on the communicator's stream (staging copies excluded), which the
// CUDA documentation gives to about 0.5 microseconds.
//
// Errors: a failed call is a CommError naming file:line, the call, ncclGetErrorString and
// ncclGetLastError's detail; while a request is polled, ncclCommGetAsyncError reports what a peer's
// failure or a network error left behind (NCCL docs, "Error handling and communicator abort").
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include <fmt/format.h>

#include "../cuda/cuda_backend.h"
#include "peftplan/common/error.h"
#include "peftplan/executor/communicator.h"

namespace peftplan::executor {
namespace {

[[noreturn]] void fail(const char* call, const char* file, int line, const std::string& why) {
  throw CommError(fmt::format("{}:{}: {} failed: {}", file, line, call, why));
}

void check_nccl(ncclResult_t r, const char* call, const char* file, int line) {
  if (r == ncclSuccess) return;
  const char* detail = ncclGetLastError(nullptr);
  fail(call, file, line,
       fmt::format("{}{}{}", ncclGetErrorString(r), detail != nullptr && *detail != '\0' ? ": " : "", detail != nullptr ? detail : ""));
}

void check_cuda(cudaError_t e, const char* call, const char* file, int line) {
  if (e == cudaSuccess) return;
  cudaGetLastError();  // clears a non-sticky error so the next call does not report it again
  fail(call, file, line, cudaGetErrorString(e));
}

#define PEFTPLAN_NCCL(call) check_nccl((call), #call, __FILE__, __LINE__)
#define PEFTPLAN_CUDA(call) check_cuda((call), #call, __FILE__, __LINE__)

ncclDataType_t nccl_type(CommDType t) {
  switch (t) {
    case CommDType::fp32: return ncclFloat32;
    case CommDType::fp64: return ncclFloat64;
    case CommDType::fp16: return ncclFloat16;
    case CommDType::bf16: return ncclBfloat16;
    case CommDType::int32: return ncclInt32;
    case CommDType::int64: return ncclInt64;
    case CommDType::uint8: return ncclUint8;
  }
  throw CommError(fmt::format("no NCCL type for element type {}", static_cast<int>(t)));
}

ncclRedOp_t nccl_op(ReduceOp o) {
  switch (o) {
    case ReduceOp::sum: return ncclSum;
    case ReduceOp::max: return ncclMax;
    case ReduceOp::min: return ncclMin;
  }
  throw CommError(fmt::format("no NCCL reduction for op {}", static_cast<int>(o)));
}

// Whether NCCL can read and write p directly: device memory (and managed memory, which the driver
// migrates). Pinned or pageable host memory is staged.
bool device_pointer(const void* p) {
  if (p == nullptr) return true;  // nothing to stage (a broadcast's send on a non-root rank)
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
}

// Pinned host buffers, reused by size (cudaMallocHost costs far more than a collective of a few
// bytes): a request takes one at its call and gives it back when it completes.
class PinnedPool {
 public:
  PinnedPool() = default;
  PinnedPool(const PinnedPool&) = delete;
  PinnedPool& operator=(const PinnedPool&) = delete;
  ~PinnedPool() {
    for (auto& [bytes, p] : free_) cudaFreeHost(p);
  }
  // A buffer of at least `bytes` (its size, a power of two from 4 KiB, in *size).
  void* take(std::uint64_t bytes, std::uint64_t* size) {
    std::uint64_t b = 4096;
    while (b < bytes) b *= 2;
    *size = b;
    {
      std::lock_guard lock(m_);
      if (auto it = free_.find(b); it != free_.end()) {
        void* p = it->second;
        free_.erase(it);
        return p;
      }
    }
    void* p = nullptr;
    PEFTPLAN_CUDA(cudaMallocHost(&p, b));
    return p;
  }
  void give_back(void* p, std::uint64_t size) {
    std::lock_guard lock(m_);
    free_.emplace(size, p);
  }

 private:
  std::mutex m_;
  std::multimap<std::uint64_t, void*> free_;
};

// What the communicator and its requests share: the NCCL communicator, the streams, the counters
// and the staging buffers. Released after the last request that uses it.
struct Shared {
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;        // the communicator's own
  cudaStream_t compute = nullptr;       // the backend's, which every operation waits for
  int rank = 0, size = 1;
  std::mutex m;                         // the counters
  CommCounters counters;
  void* scratch = nullptr;              // device staging for host buffers, grown stream-ordered
  std::uint64_t scratch_bytes = 0;      //   (by the issuing thread, under the issue lock)
  int* barrier_word = nullptr;          // a one-int all_reduce is the barrier
  PinnedPool pinned;

  Shared() = default;
  Shared(const Shared&) = delete;
  Shared& operator=(const Shared&) = delete;
  ~Shared() {
    // Released while an error unwinds (the runner's watchdog, a failed collective), or after
    // NCCL reported one, the communicator may have work that never completes (a stalled peer):
    // ncclCommAbort stops it instead of waiting for it (NCCL docs, "Fault tolerance").
    ncclResult_t async = ncclSuccess;
    if (comm != nullptr) ncclCommGetAsyncError(comm, &async);
    const bool abort = std::uncaught_exceptions() > 0 || (async != ncclSuccess && async != ncclInProgress);
    if (comm != nullptr) {
      if (abort) {
        ncclCommAbort(comm);
      } else {
        cudaStreamSynchronize(stream);
        ncclCommDestroy(comm);
      }
    }
    if (!abort && stream != nullptr) {
      if (scratch != nullptr) cudaFreeAsync(scratch, stream);
      cudaStreamSynchronize(stream);
    }
    if (barrier_word != nullptr) cudaFree(barrier_word);
    if (stream != nullptr) cudaStreamDestroy(stream);
  }

  // Reports an error NCCL recorded asynchronously (a peer that failed, a network error).
  void check_async() const {
    ncclResult_t r = ncclSuccess;
    PEFTPLAN_NCCL(ncclCommGetAsyncError(comm, &r));
    if (r != ncclSuccess && r != ncclInProgress) check_nccl(r, "a collective on the NCCL stream", __FILE__, __LINE__);
  }

  // A device buffer of at least `bytes` for staging, in stream order: the old one is freed after
  // the operations already on the stream, the new one allocated before the next.
  void* staging(std::uint64_t bytes) {
    if (bytes <= scratch_bytes) return scratch;
    if (scratch != nullptr) PEFTPLAN_CUDA(cudaFreeAsync(scratch, stream));
    scratch = nullptr;
    scratch_bytes = 0;
    PEFTPLAN_CUDA(cudaMallocAsync(&scratch, bytes, stream));
    scratch_bytes = bytes;
    return scratch;
  }
};

// The events of one operation, created and destroyed together (also when creating one fails).
struct Events {
  cudaEvent_t ready = nullptr;     // on the compute stream: the work before the call
  cudaEvent_t start = nullptr;     // on the communicator's stream, around the library call
  cudaEvent_t stop = nullptr;
  cudaEvent_t complete = nullptr;  // after the copy back of a staged operation
  Events() {
    try {
      PEFTPLAN_CUDA(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
      PEFTPLAN_CUDA(cudaEventCreate(&start));
      PEFTPLAN_CUDA(cudaEventCreate(&stop));
      PEFTPLAN_CUDA(cudaEventCreateWithFlags(&complete, cudaEventDisableTiming));
    } catch (...) {
      release();
      throw;
    }
  }
  Events(const Events&) = delete;
  Events& operator=(const Events&) = delete;
  ~Events() { release(); }
  void release() {
    for (cudaEvent_t* e : {&ready, &start, &stop, &complete})
      if (*e != nullptr) {
        cudaEventDestroy(*e);
        *e = nullptr;
      }
  }
};

// A staged operation's host side: its pinned buffer, and where its result goes once complete.
struct HostStage {
  void* pinned = nullptr;
  std::uint64_t pinned_size = 0;
  void* out = nullptr;             // the caller's host memory (null: the result stays on the device)
  std::uint64_t out_offset = 0;    // where in the pinned buffer the result lies
  std::uint64_t out_bytes = 0;
};

class NcclRequest final : public CommRequest {
 public:
  NcclRequest(std::shared_ptr<Shared> s, std::unique_ptr<Events> ev, HostStage stage, CommKind kind, std::uint64_t bytes)
      : s_(std::move(s)), ev_(std::move(ev)), stage_(stage), kind_(kind), bytes_(bytes) {}
  ~NcclRequest() override {
    // While an error unwinds, a pending operation may never complete (the peer it waits for
    // stalled): leave it to the communicator's abort rather than wait here. Its pinned buffer is
    // not given back, since the device may still write it.
    if (std::uncaught_exceptions() > 0 && !finished_) return;
    try {
      wait();
    } catch (...) {
      // A destructor does not throw; the failure was or will be reported by the communicator.
    }
  }

  void wait() override {
    for (int spin = 0; !done(); ++spin)
      if (spin > 1000) std::this_thread::sleep_for(std::chrono::microseconds(50));
  }

  bool done() override {
    if (finished_) return true;
    const cudaError_t e = cudaEventQuery(ev_->complete);
    if (e == cudaErrorNotReady) {
      s_->check_async();
      return false;
    }
    PEFTPLAN_CUDA(e);
    float ms = 0.0f;
    PEFTPLAN_CUDA(cudaEventElapsedTime(&ms, ev_->start, ev_->stop));
    seconds_ = 1e-3 * static_cast<double>(ms);
    if (stage_.pinned != nullptr) {
      if (stage_.out != nullptr && stage_.out_bytes > 0)
        std::memcpy(stage_.out, static_cast<const std::byte*>(stage_.pinned) + stage_.out_offset, stage_.out_bytes);
      s_->pinned.give_back(stage_.pinned, stage_.pinned_size);
      stage_.pinned = nullptr;
    }
    finished_ = true;
    std::lock_guard lock(s_->m);
    CommCounter& k = s_->counters[kind_];
    ++k.calls;
    k.bytes += bytes_;
    k.seconds += seconds_;
    return true;
  }

  double seconds() override { return finished_ ? seconds_ : -1.0; }

 private:
  std::shared_ptr<Shared> s_;
  std::unique_ptr<Events> ev_;
  HostStage stage_;
  CommKind kind_;
  std::uint64_t bytes_;
  bool finished_ = false;
  double seconds_ = -1.0;
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(std::shared_ptr<Shared> s, std::unique_ptr<Communicator> bootstrap)
      : s_(std::move(s)), bootstrap_(std::move(bootstrap)) {}

  int rank() const override { return s_->rank; }
  int size() const override { return s_->size; }
  std::string_view backend() const override { return "nccl"; }
  // The bootstrap communicator's board (MPI's ranks on a node share one), so that the runner's
  // watchdog can still name a stalled peer.
  ProgressBoard* progress() override { return bootstrap_ ? bootstrap_->progress() : nullptr; }

  std::unique_ptr<CommRequest> all_reduce_async(const void* send, void* recv, std::size_t count, CommDType dtype,
                                                ReduceOp op) override {
    const std::uint64_t bytes = count * bytes_of(dtype);
    return issue(CommKind::all_reduce, bytes, bytes, send, recv, [&](Op& o) {
      if (!o.staged()) return PEFTPLAN_NCCL(ncclAllReduce(send, recv, count, nccl_type(dtype), nccl_op(op), s_->comm, s_->stream));
      o.in(0, send, bytes);
      PEFTPLAN_NCCL(ncclAllReduce(o.dev, o.dev, count, nccl_type(dtype), nccl_op(op), s_->comm, s_->stream));
      o.stop();
      o.out(recv, 0, bytes);
    });
  }

  std::unique_ptr<CommRequest> reduce_scatter_async(const void* send, void* recv, std::size_t recv_count, CommDType dtype,
                                                    ReduceOp op) override {
    const std::uint64_t block = recv_count * bytes_of(dtype), whole = block * static_cast<std::uint64_t>(s_->size);
    return issue(CommKind::reduce_scatter, whole, whole, send, recv, [&](Op& o) {
      if (!o.staged())
        return PEFTPLAN_NCCL(ncclReduceScatter(send, recv, recv_count, nccl_type(dtype), nccl_op(op), s_->comm, s_->stream));
      // In place in the scratch: this rank's block is where NCCL's in-place form puts it.
      const std::uint64_t mine = static_cast<std::uint64_t>(s_->rank) * block;
      o.in(0, send, whole);
      PEFTPLAN_NCCL(ncclReduceScatter(o.dev, o.at(mine), recv_count, nccl_type(dtype), nccl_op(op), s_->comm, s_->stream));
      o.stop();
      o.out(recv, mine, block);
    });
  }

  std::unique_ptr<CommRequest> all_gather_async(const void* send, void* recv, std::size_t send_count, CommDType dtype) override {
    const std::uint64_t block = send_count * bytes_of(dtype), whole = block * static_cast<std::uint64_t>(s_->size);
    return issue(CommKind::all_gather, whole, whole, send, recv, [&](Op& o) {
      if (!o.staged()) return PEFTPLAN_NCCL(ncclAllGather(send, recv, send_count, nccl_type(dtype), s_->comm, s_->stream));
      const std::uint64_t mine = static_cast<std::uint64_t>(s_->rank) * block;
      o.in(mine, send, block);
      PEFTPLAN_NCCL(ncclAllGather(o.at(mine), o.dev, send_count, nccl_type(dtype), s_->comm, s_->stream));
      o.stop();
      o.out(recv, 0, whole);
    });
  }

  std::unique_ptr<CommRequest> broadcast_async(const void* send, void* recv, std::size_t count, CommDType dtype, int root) override {
    PEFTPLAN_CHECK_MSG(root >= 0 && root < s_->size, "broadcast root {} of {} ranks", root, s_->size);
    const std::uint64_t bytes = count * bytes_of(dtype);
    const void* from = s_->rank == root ? send : nullptr;  // NCCL reads send on the root only
    return issue(CommKind::broadcast, bytes, bytes, from, recv, [&](Op& o) {
      if (!o.staged()) return PEFTPLAN_NCCL(ncclBroadcast(from, recv, count, nccl_type(dtype), root, s_->comm, s_->stream));
      o.in(0, from, from != nullptr ? bytes : 0);  // a non-root rank copies nothing in
      PEFTPLAN_NCCL(ncclBroadcast(o.dev, o.dev, count, nccl_type(dtype), root, s_->comm, s_->stream));
      o.stop();
      o.out(recv, 0, bytes);
    });
  }

  std::unique_ptr<CommRequest> barrier_async() override {
    return issue(CommKind::barrier, 0, 0, s_->barrier_word, s_->barrier_word, [&](Op&) {
      PEFTPLAN_NCCL(ncclAllReduce(s_->barrier_word, s_->barrier_word, 1, ncclInt32, ncclSum, s_->comm, s_->stream));
    });
  }

  // ncclCommSplit (NCCL 2.18): collective over this communicator; a negative color takes no part.
  std::unique_ptr<Communicator> split(int color, int key) override {
    std::lock_guard lock(issue_m_);
    ncclComm_t part = nullptr;
    PEFTPLAN_NCCL(ncclCommSplit(s_->comm, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &part, nullptr));
    if (part == nullptr) return nullptr;
    auto s = std::make_shared<Shared>();
    s->comm = part;
    s->compute = s_->compute;
    PEFTPLAN_NCCL(ncclCommUserRank(part, &s->rank));
    PEFTPLAN_NCCL(ncclCommCount(part, &s->size));
    PEFTPLAN_CUDA(cudaStreamCreateWithFlags(&s->stream, cudaStreamNonBlocking));
    PEFTPLAN_CUDA(cudaMalloc(reinterpret_cast<void**>(&s->barrier_word), sizeof(int)));
    PEFTPLAN_CUDA(cudaMemset(s->barrier_word, 0, sizeof(int)));
    return std::make_unique<NcclCommunicator>(std::move(s), nullptr);
  }

  CommCounters counters() const override {
    std::lock_guard lock(s_->m);
    return s_->counters;
  }
  void reset_counters() override {
    std::lock_guard lock(s_->m);
    s_->counters = CommCounters{};
  }

 private:
  // One operation being issued: its events, and for a staged one the device scratch (`dev`, the
  // staged layout at byte offsets) and the pinned host buffer mirroring it.
  struct Op {
    Shared& s;
    Events& ev;
    HostStage& stage;
    std::byte* dev = nullptr;     // null: send and recv are device memory, used as they are
    bool stopped = false;
    bool staged() const { return dev != nullptr; }
    std::byte* at(std::uint64_t offset) const { return dev + offset; }
    // `bytes` of `src` into the scratch at `offset` (through the pinned buffer when src is host
    // memory, copied there now), then the timing starts.
    void in(std::uint64_t offset, const void* src, std::uint64_t bytes) {
      if (bytes > 0) {
        const void* from = src;
        if (!device_pointer(src)) {
          auto* pinned = static_cast<std::byte*>(stage.pinned) + offset;
          std::memcpy(pinned, src, bytes);
          from = pinned;
        }
        PEFTPLAN_CUDA(cudaMemcpyAsync(dev + offset, from, bytes, cudaMemcpyDefault, s.stream));
      }
      PEFTPLAN_CUDA(cudaEventRecord(ev.start, s.stream));
    }
    // After the timing stops: `bytes` at `offset` of the scratch to `dst` (host memory through the
    // pinned buffer, copied out when the request completes).
    void out(void* dst, std::uint64_t offset, std::uint64_t bytes) {
      if (bytes == 0) return;
      if (device_pointer(dst)) {
        PEFTPLAN_CUDA(cudaMemcpyAsync(dst, dev + offset, bytes, cudaMemcpyDefault, s.stream));
        return;
      }
      PEFTPLAN_CUDA(cudaMemcpyAsync(static_cast<std::byte*>(stage.pinned) + offset, dev + offset, bytes, cudaMemcpyDefault, s.stream));
      stage.out = dst;
      stage.out_offset = offset;
      stage.out_bytes = bytes;
    }
    void stop() {
      if (stopped) return;
      PEFTPLAN_CUDA(cudaEventRecord(ev.stop, s.stream));
      stopped = true;
    }
  };

  // Orders the communicator's stream after the compute stream's work so far, then runs `call`
  // (staged through `layout` bytes of scratch when send or recv is host memory) between the
  // timing events, and records the completion event.
  template <class Call>
  std::unique_ptr<CommRequest> issue(CommKind kind, std::uint64_t bytes, std::uint64_t layout, const void* send, const void* recv,
                                     Call&& call) {
    std::lock_guard lock(issue_m_);
    s_->check_async();
    auto ev = std::make_unique<Events>();
    HostStage stage;
    Op o{*s_, *ev, stage};
    if (s_->compute != nullptr) {
      PEFTPLAN_CUDA(cudaEventRecord(ev->ready, s_->compute));
      PEFTPLAN_CUDA(cudaStreamWaitEvent(s_->stream, ev->ready, 0));
    }
    if (!device_pointer(send) || !device_pointer(recv)) {
      const std::uint64_t n = std::max<std::uint64_t>(layout, 1);
      o.dev = static_cast<std::byte*>(s_->staging(n));
      stage.pinned = s_->pinned.take(n, &stage.pinned_size);
    } else {
      PEFTPLAN_CUDA(cudaEventRecord(ev->start, s_->stream));
    }
    try {
      call(o);
      o.stop();
      PEFTPLAN_CUDA(cudaEventRecord(ev->complete, s_->stream));
    } catch (...) {
      // What was enqueued may still read the pinned buffer: wait for it before giving it back.
      cudaStreamSynchronize(s_->stream);
      if (stage.pinned != nullptr) s_->pinned.give_back(stage.pinned, stage.pinned_size);
      throw;
    }
    return std::make_unique<NcclRequest>(s_, std::move(ev), stage, kind, bytes);
  }

  std::shared_ptr<Shared> s_;
  std::unique_ptr<Communicator> bootstrap_;  // kept for its progress board
  std::mutex issue_m_;                       // one caller at a time enqueues (the order every rank shares)
};

}  // namespace

// NCCL runs where the CUDA backend can: on a machine with a CUDA device.
std::string nccl_communicator_unavailable() { return cuda_backend_unavailable(); }

std::unique_ptr<Communicator> make_nccl_communicator(std::unique_ptr<Communicator> bootstrap, void* compute_stream) {
  PEFTPLAN_CHECK_MSG(bootstrap != nullptr, "make_nccl_communicator needs a bootstrap communicator");
  if (const std::string why = nccl_communicator_unavailable(); !why.empty())
    throw InputError(fmt::format("the NCCL communicator: {}", why));
  // Rank 0's unique id reaches every rank over the bootstrap communicator (MPI, or one rank's),
  // as NCCL's examples do with MPI_Bcast (NCCL docs, "Example 2: One Device per Process or Thread").
  ncclUniqueId id{};
  if (bootstrap->rank() == 0) PEFTPLAN_NCCL(ncclGetUniqueId(&id));
  bootstrap->broadcast(&id, &id, sizeof id, CommDType::uint8, 0);
  auto s = std::make_shared<Shared>();
  s->rank = bootstrap->rank();
  s->size = bootstrap->size();
  s->compute = static_cast<cudaStream_t>(compute_stream);
  PEFTPLAN_NCCL(ncclCommInitRank(&s->comm, s->size, id, s->rank));
  PEFTPLAN_CUDA(cudaStreamCreateWithFlags(&s->stream, cudaStreamNonBlocking));
  PEFTPLAN_CUDA(cudaMalloc(reinterpret_cast<void**>(&s->barrier_word), sizeof(int)));
  PEFTPLAN_CUDA(cudaMemset(s->barrier_word, 0, sizeof(int)));
  return std::make_unique<NcclCommunicator>(std::move(s), std::move(bootstrap));
}

}  // namespace peftplan::executor
