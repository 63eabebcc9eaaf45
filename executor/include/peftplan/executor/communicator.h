// The executor's seam for collectives: a Communicator interface with NCCL's names and NCCL's
// buffer conventions (device or host pointers as void* + element type + element count, async
// operations completed through a handle), the implementations' factories (MPI, one rank), and
// the job's world (WorldRuntime: MPI's where the build has MPI, one rank where it does not).
//
// Semantics (NVIDIA/nccl docs "Collective Operations", and nccl-tests doc/PERFORMANCE.md for
// sizes):
//   all_reduce(send, recv, count)         recv[count] = op over ranks of send[count]
//   reduce_scatter(send, recv, recv_count) send[recv_count × size()] is reduced; rank r receives
//                                         block r: recv[recv_count]
//   all_gather(send, recv, send_count)    recv[send_count × size()] = concatenation of every
//                                         rank's send[send_count], in rank order
//   broadcast(send, recv, count, root)    recv[count] = root's send[count]
// In place, as in NCCL: all_reduce and broadcast with send == recv; reduce_scatter with
// recv == send + rank·recv_count (elements); all_gather with send == recv + rank·send_count.
//
// Ordering: every operation, synchronous or not, is issued in call order on one communication
// resource (a thread for MPI, a stream for NCCL); ranks must call collectives on a communicator
// in the same order, as with NCCL and MPI. Buffers must stay alive and untouched until the
// operation's request completes; a request's destructor waits for completion.
//
// Counters: per operation kind, calls, payload bytes (nccl-tests "size": the whole buffer of an
// all_reduce or broadcast, the whole gathered/scattered array of an all_gather or
// reduce_scatter) and seconds spent executing (from the start of the library call to its end on
// the communication resource, excluding queueing).
//
// Deliberately not here: MPI or NCCL types (implementations keep them in their own files),
// point-to-point messages, reductions other than sum/max/min, bucketing (the runner's job).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>

namespace peftplan::executor {

class Backend;  // backend.h

// Element types a collective can carry (NCCL's ncclDataType_t subset we use). fp16/bf16 are
// raw 16-bit patterns: the MPI communicator moves them (all_gather, broadcast) but cannot
// reduce them.
enum class CommDType : std::uint8_t { fp32, fp64, fp16, bf16, int32, int64, uint8 };

constexpr std::size_t bytes_of(CommDType t) {
  switch (t) {
    case CommDType::fp32: return 4;
    case CommDType::fp64: return 8;
    case CommDType::fp16: return 2;
    case CommDType::bf16: return 2;
    case CommDType::int32: return 4;
    case CommDType::int64: return 8;
    case CommDType::uint8: return 1;
  }
  return 0;
}
std::string_view name_of(CommDType t);

enum class ReduceOp : std::uint8_t { sum, max, min };

// Operation kinds, as counters and traces name them (NCCL's names, plus barrier).
enum class CommKind : std::uint8_t { all_reduce, reduce_scatter, all_gather, broadcast, barrier };
inline constexpr int kNumCommKinds = 5;
std::string_view name_of(CommKind k);

struct CommCounter {
  std::uint64_t calls = 0;  // operations completed
  std::uint64_t bytes = 0;  // nccl-tests size, summed over calls
  double seconds = 0.0;     // time executing (library call start to end), summed over calls
};

struct CommCounters {
  std::array<CommCounter, kNumCommKinds> by_kind{};  // indexed by CommKind
  const CommCounter& operator[](CommKind k) const { return by_kind[static_cast<std::size_t>(k)]; }
  CommCounter& operator[](CommKind k) { return by_kind[static_cast<std::size_t>(k)]; }
};

// Completion handle of an asynchronous operation (an MPI job on the communication thread; a
// CUDA event on the NCCL communicator's stream).
class CommRequest {
 public:
  virtual ~CommRequest() = default;  // implementations wait for completion
  // Blocks until the operation has completed; rethrows the error it failed with. Call once.
  virtual void wait() = 0;
  // Whether the operation has completed (successfully or not); never blocks.
  virtual bool done() = 0;
  // Seconds the operation executed on the communication resource (library call start to end,
  // queueing excluded) once done(); -1 when the implementation does not time it.
  virtual double seconds() { return -1.0; }
};

// Where each rank of a job is in its step program, so that a rank whose collective never
// completes can name the peer it is waiting for (the runner's watchdog) instead of saying only
// that "a rank failed". Each rank posts its own position at every op (relaxed stores into memory
// the ranks share, nanoseconds); the others read it only when a wait has run out. Positions are
// known for the ranks on this rank's node; a rank elsewhere reads as unknown.
class ProgressBoard {
 public:
  virtual ~ProgressBoard() = default;
  struct Position {
    bool known = false;      // false: another node's rank, or nothing posted yet
    std::int64_t step = -1;  // 0-based optimizer step
    std::int64_t op = -1;    // program op index (the op count: past the step's last op)
    double age_s = 0.0;      // seconds since the rank posted it
  };
  virtual void post(std::int64_t step, std::int64_t op) = 0;  // this rank's position
  virtual Position position(int rank) const = 0;              // a rank of the communicator
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string_view backend() const = 0;  // "mpi", "nccl", "self"

