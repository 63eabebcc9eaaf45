// The CPU backend: the Backend interface over the CPU kernels of kernels.h (Eigen GEMMs with
// Eigen's own OpenMP parallelism, OpenMP loops elsewhere). Device memory is the heap; copies
// are memcpy; kernels run inline on the calling thread, so a timing mark is the host clock when it
// is recorded, and only the copy queue can hold work back (when_waited, backend.h). Its own code: the dropout mask,
// generated on the fly from a counter-based hash (the same bits as kernels.h dropout_mask) so that
// no mask buffer exists outside the step program, and bf16 storage (In / Out below: widened to
// fp32, computed, rounded once on store).
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <deque>
#include <optional>
#include <vector>

#include <Eigen/Core>
#include <fmt/format.h>

#include "eigen_maps.h"
#include "peftplan/common/error.h"
#include "peftplan/executor/backend.h"
#include "peftplan/executor/kernels.h"
#include "peftplan/executor/optim.h"

namespace peftplan::executor {
namespace {

using cpu::Accum;
using namespace cpu::detail;

Accum mode(bool accumulate) { return accumulate ? Accum::add : Accum::overwrite; }

// kernels.cpp's SplitMix64 (Steele, Lea, Flood 2014), so that keep(key, i) equals
// cpu::dropout_mask(key.seed, 0, key.p, ...)[i].
inline std::uint64_t splitmix64(std::uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
inline bool keep(std::uint64_t mixed_seed, double p, Index i) {
  const std::uint64_t z = splitmix64(mixed_seed ^ static_cast<std::uint64_t>(i));
  return static_cast<double>(z >> 11) * 0x1p-53 >= p;
}

// Operands stored in bf16 (backend.h "kernels"): widened into fp32 copies, computed by the fp32
// kernels of kernels.h, and rounded back once to nearest even when the call ends: an output rounds
// where a bf16 GPU kernel stores it, the intermediates of a call (eager attention's scores before
// the softmax, LoRA's du) stay fp32 where the CUDA backend rounds them (backend.h). The copies,
// up to twice the largest bf16 operand of a call (the logits, eager attention's probabilities),
// live in blocks the backend keeps from
// call to call (Scratch: a fresh heap block per call page-faulted its way to 50× the kernel's
// time), heap memory outside the tracked allocator, as Eigen's packed panels are: the step
// program's categories hold the bf16 buffers. fp32 operands pass straight through.
void check_compute(DType dt, const char* what) {
  if (dt != DType::fp32 && dt != DType::bf16)
    throw InternalError(fmt::format("the cpu backend computes on fp32 and bf16 storage, not {} ({})", name_of(dt), what));
}

class Scratch {  // fp32 blocks, the i-th operand of a call in the i-th (grown, never shrunk)
 public:
  Scratch& fresh() {
    next_ = 0;
    return *this;
  }
  float* take(Index n) {
    if (next_ == blocks_.size()) blocks_.emplace_back();
    std::vector<float>& b = blocks_[next_++];
    if (b.size() < static_cast<std::size_t>(n)) b.resize(static_cast<std::size_t>(n));
    return b.data();
  }

 private:
  std::vector<std::vector<float>> blocks_;
  std::size_t next_ = 0;
};

class In {  // an input operand
 public:
  In(Scratch& sc, DType dt, const void* p, Index n, const char* what = nullptr) {
    if (what != nullptr) check_compute(dt, what);
    if (p == nullptr || dt == DType::fp32) {
      f_ = static_cast<const float*>(p);
      return;
    }
    float* w = sc.take(n);
    cpu::bf16_to_fp32(static_cast<const std::uint16_t*>(p), w, n);
    f_ = w;
  }
  const float* f() const { return f_; }

 private:
  const float* f_ = nullptr;
};

class Out {  // an output operand; `load` widens what it holds first (accumulation, in place)
 public:
  Out(Scratch& sc, DType dt, void* p, Index n, bool load, const char* what = nullptr) : n_(n) {
    if (what != nullptr) check_compute(dt, what);
    if (p == nullptr || dt == DType::fp32) {
      f_ = static_cast<float*>(p);
      return;
    }
    narrow_ = static_cast<std::uint16_t*>(p);
    f_ = sc.take(n);
    if (load) cpu::bf16_to_fp32(narrow_, f_, n);
  }
  ~Out() {
    if (narrow_ != nullptr) cpu::fp32_to_bf16(f_, narrow_, n_);
  }
  Out(const Out&) = delete;
  Out& operator=(const Out&) = delete;
  float* f() const { return f_; }
  // Rounds the fp32 copy to what the storage will hold (a value read back before the call ends).
  void round() {
    if (narrow_ == nullptr) return;
    for (Index i = 0; i < n_; ++i) f_[i] = cpu::bf16_to_fp32(cpu::fp32_to_bf16(f_[i]));
  }

 private:
  Index n_;
  std::uint16_t* narrow_ = nullptr;
  float* f_ = nullptr;
};

// The heap, and with a copy queue that runs late (when_waited) every block handed back filled
// with 0xFF bytes first (NaN in fp32 and bf16): a queued copy that reads a block after its owner
// freed it reads NaN, or, where the heap has handed the block to a new owner already (it reuses
// the last block of a size first), that owner's bytes; either differs from the inline run.
class HeapThatPoisonsFrees final : public MemoryResource {
 public:
  std::string_view name() const override { return heap_memory().name(); }
  void* allocate(std::uint64_t bytes) override { return heap_memory().allocate(bytes); }
  void deallocate(void* p, std::uint64_t bytes) override {
    std::memset(p, 0xFF, bytes);
    heap_memory().deallocate(p, bytes);
  }
};

class CpuBackend final : public Backend {
 public:
  CpuBackend(int threads, CpuCopyQueue copies) : copies_(copies) {
    if (threads > 0) omp_set_num_threads(threads);
    threads_ = omp_get_max_threads();
    Eigen::setNbThreads(threads_);
  }
  std::string_view name() const override { return "cpu"; }
  std::string description() const override {
    return fmt::format("cpu: {} threads (Eigen {}.{}.{}, OpenMP)", threads_, EIGEN_WORLD_VERSION,
                       EIGEN_MAJOR_VERSION, EIGEN_MINOR_VERSION);
  }
  int threads() const override { return threads_; }
  bool device_is_host() const override { return true; }
  std::uint64_t gemm_library_scratch_bytes(Index M, Index N, Index K) const override {
    return cpu::gemm_packing_bytes(M, N, K, threads_);
  }

  MemoryResource& device_memory() override { return memory(); }
  MemoryResource& host_memory() override { return memory(); }
  void copy_to_device(void* dst, const void* src, std::uint64_t bytes) override { std::memcpy(dst, src, bytes); }
  void copy_to_host(void* dst, const void* src, std::uint64_t bytes) override { std::memcpy(dst, src, bytes); }
  void copy_device(void* dst, const void* src, std::uint64_t bytes) override { std::memmove(dst, src, bytes); }
  void fill_zero(void* dst, std::uint64_t bytes) override { std::memset(dst, 0, bytes); }
  void synchronize() override { run_copies_through(std::nullopt); }

  void reserve_marks(std::size_t slots) override {
    if (marks_.size() < slots) marks_.resize(slots);
  }
  void record_mark(std::size_t slot) override { marks_.at(slot) = Clock::now(); }

  // The copy queue: each copy at once, or (when_waited) queued with the marks recorded after it
  // until a wait or a synchronize reaches them. The compute queue is the calling thread, so a
  // wait on a compute mark has nothing to wait for.
  void copy_async(void* dst, const void* src, std::uint64_t bytes) override {
    if (copies_ == CpuCopyQueue::at_enqueue) std::memcpy(dst, src, bytes);
    else queued_.push_back({false, dst, src, bytes, 0});
  }
  void record_copy_mark(std::size_t slot) override {
    marks_.at(slot) = Clock::now();
    if (copies_ == CpuCopyQueue::when_waited) queued_.push_back({true, nullptr, nullptr, 0, slot});
  }
  void wait_mark(Queue waiter, std::size_t slot) override {
    if (waiter == Queue::compute) run_copies_through(slot);
  }
  void wait_mark_on_host(std::size_t slot) override { run_copies_through(slot); }
  double seconds_between(std::size_t from, std::size_t to) override {
    return std::chrono::duration<double>(marks_.at(to) - marks_.at(from)).count();
  }

  bool supports_storage(DType d) const override { return d == DType::fp32 || d == DType::bf16 || d == DType::fp16; }
  void convert(const void* src, DType from, void* dst, DType to, Index n) override {
    if (!supports_storage(from) || !supports_storage(to))
      throw InternalError(fmt::format("the cpu backend converts fp32, bf16 and fp16, not {} to {}", name_of(from), name_of(to)));
    if (from == to) {
      std::memmove(dst, src, storage_bytes(to, n));
      return;
    }
    const auto* h = static_cast<const std::uint16_t*>(src);
    auto* o = static_cast<std::uint16_t*>(dst);
    if (from == DType::bf16 && to == DType::fp32) return cpu::bf16_to_fp32(h, static_cast<float*>(dst), n);
    if (from == DType::fp16 && to == DType::fp32) return cpu::fp16_to_fp32(h, static_cast<float*>(dst), n);
    if (from == DType::fp32 && to == DType::bf16) return cpu::fp32_to_bf16(static_cast<const float*>(src), o, n);
    if (from == DType::fp32 && to == DType::fp16) return cpu::fp32_to_fp16(static_cast<const float*>(src), o, n);
    // Between the two 16-bit formats: through fp32, element by element (exact widening, one
    // rounding), as torch's .to() does.
    for (Index i = 0; i < n; ++i) {
      const float f = from == DType::bf16 ? cpu::bf16_to_fp32(h[i]) : cpu::fp16_to_fp32(h[i]);
      o[i] = to == DType::bf16 ? cpu::fp32_to_bf16(f) : cpu::fp32_to_fp16(f);
    }
  }

  bool supports_compute(DType dt) const override { return dt == DType::fp32 || dt == DType::bf16; }

  void linear_forward(DType dt, const void* x, const void* W, const void* bias, void* y, Index M,
                      Index K, Index N, bool accumulate) override {
    Scratch& sc = scratch_.fresh();
    const In X(sc, dt, x, M * K, "linear_forward"), Wt(sc, dt, W, N * K), Bi(sc, dt, bias, N);
    Out Y(sc, dt, y, M * N, accumulate);
    cpu::linear_forward(X.f(), Wt.f(), Bi.f(), Y.f(), M, K, N, mode(accumulate));
  }
  void linear_backward_input(DType dt, const void* dy, const void* W, void* dx, Index M, Index K,
                             Index N, bool accumulate) override {
    Scratch& sc = scratch_.fresh();
    const In DY(sc, dt, dy, M * N, "linear_backward_input"), Wt(sc, dt, W, N * K);
    Out DX(sc, dt, dx, M * K, accumulate);
    cpu::linear_backward_input(DY.f(), Wt.f(), DX.f(), M, K, N, mode(accumulate));
  }
  void dropout_forward(DType dt, const void* x, void* out, Index n, const DropoutKey& key) override {
    Scratch& sc = scratch_.fresh();
    const In X(sc, dt, x, n, "dropout_forward");
    Out O(sc, dt, out, n, false);
    const float* xf = X.f();
    float* of = O.f();
    const std::uint64_t mixed = splitmix64(key.seed);
    const float s = static_cast<float>(1.0 / (1.0 - key.p));
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
    for (Index i = 0; i < n; ++i) of[i] = keep(mixed, key.p, i) ? xf[i] * s : 0.0f;
  }
  void lora_forward(DType dt, const void* x_in, const void* A, const void* B, float scale, void* u,
                    void* y, Index M, Index K, Index N, Index r) override {
    Scratch& sc = scratch_.fresh();
    const In X(sc, dt, x_in, M * K, "lora_forward"), Am(sc, dt, A, r * K), Bm(sc, dt, B, N * r);
    Out U(sc, dt, u, M * r, false), Y(sc, dt, y, M * N, true);
    if (dt == DType::fp32) {
      cpu::lora_forward<float>(X.f(), Am.f(), Bm.f(), scale, nullptr, 0.0f, U.f(), Y.f(), nullptr, M, K, N, r);
      return;
    }
    // u as stored: rounded to the storage dtype before its product with B (backend.h), as torch
    // keeps lora_A's output as a bf16 tensor.
    cpu::linear_forward<float>(X.f(), Am.f(), nullptr, U.f(), M, K, r, Accum::overwrite);
    U.round();
    Map<float> Ym(Y.f(), M, N);
    Ym.noalias() += scale * (CMap<float>(U.f(), M, r) * CMap<float>(Bm.f(), N, r).transpose());
  }
  void lora_backward(DType dt, const void* dy, const void* x_in, const void* A, const void* B,
                     const void* u, float scale, const DropoutKey& key, void* dA, void* dB,
                     void* dx, void* scratch, Index M, Index K, Index N, Index r) override {
    Scratch& sc = scratch_.fresh();
    const In DY(sc, dt, dy, M * N, "lora_backward"), X(sc, dt, x_in, M * K), Am(sc, dt, A, r * K), Bm(sc, dt, B, N * r), U(sc, dt, u, M * r);
    Out DA(sc, dt, dA, r * K, true), DB(sc, dt, dB, N * r, true), DX(sc, dt, dx, M * K, true);
    Out SC(sc, dt, scratch, M * r + (key.p > 0.0 && dx != nullptr ? M * K : 0), false);
    if (key.p <= 0.0) {
      cpu::lora_backward<float>(DY.f(), X.f(), Am.f(), Bm.f(), U.f(), scale, nullptr, 0.0f, DA.f(), DB.f(), DX.f(), SC.f(), M,
                                K, N, r, Accum::add, Accum::add);
      return;
    }
    // x_in is the saved dropped input: dA and dB as without dropout; dx through the mask.
    cpu::lora_backward<float>(DY.f(), X.f(), Am.f(), Bm.f(), U.f(), scale, nullptr, 0.0f, DA.f(), DB.f(), nullptr, SC.f(), M,
                              K, N, r, Accum::add, Accum::add);
    if (dx == nullptr) return;
    CMap<float> DU(SC.f(), M, r);
    CMap<float> Amap(Am.f(), r, K);
    Map<float> G(SC.f() + M * r, M, K);
    G.noalias() = DU * Amap;
    const std::uint64_t mixed = splitmix64(key.seed);
    const float s = static_cast<float>(1.0 / (1.0 - key.p));
    const float* g = SC.f() + M * r;
    float* dxf = DX.f();
    const Index n = M * K;
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
    for (Index i = 0; i < n; ++i)
      if (keep(mixed, key.p, i)) dxf[i] += g[i] * s;
  }
  void rmsnorm_forward(DType dt, const void* x, const void* w, float eps, void* y, float* rstd, Index M,
                       Index H) override {
    Scratch& sc = scratch_.fresh();
    const In X(sc, dt, x, M * H, "rmsnorm_forward"), Wt(sc, dt, w, H);
    Out Y(sc, dt, y, M * H, false);
    cpu::rmsnorm_forward(X.f(), Wt.f(), eps, Y.f(), rstd, M, H);
  }
  void rmsnorm_backward(DType dt, const void* dy, const void* x, const void* w, const float* rstd,
                        void* dx, Index M, Index H, bool accumulate) override {
    Scratch& sc = scratch_.fresh();
    const In DY(sc, dt, dy, M * H, "rmsnorm_backward"), X(sc, dt, x, M * H), Wt(sc, dt, w, H);
    Out DX(sc, dt, dx, M * H, accumulate);
    cpu::rmsnorm_backward<float>(DY.f(), X.f(), Wt.f(), rstd, DX.f(), nullptr, M, H, mode(accumulate), Accum::add);
  }
  void rope_tables(float* tables, Index S, Index d, double theta) override {
    cpu::rope_tables(tables, tables + cpu::rope_table_elems(S, d), S, d, theta);
  }
  void rope_forward(DType dt, void* x, const float* tables, Index B, Index S, Index nheads,
                    Index d) override {
    Scratch& sc = scratch_.fresh();
    Out X(sc, dt, x, B * S * nheads * d, true, "rope_forward");
    cpu::rope_forward(X.f(), tables, tables + cpu::rope_table_elems(S, d), B, S, nheads, d);
  }
  void rope_backward(DType dt, void* dx, const float* tables, Index B, Index S, Index nheads,
                     Index d) override {
    Scratch& sc = scratch_.fresh();
    Out DX(sc, dt, dx, B * S * nheads * d, true, "rope_backward");
    cpu::rope_backward(DX.f(), tables, tables + cpu::rope_table_elems(S, d), B, S, nheads, d);
  }
  void attention_forward(DType dt, const void* q, const void* k, const void* v, void* P, void* out,
                         Index B, Index S, Index nh, Index nkv, Index d) override {
    Scratch& sc = scratch_.fresh();
    const In Q(sc, dt, q, B * S * nh * d, "attention_forward"), Kt(sc, dt, k, B * S * nkv * d), Vt(sc, dt, v, B * S * nkv * d);
    Out Pm(sc, dt, P, B * nh * S * S, false), O(sc, dt, out, B * S * nh * d, false);
    cpu::attention_forward(Q.f(), Kt.f(), Vt.f(), Pm.f(), O.f(), B, S, nh, nkv, d);
  }
  void attention_backward(DType dt, const void* dout, const void* q, const void* k, const void* v,
                          const void* P, void* dq, void* dk, void* dv, void* scratch,
                          Index scratch_elems, Index B, Index S, Index nh, Index nkv,
                          Index d) override {
    Scratch& sc = scratch_.fresh();
    const In DO(sc, dt, dout, B * S * nh * d, "attention_backward"), Q(sc, dt, q, B * S * nh * d), Kt(sc, dt, k, B * S * nkv * d),
        Vt(sc, dt, v, B * S * nkv * d), Pm(sc, dt, P, B * nh * S * S);
    Out DQ(sc, dt, dq, B * S * nh * d, false), DK(sc, dt, dk, B * S * nkv * d, false), DV(sc, dt, dv, B * S * nkv * d, false);
    Out SC(sc, dt, scratch, scratch_elems, false);
    cpu::attention_backward(DO.f(), Q.f(), Kt.f(), Vt.f(), Pm.f(), DQ.f(), DK.f(), DV.f(), SC.f(), scratch_elems, B, S, nh, nkv, d);
  }
  void flash_attention_forward(DType dt, const void* q, const void* k, const void* v, float* lse, void* out,
                               Index B, Index S, Index nh, Index nkv, Index d) override {
    Scratch& sc = scratch_.fresh();
    const In Q(sc, dt, q, B * S * nh * d, "flash_attention_forward"), Kt(sc, dt, k, B * S * nkv * d), Vt(sc, dt, v, B * S * nkv * d);
    Out O(sc, dt, out, B * S * nh * d, false);
    cpu::flash_attention_forward(Q.f(), Kt.f(), Vt.f(), lse, O.f(), B, S, nh, nkv, d);
  }
  void flash_attention_backward(DType dt, const void* dout, const void* q, const void* k, const void* v,
                                const void* out, const float* lse, void* dq, void* dk, void* dv, Index B, Index S,
                                Index nh, Index nkv, Index d) override {
    Scratch& sc = scratch_.fresh();
    const In DO(sc, dt, dout, B * S * nh * d, "flash_attention_backward"), Q(sc, dt, q, B * S * nh * d), Kt(sc, dt, k, B * S * nkv * d),
        Vt(sc, dt, v, B * S * nkv * d), O(sc, dt, out, B * S * nh * d);
    Out DQ(sc, dt, dq, B * S * nh * d, false), DK(sc, dt, dk, B * S * nkv * d, false), DV(sc, dt, dv, B * S * nkv * d, false);
    cpu::flash_attention_backward(DO.f(), Q.f(), Kt.f(), Vt.f(), O.f(), lse, DQ.f(), DK.f(), DV.f(), B, S, nh, nkv, d);
  }
  void swiglu_forward(DType dt, const void* gate, const void* up, void* act, Index n) override {
    Scratch& sc = scratch_.fresh();
    const In G(sc, dt, gate, n, "swiglu_forward"), U(sc, dt, up, n);
    Out Ac(sc, dt, act, n, false);
    cpu::swiglu_forward(G.f(), U.f(), Ac.f(), n);
  }
  void swiglu_backward(DType dt, const void* dact, const void* gate, const void* up, void* dgate,
                       void* dup, Index n) override {
    Scratch& sc = scratch_.fresh();
    const In DA(sc, dt, dact, n, "swiglu_backward"), G(sc, dt, gate, n), U(sc, dt, up, n);
    Out DG(sc, dt, dgate, n, false), DU(sc, dt, dup, n, false);
    cpu::swiglu_backward(DA.f(), G.f(), U.f(), DG.f(), DU.f(), n);
  }
  void embedding_forward(DType dt, const std::int32_t* tokens, const void* table, void* out, Index M,
                         Index V, Index H) override {
    Scratch& sc = scratch_.fresh();
    const In T(sc, dt, table, V * H, "embedding_forward");
    Out O(sc, dt, out, M * H, false);
    cpu::embedding_forward(tokens, T.f(), O.f(), M, V, H);
  }
  void cross_entropy_forward(DType dt, const void* logits, const std::int32_t* targets, Index M, Index V,
                             double* loss_sum) override {
    Scratch& sc = scratch_.fresh();
    const In L(sc, dt, logits, M * V, "cross_entropy_forward");
    *loss_sum += cpu::cross_entropy_forward(L.f(), targets, M, V);
  }
  void cross_entropy_backward(DType dt, const void* logits, const std::int32_t* targets, void* dlogits,
                              double count, Index M, Index V) override {
    Scratch& sc = scratch_.fresh();
    const In L(sc, dt, logits, M * V, "cross_entropy_backward");  // a copy when dlogits aliases it
    Out D(sc, dt, dlogits, M * V, false);
    cpu::cross_entropy_backward(L.f(), targets, D.f(), count, M, V);
  }
  void add(DType dt, const void* a, const void* b, void* out, Index n) override {
    Scratch& sc = scratch_.fresh();
    const In Am(sc, dt, a, n, "add"), Bm(sc, dt, b, n);
    Out O(sc, dt, out, n, false);
    cpu::add(Am.f(), Bm.f(), O.f(), n);
  }
  void sum_squares(DType dt, const void* x, Index n, double* out) override {
    Scratch& sc = scratch_.fresh();
    const In X(sc, dt, x, n, "sum_squares");
    *out = cpu::sum_squares(X.f(), n);
  }
  void scale(DType dt, void* x, float s, Index n) override {
    Scratch& sc = scratch_.fresh();
    Out X(sc, dt, x, n, true, "scale");
    cpu::scale_inplace(X.f(), s, n);
  }
  void adamw_step(float* param, const float* grad, float* m, float* v, Index n, std::int64_t step,
                  double lr, double beta1, double beta2, double eps, double weight_decay) override {
    executor::adamw_step(param, grad, m, v, n, step, lr,
                         AdamWConfig{beta1, beta2, eps, weight_decay});
  }

 private:
  using Clock = std::chrono::steady_clock;
  int threads_ = 1;
  Scratch scratch_;
  std::vector<Clock::time_point> marks_;
  // when_waited: copies and copy-queue marks in the order they were enqueued.
  struct Queued {
    bool is_mark;
    void* dst;
    const void* src;
    std::uint64_t bytes;
    std::size_t mark;
  };
  CpuCopyQueue copies_ = CpuCopyQueue::at_enqueue;
  std::deque<Queued> queued_;
  HeapThatPoisonsFrees poisoned_;
  MemoryResource& memory() { return copies_ == CpuCopyQueue::when_waited ? poisoned_ : heap_memory(); }
  // Runs the queue through the mark `slot` (everything: nullopt); a slot not queued (a compute
  // mark, or one already reached) runs nothing.
  void run_copies_through(std::optional<std::size_t> slot) {
    if (slot && std::none_of(queued_.begin(), queued_.end(), [&](const Queued& q) { return q.is_mark && q.mark == *slot; })) return;
    while (!queued_.empty()) {
      const Queued q = queued_.front();
      queued_.pop_front();
      if (!q.is_mark) {
        std::memcpy(q.dst, q.src, q.bytes);
        continue;
      }
      marks_.at(q.mark) = Clock::now();
      if (slot && q.mark == *slot) return;
    }
  }
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(int threads, CpuCopyQueue copies) { return std::make_unique<CpuBackend>(threads, copies); }

}  // namespace peftplan::executor
