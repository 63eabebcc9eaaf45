// The MPI Communicator (see communicator.h): collectives over host memory with MPI.
//
// Threading design. Each communicator owns one communication thread and a FIFO queue; every
// operation, synchronous or asynchronous, is a job on that queue, and the thread runs the jobs
// one at a time in call order. So
//   - all ranks issue their MPI collectives on a communicator in program order, whatever mix of
//     sync and async calls the caller makes (MPI requires the same order on every rank);
//   - the caller's thread never enters MPI after construction, so backward compute on the
//     caller's thread overlaps with a reduction in flight: the reduction progresses because the
//     communication thread tests it (MPI_Test drives MPI's progress engine), not because the
//     caller polls;
//   - MPI needs only MPI_THREAD_SERIALIZED while a single communicator is in use (calls come from
//     one thread at a time, and not from the thread that initialised MPI, which rules out
//     FUNNELED). MpiRuntime asks for MPI_THREAD_MULTIPLE, which several communicators active at
//     once need (each has its own thread); with only SERIALIZED, use one at a time.
// Every collective and barrier is nonblocking (MPI_Iallreduce, MPI_Iallgather, ...) and waited
// for with MPI_Test, back to back for 20 us and then with sleeps in between (wait_low_cpu), so
// that a rank whose peer has not arrived yet leaves the core to the ranks' compute threads. MPI's
// own blocking calls poll, and on a host whose ranks fill the cores that polling thread took the
// core from its rank's compute: ZeRO-3's all-gathers, pending while the layers compute, made
// tiny-llama-4l's steps 28% longer than DDP's; waiting this way, 3% (bench/accuracy.sh --quick,
// 4 x 256 tokens, 2 ranks on 2 cores). The sleeps cost latency when a peer is late, which the
// calibration measures like every other cost of the collectives.
//
// Every MPI call goes through PEFTPLAN_MPI_CHECK, which throws CommError with file:line, the call
// and MPI_Error_string's text; communicators are created with MPI_ERRORS_RETURN so that the
// check sees errors instead of MPI aborting the job.
#include <fcntl.h>
#include <mpi.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <new>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "peftplan/common/error.h"
#include "peftplan/executor/communicator.h"
#include "peftplan/executor/kernels.h"

namespace peftplan::executor {
namespace {

[[noreturn]] void throw_mpi_error(int rc, const char* call, const char* file, int line) {
  char text[MPI_MAX_ERROR_STRING] = {};
  int len = 0;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) len = 0;
  throw CommError(fmt::format("{}:{}: {} failed: {} (MPI error {})", file, line, call,
                              std::string(text, static_cast<std::size_t>(len)), rc));
}

#define PEFTPLAN_MPI_CHECK(call)                                             \
  do {                                                                       \
    const int peftplan_mpi_rc_ = (call);                                     \
    if (peftplan_mpi_rc_ != MPI_SUCCESS)                                     \
      throw_mpi_error(peftplan_mpi_rc_, #call, __FILE__, __LINE__);          \
  } while (0)

MPI_Datatype mpi_type(CommDType t) {
  switch (t) {
    case CommDType::fp32: return MPI_FLOAT;
    case CommDType::fp64: return MPI_DOUBLE;
    case CommDType::fp16:
    case CommDType::bf16: return MPI_UINT16_T;  // raw bits; bf16 sums through bf16_sum_op below
    case CommDType::int32: return MPI_INT32_T;
    case CommDType::int64: return MPI_INT64_T;
    case CommDType::uint8: return MPI_UINT8_T;
  }
  return MPI_DATATYPE_NULL;
}

MPI_Op mpi_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return MPI_SUM;
    case ReduceOp::max: return MPI_MAX;
    case ReduceOp::min: return MPI_MIN;
  }
  return MPI_OP_NULL;
}

// bf16 sums: MPI has no bf16 type, so bf16 arrays travel as MPI_UINT16_T under an operation of
// our own (MPI 4.0 §6.9.5, MPI_Op_create) that widens both operands to fp32, adds and rounds to
// nearest even: every step of the reduction rounds, as NCCL's bf16 sums do between ring steps.
// Commutative, so MPI may reduce in any order (the ranks still agree: MPI_Iallreduce gives every
// rank the same result for the same inputs with OpenMPI's algorithms; the DDP tests hold it).
void bf16_sum(void* in, void* inout, int* len, MPI_Datatype*) {
  const auto* a = static_cast<const std::uint16_t*>(in);
  auto* b = static_cast<std::uint16_t*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = cpu::fp32_to_bf16(cpu::bf16_to_fp32(a[i]) + cpu::bf16_to_fp32(b[i]));
}
MPI_Op bf16_sum_op() {  // made once, on the first communication thread that reduces bf16
  static const MPI_Op op = [] {
    MPI_Op o = MPI_OP_NULL;
    PEFTPLAN_MPI_CHECK(MPI_Op_create(&bf16_sum, 1, &o));
    return o;
  }();
  return op;
}
MPI_Op mpi_op(CommDType t, ReduceOp op) { return t == CommDType::bf16 ? bf16_sum_op() : mpi_op(op); }