  // --- asynchronous forms: enqueue and return at once ---------------------------------------
  virtual std::unique_ptr<CommRequest> all_reduce_async(const void* send, void* recv,
                                                        std::size_t count, CommDType dtype,
                                                        ReduceOp op) = 0;
  virtual std::unique_ptr<CommRequest> reduce_scatter_async(const void* send, void* recv,
                                                            std::size_t recv_count,
                                                            CommDType dtype, ReduceOp op) = 0;
  virtual std::unique_ptr<CommRequest> all_gather_async(const void* send, void* recv,
                                                        std::size_t send_count,
                                                        CommDType dtype) = 0;
  virtual std::unique_ptr<CommRequest> broadcast_async(const void* send, void* recv,
                                                       std::size_t count, CommDType dtype,
                                                       int root) = 0;
  virtual std::unique_ptr<CommRequest> barrier_async() = 0;

  // A new communicator over the ranks that pass the same color, ordered by (key, rank), like
  // MPI_Comm_split and ncclCommSplit. Collective over this communicator; a negative color
  // takes no part and gets nullptr.
  virtual std::unique_ptr<Communicator> split(int color, int key) = 0;

  // The ranks' positions (see ProgressBoard), or null when this communicator has none (one
  // rank, or an implementation without shared memory).
  virtual ProgressBoard* progress() { return nullptr; }

  // A snapshot of the counters since construction or the last reset.
  virtual CommCounters counters() const = 0;
  virtual void reset_counters() = 0;

  // --- synchronous forms: the async form, then wait -----------------------------------------
  void all_reduce(const void* send, void* recv, std::size_t count, CommDType dtype,
                  ReduceOp op = ReduceOp::sum) {
    all_reduce_async(send, recv, count, dtype, op)->wait();
  }
  void reduce_scatter(const void* send, void* recv, std::size_t recv_count, CommDType dtype,
                      ReduceOp op = ReduceOp::sum) {
    reduce_scatter_async(send, recv, recv_count, dtype, op)->wait();
  }
  void all_gather(const void* send, void* recv, std::size_t send_count, CommDType dtype) {
    all_gather_async(send, recv, send_count, dtype)->wait();
  }
  void broadcast(const void* send, void* recv, std::size_t count, CommDType dtype, int root) {
    broadcast_async(send, recv, count, dtype, root)->wait();
  }
  void barrier() { barrier_async()->wait(); }
};

// What a failed MPI/NCCL call becomes: file:line, the call, and the library's error string.
class CommError : public std::runtime_error {
 public:
  explicit CommError(const std::string& message) : std::runtime_error(message) {}
};

// ---------------------------------------------------------------------------------------------
// MPI (executor/comm/mpi_communicator.cpp; only in a build that found MPI)
// ---------------------------------------------------------------------------------------------

// Owns MPI's initialisation for a scope, normally main()'s: MPI_Init_thread asking for
// MPI_THREAD_MULTIPLE, MPI_Finalize on destruction (after every communicator is gone). MPI calls
// then return errors instead of aborting. Throws CommError when MPI grants less than
// MPI_THREAD_SERIALIZED, which the communication threads need (see mpi_communicator.cpp).
class MpiRuntime {
 public:
  MpiRuntime(int* argc, char*** argv);
  ~MpiRuntime();
  MpiRuntime(const MpiRuntime&) = delete;
  MpiRuntime& operator=(const MpiRuntime&) = delete;

  int world_rank() const { return rank_; }
  int world_size() const { return size_; }
  // "multiple" or "serialized": the thread support MPI granted.
  std::string_view thread_level() const;
  // Ends every rank of the job now (MPI_Abort): for main() after an error on one rank, when a
  // clean MPI_Finalize would wait for peers that are blocked in a collective.
  [[noreturn]] void abort(int code) const;

