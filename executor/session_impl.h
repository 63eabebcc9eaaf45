// The state of a Session (runner.h) that its parts share: private to the executor library.
// The runner is split by what each part does with this state:
//   session.cpp      setup (weights, adapter, state buffers by role), accessors, messages' names
//   runner.cpp       the interpreter loop: one step's ops in order, the kernel dispatch
//   session_comm.cpp collectives on the communication thread, the watchdog, host copies
//   checkpoint.cpp   save and resume (checksummed folders)
//   run.cpp          the measurement a session reports, gathering ranks, run_plan
// Deliberately not here: the program (planner), the kernels (Backend), the transport
// (Communicator).
#pragma once

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
#include "peftplan/executor/kernels.h"
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

// A whole file's bytes (checkpoint checksums); throws InputError naming it when unreadable.
std::string read_file_bytes(const std::filesystem::path& p);

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
  std::vector<std::int32_t> masters;  // the fp32 master buffers the optimizer ops step (mixed precision)
  std::int32_t master_root() const { return masters.empty() ? -1 : root_of(masters.front()); }
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
  std::optional<SessionOptions::Fault> fault;   // injected failure, on its rank only
  ProgressBoard* board = nullptr;               // the ranks' positions (the watchdog names a laggard)
  LrSchedule schedule;
  // Dimensions.
  std::int64_t B = 0, S = 0, M = 0, H = 0, I = 0, V = 0, nh = 0, nkv = 0, d = 0, A = 1;
  double count = 0.0;                           // target tokens of a step on all ranks
  // Step state.
  std::int64_t steps_done = 0;
  std::int64_t step_index = 0;                  // the step being run (data, dropout)
  // The step's scalars live on the device (backend.h): the loss sum the cross-entropy kernels
  // add to and the squared gradient norm, kScalarSlots fp64 at `scalars`, outside the program's
  // categories (16 bytes). loss_sum and sumsq are their host copies, valid once *_on_host.
  static constexpr std::size_t kLossSlot = 0, kNormSlot = 1, kScalarSlots = 2;
  double* scalars = nullptr;
  double loss_sum = 0.0, sumsq = 0.0;
  bool loss_on_host = false, norm_on_host = false;
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

  // Timing marks (Backend::record_mark): the step's start, then per op a begin and an end (on
  // the compute queue for a kernel, on the copy queue for a copy) and, for a copy, the compute
  // queue's point it waits for (its source written); the ops run_ops marked, whose times it reads
  // after the step's synchronize.
  static constexpr std::size_t kStartMark = 0;
  static std::size_t begin_mark(std::size_t op) { return 1 + 3 * op; }
  static std::size_t end_mark(std::size_t op) { return 2 + 3 * op; }
  static std::size_t ready_mark(std::size_t op) { return 3 + 3 * op; }
  static std::size_t mark_slots(std::size_t ops) { return 1 + 3 * ops; }
  std::vector<std::size_t> timed;
  // The step's copies on the copy queue (Backend::copy_async), in issue order: what a kernel that
  // reads their destination, or a free of either side, waits for (their end marks).
  struct QueuedCopy {
    std::size_t op = 0;
    std::int32_t from = -1, to = -1;  // the allocated buffers (views resolved)
  };
  std::vector<QueuedCopy> copies;
  void wait_for_copies(std::int32_t root);
  void wait_for_copy_deps(const sim::Op& op);
  std::vector<std::int32_t> host_tokens;        // a micro-batch's tokens and targets, staged

  Impl(const planner::PlanFile& p, Backend& b, TokenData tokens, Communicator* c, const SessionOptions& o)
      : plan(p), be(b), data(std::move(tokens)), comm(c), alloc(b.device_memory(), b.host_memory()),
        options(o) {
    be.reset_device_memory_peak();  // this run's reserved peak, not an earlier run's (backend.h)
    scalars = static_cast<double*>(be.device_memory().allocate(kScalarSlots * sizeof(double)));
  }
  // A step that threw may leave copies queued (the copy queue, backend.h): they finish before
  // the scalars and then every block (`alloc`, destroyed after this body) go back; a device
  // error there is the step's, already reported.
  ~Impl() {
    try {
      be.synchronize();
    } catch (...) {
    }
    be.device_memory().deallocate(scalars, kScalarSlots * sizeof(double));
  }
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;
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
  // An operand in the compute dtype (backend.h "kernels"), and its element count.
  void* vp(std::int32_t id) const { return at<void>(id); }
  std::int64_t elems(std::int32_t id) const { return static_cast<std::int64_t>(bytes(id) / bytes_of(dt)); }
  // The program's compute dtype (planner ProgramFacts): the storage of every kernel's activations,
  // weights and their gradients; the backend is told it at each call.
  DType dt = DType::fp32;

  void setup();
  void gather_adapter();  // ZeRO-3: the whole adapter into full_adapter
  void refresh_host_params();  // optimizer offload: the host copy of the partition from the device
  void init_masters();    // mixed precision: the fp32 masters from the parameters they step
  // The n parameters an optimizer op steps: its params buffer, or this rank's block of it when
  // it holds N·n (ZeRO-1/2's replicated trainable.flat).
  std::byte* param_block(std::int32_t params, std::int64_t n) const {
    std::byte* p = at<std::byte>(params);
    if (elems(params) == n) return p;
    PEFTPLAN_CHECK(elems(params) == n * N);
    return p + static_cast<std::uint64_t>(rank) * static_cast<std::uint64_t>(n) * es();
  }
  std::vector<std::pair<std::int32_t, const models::TrainableTensor*>> adapter_views_in_order() const;
  void run_ops(bool update);
  void collective(std::size_t i, const sim::Op& op);
  void copy(const sim::Op& op);
  void wait(CommRequest& req, std::size_t i);
  void wait_through(std::size_t i);
  std::string laggard(std::size_t i) const;
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
  // Host access to device buffers, always staged through the Backend (synchronize, then a
  // copy): a buffer's (or view's) bytes to and from host memory, and its elements.
  void read_bytes(std::int32_t id, void* dst, std::uint64_t n, std::uint64_t offset = 0) const {
    be.synchronize();
    be.copy_to_host(dst, at<std::byte>(id) + offset, n);
  }
  void write_bytes(std::int32_t id, const void* src, std::uint64_t n, std::uint64_t offset = 0) const {
    be.copy_to_device(at<std::byte>(id) + offset, src, n);
  }
  // Host copies of a compute-dtype buffer's elements (the adapter, its gradients): widened to
  // fp32 on the way out, rounded to nearest even on the way in (bf16 programs).
  std::uint64_t es() const { return bytes_of(dt); }
  void to_storage(std::span<const float> v, std::byte* dst) const {
    if (dt == DType::fp32) std::memcpy(dst, v.data(), 4 * v.size());
    else cpu::fp32_to_bf16(v.data(), reinterpret_cast<std::uint16_t*>(dst), static_cast<std::int64_t>(v.size()));
  }
  void from_storage(const std::byte* src, std::span<float> out) const {
    if (dt == DType::fp32) std::memcpy(out.data(), src, 4 * out.size());
    else cpu::bf16_to_fp32(reinterpret_cast<const std::uint16_t*>(src), out.data(), static_cast<std::int64_t>(out.size()));
  }
  std::vector<float> read_compute(std::int32_t id) const {
    std::vector<std::byte> raw(bytes(id));
    read_bytes(id, raw.data(), raw.size());
    std::vector<float> v(raw.size() / es());
    from_storage(raw.data(), v);
    return v;
  }
  void write_compute(std::int32_t id, std::span<const float> v) const {
    std::vector<std::byte> raw(v.size() * es());
    to_storage(v, raw.data());
    write_bytes(id, raw.data(), raw.size());
  }
  double read_scalar(std::size_t slot);
  double step_loss_sum() {  // this step's loss sum (all ranks' once the loss is all-reduced)
    if (!loss_on_host) {
      loss_sum = read_scalar(kLossSlot);
      loss_on_host = true;
    }
    return loss_sum;
  }
  void alloc_op(std::size_t i, const sim::Op& op);
  void compute(const sim::Op& op);
  double finish_norm();
  std::string first_nonfinite(std::int32_t grad, double norm);
};

}  // namespace peftplan::executor