void check_reducible(CommDType t, ReduceOp op) {
  PEFTPLAN_CHECK_MSG(t != CommDType::fp16 && (t != CommDType::bf16 || op == ReduceOp::sum),
                     "the MPI communicator cannot reduce {} by {} (MPI has no 16-bit float type; bf16 sums are our own operation)",
                     name_of(t), op == ReduceOp::sum ? "sum" : op == ReduceOp::max ? "max" : "min");
}

int mpi_count(std::size_t count) {
  PEFTPLAN_CHECK_MSG(count <= static_cast<std::size_t>(INT_MAX),
                     "{} elements exceed MPI's int count", count);
  return static_cast<int>(count);
}

// Owner of an MPI_Comm (freed on destruction). MPI_COMM_NULL owns nothing.
class CommHandle {
 public:
  explicit CommHandle(MPI_Comm c) : comm_(c) {}
  ~CommHandle() {
    if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);  // errors ignored in a destructor
  }
  CommHandle(const CommHandle&) = delete;
  CommHandle& operator=(const CommHandle&) = delete;
  MPI_Comm get() const { return comm_; }
  MPI_Comm release() { return std::exchange(comm_, MPI_COMM_NULL); }

 private:
  MPI_Comm comm_;
};

// Completion state shared by a job on the communication thread and its request.
struct OpState {
  std::mutex m;
  std::condition_variable cv;
  bool done = false;
  double seconds = -1.0;  // execution time on the communication thread, once done
  std::exception_ptr error;
};

class MpiRequest final : public CommRequest {
 public:
  explicit MpiRequest(std::shared_ptr<OpState> s) : s_(std::move(s)) {}
  // Waits for completion, except while an exception unwinds the caller: then the operation may
  // never complete (the watchdog's error is exactly that: a peer stalled), and waiting would keep
  // the error from ever reaching the code that ends the job. The job ends before the operation
  // could touch its buffers (peftplan-exec aborts it while the communicator still exists).
  ~MpiRequest() override {
    if (std::uncaught_exceptions() > 0) return;
    std::unique_lock lock(s_->m);
    s_->cv.wait(lock, [&] { return s_->done; });
  }
  void wait() override {
    std::unique_lock lock(s_->m);
    s_->cv.wait(lock, [&] { return s_->done; });
    if (s_->error) std::rethrow_exception(std::exchange(s_->error, nullptr));
  }
  bool done() override {
    std::lock_guard lock(s_->m);
    return s_->done;
  }
  double seconds() override {
    std::lock_guard lock(s_->m);
    return s_->done ? s_->seconds : -1.0;
  }

 private:
  std::shared_ptr<OpState> s_;
};

// One thread running queued jobs in FIFO order; the destructor finishes the queue, then joins.
class CommThread {
 public:
  CommThread() : thread_([this] { run(); }) {}
  ~CommThread() {
    {
      std::lock_guard lock(m_);
      stop_ = true;
    }
    cv_.notify_one();
    thread_.join();
  }
  CommThread(const CommThread&) = delete;
  CommThread& operator=(const CommThread&) = delete;

  void post(std::function<void()> job) {
    {
      std::lock_guard lock(m_);
      queue_.push_back(std::move(job));
    }
    cv_.notify_one();
  }

 private:
  void run() {
    for (;;) {
      std::function<void()> job;
      {
        std::unique_lock lock(m_);
        cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;
        job = std::move(queue_.front());
        queue_.pop_front();
      }
      job();  // jobs catch their own exceptions
    }
  }

  std::mutex m_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool stop_ = false;
  std::thread thread_;  // last: starts after the queue exists
};