 private:
  int rank_ = 0;
  int size_ = 1;
  int provided_ = 0;
  bool owns_ = false;  // false when MPI was already initialised by someone else
};

// A communicator over all ranks of the job (a duplicate of MPI_COMM_WORLD) with its own
// communication thread. Requires a live MpiRuntime.
std::unique_ptr<Communicator> make_mpi_communicator();

// ---------------------------------------------------------------------------------------------
// One rank (executor/comm/self_communicator.cpp): always built
// ---------------------------------------------------------------------------------------------

// A communicator of one rank (rank 0, size 1), with no library under it: every operation runs
// on the calling thread before its async form returns (all_reduce, broadcast and an all_gather or
// reduce_scatter that is not in place copy send to recv; barrier does nothing), and is counted
// like the MPI communicator's. It refuses what the MPI communicator refuses (reducing fp16/bf16,
// a root other than 0), so that a one-rank run fails where a multi-rank one would. split() gives
// another one-rank communicator (null for a negative color); progress() is null.
//
// `copy` moves the bytes when send and recv differ (default: memmove): a backend whose device is
// not the host passes its device-to-device copy (Backend::copy_device), so that one rank's
// collectives on GPU buffers never touch them from the host.
using MemoryCopy = std::function<void(void* dst, const void* src, std::uint64_t bytes)>;
std::unique_ptr<Communicator> make_self_communicator(MemoryCopy copy = {});

// ---------------------------------------------------------------------------------------------
// NCCL (executor/comm/nccl_communicator.cpp where the CUDA toolkit and NCCL are found;
// comm/nccl_absent.cpp elsewhere, whose factory refuses with the reason)
// ---------------------------------------------------------------------------------------------

// Empty when this build has the NCCL communicator and the machine a CUDA device; otherwise why
// not ("this build has no NCCL ...", "no CUDA device").
std::string nccl_communicator_unavailable();

// A communicator over the ranks of `bootstrap` on this process's current CUDA device (one device
// per rank: NCCL refuses two ranks on one GPU), bootstrapped by broadcasting rank 0's
// ncclUniqueId over `bootstrap`, which it keeps for its progress board. Its collectives run on a
// stream of its own that first waits for the work enqueued so far on `compute_stream` (the
// backend's Backend::native_stream()), so they overlap the kernels enqueued after them; a
// request is done when its operation has finished on the device. Host buffers are staged through
// device memory. fp16 and bf16 reduce (NCCL has the types). Throws InputError with the reason
// when unavailable, CommError when NCCL fails.
std::unique_ptr<Communicator> make_nccl_communicator(std::unique_ptr<Communicator> bootstrap, void* compute_stream);

// ---------------------------------------------------------------------------------------------
// Host staging (executor/comm/staging_communicator.cpp): always built
// ---------------------------------------------------------------------------------------------

// A communicator over `host`'s ranks (one that reads host memory only: MPI's) for a backend whose
// buffers are device memory: every operation copies its input to a host buffer of its own with
// `backend` (copy_to_host), runs `host`'s operation in place there, and copies the result back
// (copy_to_device) in its request's wait(): the result is in the caller's buffer once wait()
// returns (done() says only that the host operation finished). What two
// ranks sharing one GPU run on (NCCL refuses them). Counters, the progress board and what is
// refused (MPI cannot reduce fp16/bf16) are `host`'s; backend() is "<host's>+staging".
std::unique_ptr<Communicator> make_staging_communicator(std::unique_ptr<Communicator> host, Backend& backend);

// ---------------------------------------------------------------------------------------------
// The job's world, for main(): comm/world_mpi.cpp where the build has MPI, comm/world_self.cpp
// where it does not (CMake compiles one of them in)
// ---------------------------------------------------------------------------------------------

// Owns the job's start and end for a scope, normally main()'s. With MPI: an MpiRuntime (the job
// started by mpirun, or one rank started alone: MPI's singleton). Without: one rank, rank 0 of 1.
class WorldRuntime {
 public:
  WorldRuntime(int* argc, char*** argv);  // throws CommError when MPI cannot start
  ~WorldRuntime();
  WorldRuntime(const WorldRuntime&) = delete;
  WorldRuntime& operator=(const WorldRuntime&) = delete;

  int rank() const;
  int size() const;
  // "mpi" or "self": what make_world_communicator() builds on.
  std::string_view kind() const;
  // A new communicator over every rank of the job (make_mpi_communicator() or
  // make_self_communicator()).
  std::unique_ptr<Communicator> make_world_communicator() const;
  // Ends every rank of the job now, exiting with `code`: MPI_Abort with MPI; without, this
  // process's _Exit after flushing stdout and stderr. For main() after an error on one rank.
  [[noreturn]] void abort(int code) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace peftplan::executor
