// The Backend: the executor's seam for memory and kernels (ggml-backend style). The runner
// interprets the step program and calls one Backend method per compute op with the operands the
// op names; a backend owns its device memory, its streams and its library handles.
//
// Conventions: every pointer is device memory of this backend (the CPU backend's device is the
// host), `float*` fp32 and `void*` in the call's storage dtype (below), row-major, with the dimension names of
// kernels.h (M token rows, K in-features, N out-features, r LoRA rank, H hidden, I intermediate,
// V vocab, nh/nkv heads, d head_dim). Kernels are enqueued in call order on the backend's
// compute stream and may still be running when the call returns; the host touches device
// memory only through copy_to_host / copy_to_device after synchronize(), and results a host
// decision needs (the loss, the gradient norm) are written to device scalars it copies back.
// Scratch is always passed in: a kernel never allocates (the tracked allocator sees every byte).
//
// Dtypes: storage dtypes cross the interface in convert(); a kernel's activations and weights
// are stored in the dtype its call names (the program's compute dtype, planner ProgramFacts:
// fp32, or bf16 in mixed precision) and computed in fp32; a backend says which storage dtypes it
// converts (supports_storage) and which it computes on (supports_compute). Timing is by marks on the compute stream (CUDA events
// on a device), read after one synchronize() per step, not by a synchronize after every op.
//
// The CUDA backend (executor/cuda/: cuBLAS GEMMs, its own stream and device memory) is a file
// pair and a factory behind make_backend("cuda"). Collectives are not here: see communicator.h.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "peftplan/common/dtype.h"
#include "peftplan/executor/allocator.h"

namespace peftplan::executor {

using Index = std::int64_t;

// The dropout of one adapter input: p and the key of its counter-based mask (the same key gives
// the same mask in forward, recompute and backward).
struct DropoutKey {
  double p = 0.0;           // probability of dropping an element, [0, 1)
  std::uint64_t seed = 0;   // mask key: derived from the run seed, step, micro-batch, adapter
};

class Backend {
 public:
  virtual ~Backend() = default;
  Backend() = default;
  Backend(const Backend&) = delete;
  Backend& operator=(const Backend&) = delete;

  virtual std::string_view name() const = 0;   // "cpu", "cuda"
  virtual std::string description() const = 0; // "cpu: 2 threads (Eigen 3.4, OpenMP)"
  virtual int threads() const = 0;             // CPU threads the kernels use
  // Whether device memory is host memory (the CPU backend): the host may then touch buffers,
  // communicators copy them with memmove, and calibration sizes its work for a CPU.
  virtual bool device_is_host() const = 0;
  // Bytes a GEMM library allocates outside our allocator for one [M,K]·[K,N] product (Eigen's
  // packed panels; cuBLAS's workspace later): reported beside the tracked categories.
  virtual std::uint64_t gemm_library_scratch_bytes(Index M, Index N, Index K) const = 0;

  // --- memory and streams ---------------------------------------------------------------
  virtual MemoryResource& device_memory() = 0;
  virtual MemoryResource& host_memory() = 0;   // pinned on CUDA
  // Host <-> device copies (enqueued on the copy stream; ordered before later kernels).
  virtual void copy_to_device(void* dst, const void* src, std::uint64_t bytes) = 0;
  virtual void copy_to_host(void* dst, const void* src, std::uint64_t bytes) = 0;
  // Device -> device (on the compute stream; the ranges may overlap).
  virtual void copy_device(void* dst, const void* src, std::uint64_t bytes) = 0;
  virtual void fill_zero(void* dst, std::uint64_t bytes) = 0;
  // The device's memory in the two kinds beyond "allocated" (the tracked allocator's live bytes):
  // reserved, the bytes the backend's memory source holds from the driver at its highest, and in
  // use, the device's total minus its free memory now (cudaMemGetInfo: the CUDA context, cuBLAS
  // and every other user of the device included, measured rather than assumed). nullopt where
  // the device is the host (the CPU backend).
  struct MemoryKinds {
    std::uint64_t reserved_peak_bytes = 0;
    std::uint64_t in_use_bytes = 0;
    std::uint64_t total_bytes = 0;
  };
  virtual std::optional<MemoryKinds> device_memory_kinds() { return std::nullopt; }
  // Starts the reserved peak afresh (a Session calls it first, so that each run's figure is its
  // own, not the highest of every run this backend served); waits for the device. No-op here.
  virtual void reset_device_memory_peak() {}
  // Waits until every enqueued kernel and copy has finished (for timing and host reads).
  virtual void synchronize() = 0;
  // The physical device, the same string in every process that computes on it (a GPU's PCI bus
  // id, as NCCL tells ranks apart); empty where the device is the host.
  virtual std::string device_identity() const { return {}; }
  // The stream the compute work is ordered on, as the device's own handle (a cudaStream_t on
  // CUDA), for a communicator that orders its own stream after it (make_nccl_communicator);
  // null where kernels run inline on the host.
  virtual void* native_stream() { return nullptr; }