// Waits for a nonblocking operation without holding a core: MPI_Test (which progresses it)
// back to back for a few microseconds, the time a collective between ready peers takes, then
// with sleeps in between that double from 10 us up to `longest` (see the file comment).
void wait_low_cpu(MPI_Request& req, std::chrono::microseconds longest) {
  using Clock = std::chrono::steady_clock;
  const auto spin_until = Clock::now() + std::chrono::microseconds(20);
  auto pause = std::chrono::microseconds(10);
  for (;;) {
    int flag = 0;
    PEFTPLAN_MPI_CHECK(MPI_Test(&req, &flag, MPI_STATUS_IGNORE));
    if (flag) return;
    if (Clock::now() < spin_until) continue;
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, longest);
  }
}

// Barrier that sleeps while it waits (see the file comment).
void low_cpu_barrier(MPI_Comm comm) {
  MPI_Request req = MPI_REQUEST_NULL;
  PEFTPLAN_MPI_CHECK(MPI_Ibarrier(comm, &req));
  wait_low_cpu(req, std::chrono::microseconds(1000));
}

// Collectives wait with a shorter longest sleep: they sit on the step's critical path.
constexpr std::chrono::microseconds kCollectiveLongestSleep{100};

// The ranks' positions (communicator.h) in POSIX shared memory, one slot per rank of a node:
// the node's first rank creates the segment under a fresh name, the others map it, and once all
// have it the name is unlinked, so nothing is left behind however the job ends (the mapping lives
// as long as a process does). Set up on the constructing thread, before the communication thread
// exists; after that no MPI call is made. Without /dev/shm the board is simply absent.
class ShmProgressBoard final : public ProgressBoard {
 public:
  struct Slot {
    std::atomic<std::int64_t> step, op, ns;  // ns: steady-clock time of the post
  };
  // Cross-process atomics must be lock-free (address-free): [atomics.lockfree] p4.
  static_assert(std::atomic<std::int64_t>::is_always_lock_free);

  // Collective over `world`; null on the ranks that could not map the segment.
  static std::unique_ptr<ShmProgressBoard> create(MPI_Comm world, int world_rank, int world_size) {
    MPI_Comm node_comm = MPI_COMM_NULL;
    PEFTPLAN_MPI_CHECK(MPI_Comm_split_type(world, MPI_COMM_TYPE_SHARED, world_rank, MPI_INFO_NULL, &node_comm));
    CommHandle node(node_comm);
    int node_rank = 0, node_size = 0;
    PEFTPLAN_MPI_CHECK(MPI_Comm_rank(node.get(), &node_rank));
    PEFTPLAN_MPI_CHECK(MPI_Comm_size(node.get(), &node_size));
    std::vector<int> world_of(static_cast<std::size_t>(node_size));
    PEFTPLAN_MPI_CHECK(MPI_Allgather(&world_rank, 1, MPI_INT, world_of.data(), 1, MPI_INT, node.get()));
    const std::size_t bytes = sizeof(Slot) * static_cast<std::size_t>(node_size);
    std::array<char, 64> name{};
    int fd = -1;
    if (node_rank == 0) {
      static std::atomic<int> serial{0};
      std::snprintf(name.data(), name.size(), "/peftplan-progress-%d-%d", static_cast<int>(::getpid()), serial++);
      fd = ::shm_open(name.data(), O_CREAT | O_EXCL | O_RDWR, 0600);
      if (fd >= 0 && ::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
        ::close(fd);
        ::shm_unlink(name.data());
        fd = -1;
      }
      if (fd < 0) name[0] = '\0';  // the others then skip it
    }
    PEFTPLAN_MPI_CHECK(MPI_Bcast(name.data(), static_cast<int>(name.size()), MPI_CHAR, 0, node.get()));
    if (node_rank != 0 && name[0] != '\0') fd = ::shm_open(name.data(), O_RDWR, 0600);
    void* base = MAP_FAILED;
    if (fd >= 0) {
      base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      ::close(fd);
    }
    PEFTPLAN_MPI_CHECK(MPI_Barrier(node.get()));  // every rank has mapped it (or given up)
    if (node_rank == 0 && name[0] != '\0') ::shm_unlink(name.data());
    if (base == MAP_FAILED) return nullptr;
    return std::unique_ptr<ShmProgressBoard>(new ShmProgressBoard(base, bytes, node_rank, world_of, world_size));
  }

  ~ShmProgressBoard() override { ::munmap(base_, bytes_); }
  ShmProgressBoard(const ShmProgressBoard&) = delete;
  ShmProgressBoard& operator=(const ShmProgressBoard&) = delete;

