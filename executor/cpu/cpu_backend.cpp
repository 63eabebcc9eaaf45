// The CPU backend: the Backend interface over the CPU kernels of kernels.h (Eigen GEMMs with
// Eigen's own OpenMP parallelism, OpenMP loops elsewhere). Device memory is the heap; copies
// are memcpy; kernels run inline on the calling thread, so synchronize() has nothing to wait
// for and a timing mark is the host clock when it is recorded. The only code of its own is the dropout mask, generated on the fly from a counter-based
// hash (the same bits as kernels.h dropout_mask) so that no mask buffer exists outside the
// step program.
#include <omp.h>

#include <chrono>
#include <cstring>
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

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(int threads) {
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

  MemoryResource& device_memory() override { return heap_memory(); }
  MemoryResource& host_memory() override { return heap_memory(); }
  void copy_to_device(void* dst, const void* src, std::uint64_t bytes) override { std::memcpy(dst, src, bytes); }
  void copy_to_host(void* dst, const void* src, std::uint64_t bytes) override { std::memcpy(dst, src, bytes); }
  void copy_device(void* dst, const void* src, std::uint64_t bytes) override { std::memmove(dst, src, bytes); }
  void fill_zero(void* dst, std::uint64_t bytes) override { std::memset(dst, 0, bytes); }
  void synchronize() override {}

  void reserve_marks(std::size_t slots) override {
    if (marks_.size() < slots) marks_.resize(slots);
  }
  void record_mark(std::size_t slot) override { marks_.at(slot) = Clock::now(); }
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

  void linear_forward(const float* x, const float* W, const float* bias, float* y, Index M,
                      Index K, Index N, bool accumulate) override {
    cpu::linear_forward(x, W, bias, y, M, K, N, mode(accumulate));
  }
  void linear_backward_input(const float* dy, const float* W, float* dx, Index M, Index K,
                             Index N, bool accumulate) override {
    cpu::linear_backward_input(dy, W, dx, M, K, N, mode(accumulate));
  }
  void dropout_forward(const float* x, float* out, Index n, const DropoutKey& key) override {
    const std::uint64_t mixed = splitmix64(key.seed);
    const float s = static_cast<float>(1.0 / (1.0 - key.p));
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
    for (Index i = 0; i < n; ++i) out[i] = keep(mixed, key.p, i) ? x[i] * s : 0.0f;
  }
  void lora_forward(const float* x_in, const float* A, const float* B, float scale, float* u,
                    float* y, Index M, Index K, Index N, Index r) override {
    cpu::lora_forward<float>(x_in, A, B, scale, nullptr, 0.0f, u, y, nullptr, M, K, N, r);
  }
  void lora_backward(const float* dy, const float* x_in, const float* A, const float* B,
                     const float* u, float scale, const DropoutKey& key, float* dA, float* dB,
                     float* dx, float* scratch, Index M, Index K, Index N, Index r) override {
    if (key.p <= 0.0) {
      cpu::lora_backward<float>(dy, x_in, A, B, u, scale, nullptr, 0.0f, dA, dB, dx, scratch, M,
                                K, N, r, Accum::add, Accum::add);
      return;
    }
    // x_in is the saved dropped input: dA and dB as without dropout; dx through the mask.
    cpu::lora_backward<float>(dy, x_in, A, B, u, scale, nullptr, 0.0f, dA, dB, nullptr, scratch,
                              M, K, N, r, Accum::add, Accum::add);
    if (dx == nullptr) return;
    CMap<float> DU(scratch, M, r);
    CMap<float> Am(A, r, K);
    Map<float> G(scratch + M * r, M, K);
    G.noalias() = DU * Am;
    const std::uint64_t mixed = splitmix64(key.seed);
    const float s = static_cast<float>(1.0 / (1.0 - key.p));
    const float* g = scratch + M * r;
    const Index n = M * K;
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
    for (Index i = 0; i < n; ++i)
      if (keep(mixed, key.p, i)) dx[i] += g[i] * s;
  }
  void rmsnorm_forward(const float* x, const float* w, float eps, float* y, float* rstd, Index M,
                       Index H) override {
    cpu::rmsnorm_forward(x, w, eps, y, rstd, M, H);
  }
  void rmsnorm_backward(const float* dy, const float* x, const float* w, const float* rstd,
                        float* dx, Index M, Index H, bool accumulate) override {
    cpu::rmsnorm_backward<float>(dy, x, w, rstd, dx, nullptr, M, H, mode(accumulate), Accum::add);
  }
  void rope_tables(float* tables, Index S, Index d, double theta) override {
    cpu::rope_tables(tables, tables + cpu::rope_table_elems(S, d), S, d, theta);
  }
  void rope_forward(float* x, const float* tables, Index B, Index S, Index nheads,
                    Index d) override {
    cpu::rope_forward(x, tables, tables + cpu::rope_table_elems(S, d), B, S, nheads, d);
  }
  void rope_backward(float* dx, const float* tables, Index B, Index S, Index nheads,
                     Index d) override {
    cpu::rope_backward(dx, tables, tables + cpu::rope_table_elems(S, d), B, S, nheads, d);
  }
  void attention_forward(const float* q, const float* k, const float* v, float* P, float* out,
                         Index B, Index S, Index nh, Index nkv, Index d) override {
    cpu::attention_forward(q, k, v, P, out, B, S, nh, nkv, d);
  }
  void attention_backward(const float* dout, const float* q, const float* k, const float* v,
                          const float* P, float* dq, float* dk, float* dv, float* scratch,
                          Index scratch_elems, Index B, Index S, Index nh, Index nkv,
                          Index d) override {
    cpu::attention_backward(dout, q, k, v, P, dq, dk, dv, scratch, scratch_elems, B, S, nh, nkv, d);
  }
  void flash_attention_forward(const float* q, const float* k, const float* v, float* lse, float* out, Index B,
                               Index S, Index nh, Index nkv, Index d) override {
    cpu::flash_attention_forward(q, k, v, lse, out, B, S, nh, nkv, d);
  }
  void flash_attention_backward(const float* dout, const float* q, const float* k, const float* v, const float* out,
                                const float* lse, float* dq, float* dk, float* dv, Index B, Index S, Index nh, Index nkv,
                                Index d) override {
    cpu::flash_attention_backward(dout, q, k, v, out, lse, dq, dk, dv, B, S, nh, nkv, d);
  }
  void swiglu_forward(const float* gate, const float* up, float* act, Index n) override {
    cpu::swiglu_forward(gate, up, act, n);
  }
  void swiglu_backward(const float* dact, const float* gate, const float* up, float* dgate,
                       float* dup, Index n) override {
    cpu::swiglu_backward(dact, gate, up, dgate, dup, n);
  }
  void embedding_forward(const std::int32_t* tokens, const float* table, float* out, Index M,
                         Index V, Index H) override {
    cpu::embedding_forward(tokens, table, out, M, V, H);
  }
  void cross_entropy_forward(const float* logits, const std::int32_t* targets, Index M, Index V,
                             double* loss_sum) override {
    *loss_sum += cpu::cross_entropy_forward(logits, targets, M, V);
  }
  void cross_entropy_backward(const float* logits, const std::int32_t* targets, float* dlogits,
                              double count, Index M, Index V) override {
    cpu::cross_entropy_backward(logits, targets, dlogits, count, M, V);
  }
  void add(const float* a, const float* b, float* out, Index n) override { cpu::add(a, b, out, n); }
  void sum_squares(const float* x, Index n, double* out) override { *out = cpu::sum_squares(x, n); }
  void scale(float* x, float s, Index n) override { cpu::scale_inplace(x, s, n); }
  void adamw_step(float* param, const float* grad, float* m, float* v, Index n, std::int64_t step,
                  double lr, double beta1, double beta2, double eps, double weight_decay) override {
    executor::adamw_step(param, grad, m, v, n, step, lr,
                         AdamWConfig{beta1, beta2, eps, weight_decay});
  }

 private:
  using Clock = std::chrono::steady_clock;
  int threads_ = 1;
  std::vector<Clock::time_point> marks_;
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(int threads) { return std::make_unique<CpuBackend>(threads); }

}  // namespace peftplan::executor