  // --- timing marks ----------------------------------------------------------------------
  // A mark records the point the compute stream has reached when it is recorded (a CUDA event;
  // on the CPU, whose kernels run inline, the host clock). Slots are reused: recording a slot
  // again replaces its point. seconds_between(a, b) is the time from mark a to mark b, valid
  // after a synchronize() that follows both.
  virtual void reserve_marks(std::size_t slots) = 0;
  virtual void record_mark(std::size_t slot) = 0;
  virtual double seconds_between(std::size_t from, std::size_t to) = 0;

  // --- the copy queue --------------------------------------------------------------------
  // The step program's host <-> device copies (Stream::copy: an offloaded optimizer's gradients
  // and parameters, ZeRO-3's offloaded weights) run on a queue of their own, so that a device
  // overlaps them with its kernels, as DeepSpeed's offload copies run on side streams between
  // pinned host buffers (host_memory() is pinned on CUDA). Marks order the two queues:
  // record_copy_mark is record_mark on the copy queue (the slots are shared, and seconds_between
  // reads across queues); wait_mark(q, slot) makes queue q's later work start once the mark has
  // been reached (cudaStreamWaitEvent); wait_mark_on_host blocks the host until then
  // (cudaEventSynchronize); synchronize() waits for both queues. A copy on the copy queue may run
  // at any time between the marks that order it: the caller orders it after the kernels that write
  // its source (a compute mark it waits for) and orders whatever reads its destination, or reuses
  // either side's memory, after its end mark.
  enum class Queue : std::uint8_t { compute, copy };
  virtual void copy_async(void* dst, const void* src, std::uint64_t bytes) = 0;
  virtual void record_copy_mark(std::size_t slot) = 0;
  virtual void wait_mark(Queue waiter, std::size_t slot) = 0;
  virtual void wait_mark_on_host(std::size_t slot) = 0;

  // --- dtypes ----------------------------------------------------------------------------
  // Whether convert() reads and writes `d` (fp32, and bf16 / fp16 on the CPU; quantised
  // storage is not an executor dtype).
  virtual bool supports_storage(DType d) const = 0;
  // dst[n] (in `to`) = src[n] (in `from`): fp32 -> bf16 / fp16 round to nearest even, the
  // widening conversions are exact, equal dtypes copy. An unsupported dtype is an InternalError
  // naming both.
  virtual void convert(const void* src, DType from, void* dst, DType to, Index n) = 0;