  void post(std::int64_t step, std::int64_t op) override {
    Slot& s = slots_[mine_];
    s.step.store(step, std::memory_order_relaxed);
    s.op.store(op, std::memory_order_relaxed);
    s.ns.store(now_ns(), std::memory_order_relaxed);
  }

  Position position(int rank) const override {
    Position p;
    if (rank < 0 || static_cast<std::size_t>(rank) >= slot_of_.size() || slot_of_[static_cast<std::size_t>(rank)] < 0) return p;
    const Slot& s = slots_[slot_of_[static_cast<std::size_t>(rank)]];
    const std::int64_t ns = s.ns.load(std::memory_order_relaxed);
    if (ns == 0) return p;  // nothing posted yet
    p.known = true;
    p.step = s.step.load(std::memory_order_relaxed);
    p.op = s.op.load(std::memory_order_relaxed);
    p.age_s = static_cast<double>(now_ns() - ns) * 1e-9;
    return p;
  }

 private:
  ShmProgressBoard(void* base, std::size_t bytes, int node_rank, const std::vector<int>& world_of, int world_size)
      : base_(base), bytes_(bytes), slots_(static_cast<Slot*>(base)), mine_(node_rank),
        slot_of_(static_cast<std::size_t>(world_size), -1) {
    // A fresh segment is zero-filled (shm_open + ftruncate), which is every slot's "nothing
    // posted"; each rank constructs only its own slot's atomics.
    new (&slots_[mine_]) Slot{{-1}, {-1}, {0}};
    for (std::size_t i = 0; i < world_of.size(); ++i) slot_of_[static_cast<std::size_t>(world_of[i])] = static_cast<int>(i);
  }
  static std::int64_t now_ns() {
    // steady_clock is CLOCK_MONOTONIC on Linux: one clock for every process of the node.
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
  }

  void* base_;
  std::size_t bytes_;
  Slot* slots_;
  int mine_;
  std::vector<int> slot_of_;  // world rank -> slot on this node, -1 elsewhere
};

class MpiCommunicator final : public Communicator {
 public:
  // Takes ownership of `comm`; rank and size were read on the thread that created it.
  MpiCommunicator(MPI_Comm comm, int rank, int size, std::unique_ptr<ShmProgressBoard> board = nullptr)
      : comm_(comm), rank_(rank), size_(size), board_(std::move(board)) {}

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string_view backend() const override { return "mpi"; }
  ProgressBoard* progress() override { return board_.get(); }

  std::unique_ptr<CommRequest> all_reduce_async(const void* send, void* recv, std::size_t count,
                                                CommDType dtype, ReduceOp op) override {
    check_reducible(dtype, op);
    const int n = mpi_count(count);
    const void* sbuf = send == recv ? MPI_IN_PLACE : send;
    return submit(CommKind::all_reduce, count * bytes_of(dtype), [=](MPI_Comm c) {
      MPI_Request req = MPI_REQUEST_NULL;
      PEFTPLAN_MPI_CHECK(MPI_Iallreduce(sbuf, recv, n, mpi_type(dtype), mpi_op(dtype, op), c, &req));
      wait_low_cpu(req, kCollectiveLongestSleep);
    });
  }

  std::unique_ptr<CommRequest> reduce_scatter_async(const void* send, void* recv,
                                                    std::size_t recv_count, CommDType dtype,
                                                    ReduceOp op) override {
    check_reducible(dtype, op);
    const int n = mpi_count(recv_count);
    mpi_count(recv_count * static_cast<std::size_t>(size_));
    const std::size_t block = recv_count * bytes_of(dtype);
    auto* base = static_cast<char*>(const_cast<void*>(send));
    const bool in_place = recv == base + static_cast<std::size_t>(rank_) * block;
    return submit(CommKind::reduce_scatter, block * static_cast<std::size_t>(size_),
                  [=, rank = rank_](MPI_Comm c) {
                    MPI_Request req = MPI_REQUEST_NULL;
                    if (in_place) {
                      // MPI's in-place form reads the whole array from the receive buffer and
                      // leaves this rank's block at its start; NCCL's leaves it at block `rank`.
                      PEFTPLAN_MPI_CHECK(MPI_Ireduce_scatter_block(MPI_IN_PLACE, base, n,
                                                                   mpi_type(dtype), mpi_op(dtype, op), c, &req));
                      wait_low_cpu(req, kCollectiveLongestSleep);
                      if (rank != 0) std::memmove(recv, base, block);
                    } else {
                      PEFTPLAN_MPI_CHECK(MPI_Ireduce_scatter_block(send, recv, n, mpi_type(dtype),
                                                                   mpi_op(dtype, op), c, &req));
                      wait_low_cpu(req, kCollectiveLongestSleep);
                    }
                  });
  }

