// CPU kernels for everything but attention (attention.cpp): linear, LoRA, RMSNorm, RoPE,
// SwiGLU, embedding, cross-entropy and the elementwise helpers. GEMMs go to Eigen (its own
// OpenMP-parallel, cache-blocked GEMM); row- and element-wise loops use OpenMP directly.
// Nothing here allocates: every buffer, scratch included, belongs to the caller.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "eigen_maps.h"
#include "peftplan/common/error.h"
#include "peftplan/executor/kernels.h"

namespace peftplan::executor::cpu {

using namespace detail;

// ------------------------------------------------------------------------------------ linear

template <typename T>
void linear_forward(const T* x, const T* W, const T* bias, T* y, Index M, Index K, Index N,
                    Accum mode) {
  CMap<T> X(x, M, K);
  CMap<T> Wm(W, N, K);
  Map<T> Y(y, M, N);
  if (mode == Accum::add)
    Y.noalias() += X * Wm.transpose();
  else
    Y.noalias() = X * Wm.transpose();
  if (bias != nullptr) Y.rowwise() += CVecMap<T>(bias, N);
}

template <typename T>
void linear_backward_input(const T* dy, const T* W, T* dx, Index M, Index K, Index N, Accum mode) {
  CMap<T> DY(dy, M, N);
  CMap<T> Wm(W, N, K);
  Map<T> DX(dx, M, K);
  if (mode == Accum::add)
    DX.noalias() += DY * Wm;
  else
    DX.noalias() = DY * Wm;
}

template <typename T>
void linear_backward_weight(const T* dy, const T* x, T* dW, T* db, Index M, Index K, Index N,
                            Accum mode) {
  CMap<T> DY(dy, M, N);
  CMap<T> X(x, M, K);
  Map<T> DW(dW, N, K);
  if (mode == Accum::add)
    DW.noalias() += DY.transpose() * X;
  else
    DW.noalias() = DY.transpose() * X;
  if (db != nullptr) {
    VecMap<T> DB(db, N);
    if (mode == Accum::add)
      DB += DY.colwise().sum();
    else
      DB = DY.colwise().sum();
  }
}

// -------------------------------------------------------------------------------------- LoRA

double lora_scaling(double lora_alpha, Index r, bool use_rslora) {
  PEFTPLAN_CHECK(r > 0);
  // peft/tuners/lora/layer.py update_layer: scaling = lora_alpha / (sqrt(r) if use_rslora else r)
  return use_rslora ? lora_alpha / std::sqrt(static_cast<double>(r))
                    : lora_alpha / static_cast<double>(r);
}

namespace {
// SplitMix64 finaliser (Steele, Lea, Flood 2014): a bijective 64-bit mix, good enough to turn a
// counter into independent-looking uniform bits.
inline std::uint64_t splitmix64(std::uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// x ⊙ mask / (1-p) into out (torch dropout: input * (bernoulli(1-p) / (1-p))).
template <typename T>
void apply_dropout(const T* x, const std::uint8_t* mask, T p, T* out, Index n) {
  const T keep_scale = T(1) / (T(1) - p);
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (Index i = 0; i < n; ++i) out[i] = mask[i] ? x[i] * keep_scale : T(0);
}
}  // namespace

void dropout_mask(std::uint64_t seed, std::uint64_t offset, double p, std::uint8_t* mask, Index n) {
  PEFTPLAN_CHECK_MSG(p >= 0.0 && p < 1.0, "dropout p must be in [0, 1), got {}", p);
  const std::uint64_t key = splitmix64(seed);
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (Index i = 0; i < n; ++i) {
    const std::uint64_t z = splitmix64(key ^ (offset + static_cast<std::uint64_t>(i)));
    const double u = static_cast<double>(z >> 11) * 0x1p-53;  // uniform in [0, 1)
    mask[i] = u >= p ? 1 : 0;
  }
}

Index lora_forward_scratch_elems(Index M, Index K, bool dropout) { return dropout ? M * K : 0; }

template <typename T>
void lora_forward(const T* x, const T* A, const T* B, T scaling, const std::uint8_t* keep_mask,
                  T dropout_p, T* u, T* y, T* scratch, Index M, Index K, Index N, Index r) {
  const T* xin = x;
  if (keep_mask != nullptr) {
    PEFTPLAN_CHECK(scratch != nullptr);
    apply_dropout(x, keep_mask, dropout_p, scratch, M * K);
    xin = scratch;
  }
  CMap<T> X(xin, M, K);
  CMap<T> Am(A, r, K);
  CMap<T> Bm(B, N, r);
  Map<T> U(u, M, r);
  Map<T> Y(y, M, N);
  U.noalias() = X * Am.transpose();
  Y.noalias() += (scaling * U) * Bm.transpose();
}

Index lora_backward_scratch_elems(Index M, Index K, Index r, bool dropout) {
  return M * r + (dropout ? M * K : 0);
}

template <typename T>
void lora_backward(const T* dy, const T* x, const T* A, const T* B, const T* u, T scaling,
                   const std::uint8_t* keep_mask, T dropout_p, T* dA, T* dB, T* dx, T* scratch,
                   Index M, Index K, Index N, Index r, Accum grad_mode, Accum dx_mode) {
  CMap<T> DY(dy, M, N);
  CMap<T> Am(A, r, K);
  CMap<T> Bm(B, N, r);
  CMap<T> U(u, M, r);
  Map<T> DAm(dA, r, K);
  Map<T> DBm(dB, N, r);
  Map<T> DU(scratch, M, r);  // dL/du = scaling · dy · B
  T* xd = scratch + M * r;   // drop(x), then the pre-dropout input gradient

  DU.noalias() = (scaling * DY) * Bm;
  if (grad_mode == Accum::add)
    DBm.noalias() += (scaling * DY.transpose()) * U;
  else
    DBm.noalias() = (scaling * DY.transpose()) * U;

  const T* xin = x;
  if (keep_mask != nullptr) {
    apply_dropout(x, keep_mask, dropout_p, xd, M * K);
    xin = xd;
  }
  CMap<T> X(xin, M, K);
  if (grad_mode == Accum::add)
    DAm.noalias() += DU.transpose() * X;
  else
    DAm.noalias() = DU.transpose() * X;

  if (dx == nullptr) return;
  if (keep_mask == nullptr) {
    Map<T> DX(dx, M, K);
    if (dx_mode == Accum::add)
      DX.noalias() += DU * Am;
    else
      DX.noalias() = DU * Am;
    return;
  }
  Map<T> G(xd, M, K);
  G.noalias() = DU * Am;
  const T keep_scale = T(1) / (T(1) - dropout_p);
  const Index n = M * K;
  const bool add_mode = dx_mode == Accum::add;
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (Index i = 0; i < n; ++i) {
    const T g = keep_mask[i] ? xd[i] * keep_scale : T(0);
    dx[i] = add_mode ? dx[i] + g : g;
  }
}

// ----------------------------------------------------------------------------------- RMSNorm

template <typename T>
void rmsnorm_forward(const T* x, const T* w, T eps, T* y, T* rstd, Index M, Index H) {
#pragma omp parallel for schedule(static) if (M * H >= kParallelMin)
  for (Index m = 0; m < M; ++m) {
    CArrMap<T> xr(x + m * H, H);
    // LlamaRMSNorm: variance = hidden.pow(2).mean(-1); hidden * rsqrt(variance + eps); weight * hidden
    const T var = xr.square().sum() / static_cast<T>(H);
    const T rs = T(1) / std::sqrt(var + eps);
    rstd[m] = rs;
    ArrMap<T>(y + m * H, H) = (xr * rs) * CArrMap<T>(w, H);
  }
}

template <typename T>
void rmsnorm_backward(const T* dy, const T* x, const T* w, const T* rstd, T* dx, T* dw, Index M,
                      Index H, Accum dx_mode, Accum dw_mode) {
  const bool dx_add = dx_mode == Accum::add;
#pragma omp parallel for schedule(static) if (M * H >= kParallelMin)
  for (Index m = 0; m < M; ++m) {
    const T rs = rstd[m];
    CArrMap<T> g(dy + m * H, H), xr(x + m * H, H), wr(w, H);
    ArrMap<T> d(dx + m * H, H);
    // c = mean(g ⊙ w ⊙ x̂) with x̂ = x·rs;  dx = rs · (g ⊙ w − x̂ · c)
    const T c = (g * wr * xr).sum() * rs / static_cast<T>(H);
    if (dx_add)
      d += rs * (g * wr - xr * (rs * c));
    else
      d = rs * (g * wr - xr * (rs * c));
  }
  if (dw == nullptr) return;
  // dw = Σ_m dy[m,:] ⊙ x[m,:] · rstd[m]: threads own column blocks, so no reduction scratch.
  constexpr Index kBlock = 256;
  const Index nblocks = (H + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) if (M * H >= kParallelMin)
  for (Index bj = 0; bj < nblocks; ++bj) {
    const Index j0 = bj * kBlock, len = std::min(kBlock, H - j0);
    ArrMap<T> acc(dw + j0, len);
    if (dw_mode == Accum::overwrite) acc.setZero();
    for (Index m = 0; m < M; ++m)
      acc += CArrMap<T>(dy + m * H + j0, len) * CArrMap<T>(x + m * H + j0, len) * rstd[m];
  }
}

// -------------------------------------------------------------------------------------- RoPE

Index rope_table_elems(Index S, Index d) { return S * (d / 2); }

template <typename T>
void rope_tables(T* cos, T* sin, Index S, Index d, double theta) {
  PEFTPLAN_CHECK_MSG(d % 2 == 0, "RoPE needs an even head_dim, got {}", d);
  const Index half = d / 2;
  // LlamaRotaryEmbedding (default rope): inv_freq = 1 / base^(arange(0, dim, 2) / dim), in fp32;
  // freqs = position · inv_freq; emb = cat(freqs, freqs); cos/sin of emb (we store one half).
  for (Index s = 0; s < S; ++s) {
    for (Index i = 0; i < half; ++i) {
      const T inv_freq = T(1) / std::pow(static_cast<T>(theta),
                                         static_cast<T>(2 * i) / static_cast<T>(d));
      const T angle = static_cast<T>(s) * inv_freq;
      cos[s * half + i] = std::cos(angle);
      sin[s * half + i] = std::sin(angle);
    }
  }
}

namespace {
// sign = +1: forward rotation x' = x·cos + rotate_half(x)·sin;
// sign = -1: its transpose (the backward), g' = g·cos − rotate_half(g·sin).
template <typename T>
void rope_apply(T* x, const T* cos, const T* sin, Index B, Index S, Index nheads, Index d,
                T sign) {
  const Index half = d / 2;
#pragma omp parallel for collapse(2) schedule(static) if (B * S * nheads * d >= kParallelMin)
  for (Index b = 0; b < B; ++b) {
    for (Index s = 0; s < S; ++s) {
      const T* c = cos + s * half;
      const T* sn = sin + s * half;
      for (Index h = 0; h < nheads; ++h) {
        T* v = x + ((b * S + s) * nheads + h) * d;
        for (Index i = 0; i < half; ++i) {
          const T x1 = v[i], x2 = v[i + half], si = sign * sn[i];
          v[i] = x1 * c[i] - x2 * si;
          v[i + half] = x2 * c[i] + x1 * si;
        }
      }
    }
  }
}
}  // namespace

template <typename T>
void rope_forward(T* x, const T* cos, const T* sin, Index B, Index S, Index nheads, Index d) {
  rope_apply(x, cos, sin, B, S, nheads, d, T(1));
}

template <typename T>
void rope_backward(T* dx, const T* cos, const T* sin, Index B, Index S, Index nheads, Index d) {
  rope_apply(dx, cos, sin, B, S, nheads, d, T(-1));
}

// ------------------------------------------------------------------------------------ SwiGLU

// Chunks of kChunk elements through Eigen's vectorised exp (scalar std::exp made SwiGLU a tenth
// of a small model's step).
constexpr Index kChunk = 4096;

template <typename T>
void swiglu_forward(const T* g, const T* u, T* a, Index n) {
  const Index chunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (Index c = 0; c < chunks; ++c) {
    const Index i0 = c * kChunk, len = std::min(kChunk, n - i0);
    CArrMap<T> G(g + i0, len), U(u + i0, len);
    ArrMap<T>(a + i0, len) = G / (T(1) + (-G).exp()) * U;
  }
}

template <typename T>
void swiglu_backward(const T* da, const T* g, const T* u, T* dg, T* du, Index n) {
  const Index chunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (Index c = 0; c < chunks; ++c) {
    const Index i0 = c * kChunk, len = std::min(kChunk, n - i0);
    CArrMap<T> G(g + i0, len), U(u + i0, len), DA(da + i0, len);
    // On the stack (a fixed maximum size): kernels never allocate.
    const Eigen::Array<T, Eigen::Dynamic, 1, 0, kChunk, 1> sig = T(1) / (T(1) + (-G).exp());
    ArrMap<T>(dg + i0, len) = DA * U * sig * (T(1) + G * (T(1) - sig));
    ArrMap<T>(du + i0, len) = DA * G * sig;
  }
}

// --------------------------------------------------------------------------------- embedding

namespace {
void check_tokens(const std::int32_t* tokens, Index M, Index V) {
  for (Index m = 0; m < M; ++m)
    PEFTPLAN_CHECK_MSG(tokens[m] >= 0 && tokens[m] < V, "token id {} at row {} outside [0, {})",
                       tokens[m], m, V);
}
}  // namespace

template <typename T>
void embedding_forward(const std::int32_t* tokens, const T* table, T* out, Index M, Index V,
                       Index H) {
  check_tokens(tokens, M, V);
#pragma omp parallel for schedule(static) if (M * H >= kParallelMin)
  for (Index m = 0; m < M; ++m)
    std::memcpy(out + m * H, table + static_cast<Index>(tokens[m]) * H, sizeof(T) * H);
}

template <typename T>
void embedding_backward(const std::int32_t* tokens, const T* dout, T* dtable, Index M, Index V,
                        Index H, Accum mode) {
  check_tokens(tokens, M, V);
  if (mode == Accum::overwrite) std::fill(dtable, dtable + V * H, T(0));
  // Threads own column blocks and walk the rows in order: deterministic and race-free.
  constexpr Index kBlock = 256;
  const Index nblocks = (H + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) if (M * H >= kParallelMin)
  for (Index bj = 0; bj < nblocks; ++bj) {
    const Index j0 = bj * kBlock, len = std::min(kBlock, H - j0);
    for (Index m = 0; m < M; ++m)
      ArrMap<T>(dtable + static_cast<Index>(tokens[m]) * H + j0, len) +=
          CArrMap<T>(dout + m * H + j0, len);
  }
}

// ----------------------------------------------------------------------------- cross-entropy

namespace {
void check_targets(const std::int32_t* targets, Index M, Index V) {
  for (Index m = 0; m < M; ++m)
    PEFTPLAN_CHECK_MSG(targets[m] == kIgnoreIndex || (targets[m] >= 0 && targets[m] < V),
                       "target {} at row {} outside [0, {}) and not ignore_index", targets[m],
                       m, V);
}

// Max and log of the shifted exponential sum of one row, so that log_softmax(l)[j] =
// (l[j] − max) − log_sum (ATen's log_softmax formulation: no cancellation at large logits).
template <typename T>
struct RowLse {
  T max;
  T log_sum;
};
template <typename T>
RowLse<T> row_lse(const T* row, Index V) {
  CArrMap<T> l(row, V);
  const T mx = l.maxCoeff();
  return {mx, std::log((l - mx).exp().sum())};
}
}  // namespace

template <typename T>
double cross_entropy_forward(const T* logits, const std::int32_t* targets, Index M, Index V) {
  check_targets(targets, M, V);
  double total = 0.0;
#pragma omp parallel for schedule(static) reduction(+ : total) if (M * V >= kParallelMin)
  for (Index m = 0; m < M; ++m) {
    if (targets[m] == kIgnoreIndex) continue;
    const T* row = logits + m * V;
    const RowLse<T> r = row_lse(row, V);
    total += static_cast<double>(r.log_sum - (row[targets[m]] - r.max));
  }
  return total;
}

template <typename T>
double cross_entropy_backward(const T* logits, const std::int32_t* targets, T* dlogits,
                              double count, Index M, Index V) {
  check_targets(targets, M, V);
  PEFTPLAN_CHECK_MSG(count > 0, "cross-entropy token count must be positive, got {}", count);
  const T inv = static_cast<T>(1.0 / count);
  double total = 0.0;
#pragma omp parallel for schedule(static) reduction(+ : total) if (M * V >= kParallelMin)
  for (Index m = 0; m < M; ++m) {
    const T* row = logits + m * V;
    T* drow = dlogits + m * V;  // may be the same memory as row
    const std::int32_t t = targets[m];
    if (t == kIgnoreIndex) {
      std::fill(drow, drow + V, T(0));
      continue;
    }
    const RowLse<T> r = row_lse(row, V);
    total += static_cast<double>(r.log_sum - (row[t] - r.max));
    // Elementwise, each element read before it is written: safe in place.
    ArrMap<T>(drow, V) = ((CArrMap<T>(row, V) - r.max) - r.log_sum).exp() * inv;
    drow[t] -= inv;
  }
  return total;
}

// ------------------------------------------------------------------------------- elementwise

template <typename T>
void add(const T* a, const T* b, T* out, Index n) {
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (Index i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

template <typename T>
void add_inplace(T* y, const T* x, Index n) {
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (Index i = 0; i < n; ++i) y[i] += x[i];
}

template <typename T>
void scale_inplace(T* x, T s, Index n) {
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (Index i = 0; i < n; ++i) x[i] *= s;
}

template <typename T>
double sum_squares(const T* x, Index n) {
  double total = 0.0;
#pragma omp parallel for schedule(static) reduction(+ : total) if (n >= kParallelMin)
  for (Index i = 0; i < n; ++i) {
    const double v = static_cast<double>(x[i]);
    total += v * v;
  }
  return total;
}

// ------------------------------------------------------------------- explicit instantiations

#define PEFTPLAN_INSTANTIATE(T)                                                                   \
  template void linear_forward<T>(const T*, const T*, const T*, T*, Index, Index, Index, Accum); \
  template void linear_backward_input<T>(const T*, const T*, T*, Index, Index, Index, Accum);    \
  template void linear_backward_weight<T>(const T*, const T*, T*, T*, Index, Index, Index,       \
                                          Accum);                                                \
  template void lora_forward<T>(const T*, const T*, const T*, T, const std::uint8_t*, T, T*, T*, \
                                T*, Index, Index, Index, Index);                                 \
  template void lora_backward<T>(const T*, const T*, const T*, const T*, const T*, T,            \
                                 const std::uint8_t*, T, T*, T*, T*, T*, Index, Index, Index,    \
                                 Index, Accum, Accum);                                           \
  template void rmsnorm_forward<T>(const T*, const T*, T, T*, T*, Index, Index);                 \
  template void rmsnorm_backward<T>(const T*, const T*, const T*, const T*, T*, T*, Index,       \
                                    Index, Accum, Accum);                                        \
  template void rope_tables<T>(T*, T*, Index, Index, double);                                    \
  template void rope_forward<T>(T*, const T*, const T*, Index, Index, Index, Index);             \
  template void rope_backward<T>(T*, const T*, const T*, Index, Index, Index, Index);            \
  template void swiglu_forward<T>(const T*, const T*, T*, Index);                                \
  template void swiglu_backward<T>(const T*, const T*, const T*, T*, T*, Index);                 \
  template void embedding_forward<T>(const std::int32_t*, const T*, T*, Index, Index, Index);    \
  template void embedding_backward<T>(const std::int32_t*, const T*, T*, Index, Index, Index,    \
                                      Accum);                                                    \
  template double cross_entropy_forward<T>(const T*, const std::int32_t*, Index, Index);         \
  template double cross_entropy_backward<T>(const T*, const std::int32_t*, T*, double, Index,    \
                                            Index);                                              \
  template void add<T>(const T*, const T*, T*, Index);                                           \
  template void add_inplace<T>(T*, const T*, Index);                                             \
  template void scale_inplace<T>(T*, T, Index);                                                  \
  template double sum_squares<T>(const T*, Index);

PEFTPLAN_INSTANTIATE(float)
PEFTPLAN_INSTANTIATE(double)
#undef PEFTPLAN_INSTANTIATE

}  // namespace peftplan::executor::cpu