  // --- kernels ---------------------------------------------------------------------------
  // `dt` is the storage dtype of every `void*` operand of a call: the activations, the weights
  // the kernel reads and the gradients it writes, all in the program's compute dtype (fp32, or
  // bf16 as mixed-precision training stores them; supports_compute says which a backend runs).
  // `float*` operands are fp32 whatever `dt` is: RMSNorm's rstd, RoPE's tables, flash
  // attention's lse, and the optimizer's parameters, gradients and states (the fp32 masters of a
  // mixed-precision run). Every kernel widens its inputs to fp32, computes and accumulates in
  // fp32 and rounds to nearest even when it stores (cuBLAS's CUBLAS_COMPUTE_32F with bf16
  // operands; torch's bf16 kernels accumulate in fp32 the same way). Outputs round once; where a
  // kernel stores an intermediate in a buffer of the call (LoRA's u and du, eager attention's
  // scores and probabilities, its backward's scratch) a backend may round it there too, and the
  // backends differ in that (the CUDA backend rounds every one it stores; the CPU backend rounds
  // u, which the call returns, and keeps the others in fp32): tests allow for it.
  virtual bool supports_compute(DType dt) const = 0;
  // y[M,N] (=|+=) x[M,K]·W[N,K]ᵀ (+ bias[N]).
  virtual void linear_forward(DType dt, const void* x, const void* W, const void* bias, void* y,
                              Index M, Index K, Index N, bool accumulate) = 0;
  // dx[M,K] (=|+=) dy[M,N]·W[N,K].
  virtual void linear_backward_input(DType dt, const void* dy, const void* W, void* dx, Index M,
                                     Index K, Index N, bool accumulate) = 0;
  // out[n] = x ⊙ keep / (1 − p) with the mask of `key`.
  virtual void dropout_forward(DType dt, const void* x, void* out, Index n, const DropoutKey& key) = 0;
  // u[M,r] = x_in·Aᵀ; y[M,N] += scale·u·Bᵀ (u as stored: rounded to `dt` before its product).
  virtual void lora_forward(DType dt, const void* x_in, const void* A, const void* B, float scale,
                            void* u, void* y, Index M, Index K, Index N, Index r) = 0;
  // du = scale·dy·B (scratch[0, M·r)); dB += scale·dyᵀ·u; dA += duᵀ·x_in;
  // dx += drop'(du·A) (dx may be null; with key.p > 0 du·A goes through scratch[M·r, M·r+M·K)).
  virtual void lora_backward(DType dt, const void* dy, const void* x_in, const void* A,
                             const void* B, const void* u, float scale, const DropoutKey& key,
                             void* dA, void* dB, void* dx, void* scratch, Index M, Index K,
                             Index N, Index r) = 0;
  // RMSNorm: y = w ⊙ x·rstd, rstd[M] (fp32) saved.
  virtual void rmsnorm_forward(DType dt, const void* x, const void* w, float eps, void* y,
                               float* rstd, Index M, Index H) = 0;
  // dx (=|+=) RMSNorm input gradient; the frozen weight gets no gradient.
  virtual void rmsnorm_backward(DType dt, const void* dy, const void* x, const void* w,
                                const float* rstd, void* dx, Index M, Index H,
                                bool accumulate) = 0;
  // cos[S, d/2] then sin[S, d/2] in `tables` (fp32).
  virtual void rope_tables(float* tables, Index S, Index d, double theta) = 0;
  // In place on x[B,S,nheads,d]; backward = the transposed rotation.
  virtual void rope_forward(DType dt, void* x, const float* tables, Index B, Index S,
                            Index nheads, Index d) = 0;
  virtual void rope_backward(DType dt, void* dx, const float* tables, Index B, Index S,
                             Index nheads, Index d) = 0;
  // Eager causal GQA attention (kernels.h §5); P[B,nh,S,S] stored in `dt`; scratch_elems: a
  // multiple of S·S.
  virtual void attention_forward(DType dt, const void* q, const void* k, const void* v, void* P,
                                 void* out, Index B, Index S, Index nh, Index nkv, Index d) = 0;
  virtual void attention_backward(DType dt, const void* dout, const void* q, const void* k,
                                  const void* v, const void* P, void* dq, void* dk, void* dv,
                                  void* scratch, Index scratch_elems, Index B, Index S, Index nh,
                                  Index nkv, Index d) = 0;
  // Flash (fused, tiled) causal GQA attention (kernels.h §5b): the same output as
  // attention_forward without the S×S probabilities; lse[B,nh,S] (fp32), each row's log Σ exp of
  // its scaled scores, is saved instead. No scratch: tiles live on chip (registers, shared memory,
  // the stack).
  virtual void flash_attention_forward(DType dt, const void* q, const void* k, const void* v,
                                       float* lse, void* out, Index B, Index S, Index nh,
                                       Index nkv, Index d) = 0;
  // dq, dk, dv (overwritten) from d_out, recomputing the probabilities from q, k and lse; `out`
  // (the forward's) gives each row's Σ d_out ⊙ out.
  virtual void flash_attention_backward(DType dt, const void* dout, const void* q, const void* k,
                                        const void* v, const void* out, const float* lse,
                                        void* dq, void* dk, void* dv, Index B, Index S, Index nh,
                                        Index nkv, Index d) = 0;
  virtual void swiglu_forward(DType dt, const void* gate, const void* up, void* act, Index n) = 0;
  virtual void swiglu_backward(DType dt, const void* dact, const void* gate, const void* up,
                               void* dgate, void* dup, Index n) = 0;
  virtual void embedding_forward(DType dt, const std::int32_t* tokens, const void* table,
                                 void* out, Index M, Index V, Index H) = 0;
  // *loss_sum += the loss summed over the rows (targets already shifted); loss_sum is one
  // device fp64.
  virtual void cross_entropy_forward(DType dt, const void* logits, const std::int32_t* targets,
                                     Index M, Index V, double* loss_sum) = 0;
  // dlogits = (softmax − onehot) / count; dlogits may alias logits.
  virtual void cross_entropy_backward(DType dt, const void* logits, const std::int32_t* targets,
                                      void* dlogits, double count, Index M, Index V) = 0;
  // out = a + b (out may alias a or b).
  virtual void add(DType dt, const void* a, const void* b, void* out, Index n) = 0;
  // *out = Σ x² (accumulated in fp64); out is one device fp64.
  virtual void sum_squares(DType dt, const void* x, Index n, double* out) = 0;
  virtual void scale(DType dt, void* x, float s, Index n) = 0;
  // torch.optim.AdamW over n fp32 elements (optim.h adamw_step): a mixed-precision run steps its
  // fp32 masters, as DeepSpeed's and torch's optimizers do.
  virtual void adamw_step(float* param, const float* grad, float* m, float* v, Index n,
                          std::int64_t step, double lr, double beta1, double beta2, double eps,
                          double weight_decay) = 0;
};

// The CPU backend: Eigen GEMMs and OpenMP loops on `threads` threads (0: OpenMP's default).
// Its kernels run inline; its copy queue runs each copy when it is enqueued (`at_enqueue`), or
// as late as the marks allow (`when_waited`: a copy runs when a wait on a mark after it, or a
// synchronize, needs it, reading its source then), which is what a device's copy engine may do:
// a run on it trains exactly as an inline one only if every wait the device needs was made
// (tests/test_executor.cpp ExecutorCopyQueue). What it cannot show: a copy run too early (its
// kernels have all run inline before it), and which queue waited (the compute queue is the
// calling thread, so a compute-queue wait is a host wait here too).
enum class CpuCopyQueue : std::uint8_t { at_enqueue, when_waited };
std::unique_ptr<Backend> make_cpu_backend(int threads = 0, CpuCopyQueue copies = CpuCopyQueue::at_enqueue);

// The backends this build has, by name ("cpu"; a CUDA build adds "cuda"), and a factory: the
// backend-ops test runs every Backend method on each of them (tests/test_backend_ops.cpp).
std::vector<std::string> backend_names();
// Empty when `name` can run on this machine; otherwise why not (a CUDA build on a machine with no
// GPU: "no CUDA device: ..."), for tests that skip with a message and for peftplan-exec's error.
std::string backend_unavailable(std::string_view name);
// A backend by name; `threads` is the CPU backend's OpenMP threads (the CUDA backend ignores it).
std::unique_ptr<Backend> make_backend(std::string_view name, int threads = 0);

}  // namespace peftplan::executor