  std::unique_ptr<CommRequest> all_gather_async(const void* send, void* recv,
                                                std::size_t send_count,
                                                CommDType dtype) override {
    const int n = mpi_count(send_count);
    mpi_count(send_count * static_cast<std::size_t>(size_));
    const std::size_t block = send_count * bytes_of(dtype);
    const bool in_place = send == static_cast<const char*>(recv) + static_cast<std::size_t>(rank_) * block;
    return submit(CommKind::all_gather, block * static_cast<std::size_t>(size_), [=](MPI_Comm c) {
      MPI_Request req = MPI_REQUEST_NULL;
      if (in_place)
        PEFTPLAN_MPI_CHECK(MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, recv, n,
                                          mpi_type(dtype), c, &req));
      else
        PEFTPLAN_MPI_CHECK(MPI_Iallgather(send, n, mpi_type(dtype), recv, n, mpi_type(dtype), c, &req));
      wait_low_cpu(req, kCollectiveLongestSleep);
    });
  }

  std::unique_ptr<CommRequest> broadcast_async(const void* send, void* recv, std::size_t count,
                                               CommDType dtype, int root) override {
    PEFTPLAN_CHECK_MSG(root >= 0 && root < size_, "broadcast root {} of {} ranks", root, size_);
    const int n = mpi_count(count);
    const bool copy_first = rank_ == root && send != recv;
    return submit(CommKind::broadcast, count * bytes_of(dtype), [=](MPI_Comm c) {
      if (copy_first) std::memcpy(recv, send, count * bytes_of(dtype));
      MPI_Request req = MPI_REQUEST_NULL;
      PEFTPLAN_MPI_CHECK(MPI_Ibcast(recv, n, mpi_type(dtype), root, c, &req));
      wait_low_cpu(req, kCollectiveLongestSleep);
    });
  }

  std::unique_ptr<CommRequest> barrier_async() override {
    return submit(CommKind::barrier, 0, [](MPI_Comm c) { low_cpu_barrier(c); });
  }

  std::unique_ptr<Communicator> split(int color, int key) override {
    MPI_Comm out = MPI_COMM_NULL;
    int rank = 0, size = 0;
    submit(std::nullopt, 0, [&](MPI_Comm c) {
      PEFTPLAN_MPI_CHECK(MPI_Comm_split(c, color < 0 ? MPI_UNDEFINED : color, key, &out));
      if (out == MPI_COMM_NULL) return;
      PEFTPLAN_MPI_CHECK(MPI_Comm_set_errhandler(out, MPI_ERRORS_RETURN));
      PEFTPLAN_MPI_CHECK(MPI_Comm_rank(out, &rank));
      PEFTPLAN_MPI_CHECK(MPI_Comm_size(out, &size));
    })->wait();
    if (out == MPI_COMM_NULL) return nullptr;
    return std::make_unique<MpiCommunicator>(out, rank, size);
  }

  CommCounters counters() const override {
    std::lock_guard lock(counters_m_);
    return counters_;
  }
  void reset_counters() override {
    std::lock_guard lock(counters_m_);
    counters_ = CommCounters{};
  }

 private:
  // Queues `call` on the communication thread; counts it under `kind` when it succeeds.
  std::unique_ptr<CommRequest> submit(std::optional<CommKind> kind, std::uint64_t bytes,
                                      std::function<void(MPI_Comm)> call) {
    auto state = std::make_shared<OpState>();
    thread_.post([this, state, kind, bytes, call = std::move(call)] {
      std::exception_ptr error;
      double seconds = -1.0;
      try {
        const auto t0 = std::chrono::steady_clock::now();
        call(comm_.get());
        const std::chrono::duration<double> dt = std::chrono::steady_clock::now() - t0;
        seconds = dt.count();
        if (kind) {
          std::lock_guard lock(counters_m_);
          CommCounter& k = counters_[*kind];
          ++k.calls;
          k.bytes += bytes;
          k.seconds += dt.count();
        }
      } catch (...) {
        error = std::current_exception();
      }
      {
        std::lock_guard lock(state->m);
        state->done = true;
        state->seconds = seconds;
        state->error = error;
      }
      state->cv.notify_all();
    });
    return std::make_unique<MpiRequest>(std::move(state));
  }

  CommHandle comm_;
  int rank_;
  int size_;
  std::unique_ptr<ShmProgressBoard> board_;
  mutable std::mutex counters_m_;
  CommCounters counters_;
  CommThread thread_;  // last: destroyed first, so the queue drains before the comm is freed
};

}  // namespace

// Open MPI keeps blocks it allocates while it starts (component names, parameter strings) and
// unloads the components it did not select, then unloads the rest in MPI_Finalize; under
// LeakSanitizer, whose check runs at exit, their blocks show as leaks from "<unknown module>", a
// frame no suppression can name: a bare MPI_Init_thread + MPI_Finalize program is reported so
// (open-mpi/ompi#12584). In a sanitizer build (PRESET=debug) MPI starts inside
// __lsan_disable/__lsan_enable, which tells LeakSanitizer that what this thread allocates there
// is not a leak, and the leak check runs just before MPI_Finalize, while the selected components
// are still loaded: what they lost is named by its library (scripts/lsan.supp), and a block
// peftplan's own code lost is reported as it would be at exit (the check runs once per process,
// so not again at exit). Declared weak as in <sanitizer/lsan_interface.h>: null in a build
// without the sanitizer.
extern "C" void __lsan_disable() __attribute__((weak));
extern "C" void __lsan_enable() __attribute__((weak));
extern "C" void __lsan_do_leak_check() __attribute__((weak));

namespace {
struct LeaksIgnored {
  LeaksIgnored() {
    if (__lsan_disable != nullptr) __lsan_disable();
  }
  ~LeaksIgnored() {
    if (__lsan_enable != nullptr) __lsan_enable();
  }
  LeaksIgnored(const LeaksIgnored&) = delete;
  LeaksIgnored& operator=(const LeaksIgnored&) = delete;
};
}  // namespace

MpiRuntime::MpiRuntime(int* argc, char*** argv) {
  int initialised = 0;
  PEFTPLAN_MPI_CHECK(MPI_Initialized(&initialised));
  if (initialised) {
    PEFTPLAN_MPI_CHECK(MPI_Query_thread(&provided_));
  } else {
    {
      const LeaksIgnored ignored;
      PEFTPLAN_MPI_CHECK(MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided_));
    }
    owns_ = true;
  }
  PEFTPLAN_MPI_CHECK(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN));
  PEFTPLAN_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &rank_));
  PEFTPLAN_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &size_));
  if (provided_ < MPI_THREAD_SERIALIZED) {
    if (owns_) MPI_Finalize();
    throw CommError(fmt::format(
        "MPI grants thread level {} but the communicator's thread needs MPI_THREAD_SERIALIZED "
        "({}) or better; use an MPI built with thread support",
        provided_, MPI_THREAD_SERIALIZED));
  }
}

MpiRuntime::~MpiRuntime() {
  if (!owns_) return;
  if (__lsan_do_leak_check != nullptr) __lsan_do_leak_check();
  MPI_Finalize();
}

std::string_view MpiRuntime::thread_level() const {
  return provided_ >= MPI_THREAD_MULTIPLE ? "multiple" : "serialized";
}

void MpiRuntime::abort(int code) const {
  MPI_Abort(MPI_COMM_WORLD, code);
  std::abort();  // MPI_Abort does not return; this keeps [[noreturn]] honest if it does
}

std::unique_ptr<Communicator> make_mpi_communicator() {
  int initialised = 0, finalised = 0;
  PEFTPLAN_MPI_CHECK(MPI_Initialized(&initialised));
  PEFTPLAN_MPI_CHECK(MPI_Finalized(&finalised));
  if (!initialised || finalised)
    throw CommError("make_mpi_communicator: MPI is not initialised (create an MpiRuntime in main())");
  MPI_Comm comm = MPI_COMM_NULL;
  PEFTPLAN_MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &comm));
  CommHandle owner(comm);  // freed if anything below throws
  PEFTPLAN_MPI_CHECK(MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN));
  int rank = 0, size = 0;
  PEFTPLAN_MPI_CHECK(MPI_Comm_rank(comm, &rank));
  PEFTPLAN_MPI_CHECK(MPI_Comm_size(comm, &size));
  auto board = size > 1 ? ShmProgressBoard::create(comm, rank, size) : nullptr;
  return std::make_unique<MpiCommunicator>(owner.release(), rank, size, std::move(board));
}

}  // namespace peftplan::executor
