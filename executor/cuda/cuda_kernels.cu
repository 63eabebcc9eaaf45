// The CUDA backend's kernels (cuda_backend.cpp holds the Backend itself and the cuBLAS
// calls): the row- and element-wise ops of kernels.h on the GPU, each behind a launcher that
// enqueues it on a stream and returns the launch's error. One thread block per row where a row
// reduces (RMSNorm, softmax, cross-entropy), a grid-stride loop elsewhere, one block per tile for
// flash attention; fp32 arithmetic in the same order of operations as the CPU kernels where the CPU
// has one (kernels.cpp, optim.cpp; flash attention's tiles and sums are its own).
//
// Storage: every kernel but AdamW and the conversions is a template on the element type T of its
// activations, weights and gradients, float (fp32) or __nv_bfloat16 (bf16). ld() widens an element
// to fp32 as it is read, st() rounds an fp32 result to T, to nearest even, as it is written
// (__float2bfloat16_rn), so bf16 storage gets fp32 arithmetic and fp32 accumulation with one
// rounding per stored value (backend.h, "kernels"); for T = float both are plain loads and stores
// and the arithmetic is what it was before the template. The launchers take the storage as a
// value (Storage) and dispatch; fp16 is converted (convert()) but not computed on.
//
// This file includes no header of ours beyond cuda_kernels.h and kernels.h's plain declarations
// (nvcc compiles it; fmt and the C++20 headers stay with the host compiler).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "cuda_kernels.h"
#include "peftplan/executor/kernels.h"  // plain declarations: cpu::kIgnoreIndex

namespace peftplan::executor::cuda {
namespace {

constexpr int kThreads = 256;
using cpu::kIgnoreIndex;  // torch.nn.CrossEntropyLoss's default
using BF16 = __nv_bfloat16;

// Grid-stride loops: enough blocks to fill the device a few times over, never more than needed.
int blocks_for(Index n) {
  const Index b = (n + kThreads - 1) / kThreads;
  return static_cast<int>(b < 1 ? 1 : (b > 65535 * 4 ? 65535 * 4 : b));
}
// Threads for one row of `len`: a multiple of 32, up to 1024.
int row_threads(Index len) {
  const Index t = ((len + 31) / 32) * 32;
  return static_cast<int>(t < 32 ? 32 : (t > 1024 ? 1024 : t));
}

// ------------------------------------------------------------------------------ storage

// p[i] widened to fp32 (exact: bf16 is the top half of an fp32).
__device__ inline float ld(const float* p, Index i) { return p[i]; }
__device__ inline float ld(const BF16* p, Index i) { return __bfloat162float(p[i]); }
// p[i] = v rounded to the storage, to nearest even (CUDA Math API, "Bfloat16 Conversion and Data
// Movement": __float2bfloat16_rn; NaN stays NaN, overflow becomes ±inf).
__device__ inline void st(float* p, Index i, float v) { p[i] = v; }
__device__ inline void st(BF16* p, Index i, float v) { p[i] = __float2bfloat16_rn(v); }

// The element type of a Storage, for a launcher's generic lambda: f(Of<T>{}) with T float or
// __nv_bfloat16; fp16 (no kernel computes on it) is cudaErrorInvalidValue, nothing launched.
template <typename T>
struct Of {
  using type = T;
};
template <typename F>
cudaError_t with_storage(Storage st, F&& f) {
  switch (st) {
    case Storage::fp32: return f(Of<float>{});
    case Storage::bf16: return f(Of<BF16>{});
    case Storage::fp16: break;
  }
  return cudaErrorInvalidValue;
}
// A launcher's untyped operand as the storage's elements.
template <typename T>
const T* as(const void* p) { return static_cast<const T*>(p); }
template <typename T>
T* as(void* p) { return static_cast<T*>(p); }

// ------------------------------------------------------------------------------ block reduce

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
template <typename T>
__device__ T block_sum(T v, T* shared) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  __syncthreads();  // shared may still be read by an earlier reduction
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  T t = lane < warps ? shared[lane] : T(0);
  for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
  return t;
}
__device__ float block_max(float v, float* shared) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  float t = lane < warps ? shared[lane] : -INFINITY;
  for (int o = 16; o > 0; o >>= 1) t = fmaxf(t, __shfl_xor_sync(0xffffffffu, t, o));
  return t;
}

// ------------------------------------------------------------------------------------ kernels

// The CPU backend's counter-based mask (cpu_backend.cpp keep(); kernels.cpp dropout_mask):
// SplitMix64 (Steele, Lea, Flood 2014) of the mixed key and the element index, so that a mask is
// the same bits on every backend, rank and recompute.
__device__ inline std::uint64_t splitmix64(std::uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
__device__ inline bool keep(std::uint64_t mixed, double p, Index i) {
  const std::uint64_t z = splitmix64(mixed ^ static_cast<std::uint64_t>(i));
  return static_cast<double>(z >> 11) * 0x1p-53 >= p;
}

template <typename T>
__global__ void k_dropout(const T* x, T* out, Index n, std::uint64_t mixed, double p, float s) {
  for (Index i = blockIdx.x * Index(blockDim.x) + threadIdx.x; i < n; i += Index(gridDim.x) * blockDim.x)
    st(out, i, keep(mixed, p, i) ? ld(x, i) * s : 0.0f);
}
// dx[i] += keep ? g[i]·s : 0 (the LoRA input gradient through the dropout mask).
template <typename T>
__global__ void k_dropout_backward_add(const T* g, T* dx, Index n, std::uint64_t mixed, double p, float s) {
  for (Index i = blockIdx.x * Index(blockDim.x) + threadIdx.x; i < n; i += Index(gridDim.x) * blockDim.x)
    if (keep(mixed, p, i)) st(dx, i, ld(dx, i) + ld(g, i) * s);
}

template <typename T>
__global__ void k_add_bias(T* y, const T* bias, Index M, Index N) {
  const Index n = M * N;
  for (Index i = blockIdx.x * Index(blockDim.x) + threadIdx.x; i < n; i += Index(gridDim.x) * blockDim.x)
    st(y, i, ld(y, i) + ld(bias, i % N));
}
// y = the bias on every row: a copy, exact in any storage.
template <typename T>
__global__ void k_broadcast_bias(T* y, const T* bias, Index M, Index N) {
  const Index n = M * N;
  for (Index i = blockIdx.x * Index(blockDim.x) + threadIdx.x; i < n; i += Index(gridDim.x) * blockDim.x)
    y[i] = bias[i % N];
}

// LlamaRMSNorm (transformers modeling_llama.py): y = w ⊙ x·rsqrt(mean(x²) + eps); one block a row.
// rstd is fp32 in every storage.
template <typename T>
__global__ void k_rmsnorm_forward(const T* x, const T* w, float eps, T* y, float* rstd, Index H) {
  __shared__ float sh[32];
  const Index m = blockIdx.x;
  const T* xr = x + m * H;
  float s = 0.0f;
  for (Index j = threadIdx.x; j < H; j += blockDim.x) {
    const float xv = ld(xr, j);
    s += xv * xv;
  }
  s = block_sum(s, sh);
  const float rs = 1.0f / sqrtf(s / static_cast<float>(H) + eps);
  if (threadIdx.x == 0) rstd[m] = rs;
  for (Index j = threadIdx.x; j < H; j += blockDim.x) st(y, m * H + j, ld(xr, j) * rs * ld(w, j));
}
// dx = rstd·(g⊙w − x·rstd·c), c = Σ(g⊙w⊙x)·rstd / H (kernels.h §3).
template <typename T>
__global__ void k_rmsnorm_backward(const T* dy, const T* x, const T* w, const float* rstd, T* dx, Index H,
                                   bool accumulate) {
  __shared__ float sh[32];
  const Index m = blockIdx.x;
  const float rs = rstd[m];
  const T* g = dy + m * H;
  const T* xr = x + m * H;
  float s = 0.0f;
  for (Index j = threadIdx.x; j < H; j += blockDim.x) s += ld(g, j) * ld(w, j) * ld(xr, j);
  const float c = block_sum(s, sh) * rs / static_cast<float>(H);
  for (Index j = threadIdx.x; j < H; j += blockDim.x) {
    const float v = rs * (ld(g, j) * ld(w, j) - ld(xr, j) * (rs * c));
    st(dx, m * H + j, accumulate ? ld(dx, m * H + j) + v : v);
  }
}

// RoPE, rotate_half convention (kernels.h §4): sign +1 forward, −1 its transpose (backward). The
// tables are fp32 in every storage.
template <typename T>
__global__ void k_rope(T* x, const float* cos, const float* sin, Index B, Index S, Index nheads, Index d, float sign) {
  const Index half = d / 2, n = B * S * nheads * half;
  for (Index t = blockIdx.x * Index(blockDim.x) + threadIdx.x; t < n; t += Index(gridDim.x) * blockDim.x) {
    const Index i = t % half, row = t / half;  // row = (b·S + s)·nheads + h
    const Index s = (row / nheads) % S;
    T* v = x + row * d;
    const float c = cos[s * half + i], si = sign * sin[s * half + i];
    const float x1 = ld(v, i), x2 = ld(v, i + half);
    st(v, i, x1 * c - x2 * si);
    st(v, i + half, x2 * c + x1 * si);
  }
}

// Causal softmax of one score row (one block a row of P[B·nh·S, S]): the scale is already in the
// scores (the GEMM's alpha); masked columns j > i get probability 0, as kernels.h §5 saves P.
// fp32 keeps e^(s − max) in the row between the sum and the normalisation; a bf16 row would round
// it there, so bf16 makes it again from the score and rounds once, at the probability's store.
template <typename T>
__global__ void k_causal_softmax(T* P, Index S) {
  constexpr bool keep_e = std::is_same<T, float>::value;
  __shared__ float sh[32];
  const Index row = blockIdx.x, i = row % S;
  T* r = P + row * S;
  float mx = -INFINITY;
  for (Index j = threadIdx.x; j <= i; j += blockDim.x) mx = fmaxf(mx, ld(r, j));
  mx = block_max(mx, sh);
  float s = 0.0f;
  for (Index j = threadIdx.x; j <= i; j += blockDim.x) {
    const float e = expf(ld(r, j) - mx);
    if constexpr (keep_e) st(r, j, e);
    s += e;
  }
  const float inv = 1.0f / block_sum(s, sh);
  for (Index j = threadIdx.x; j < S; j += blockDim.x) {
    if (j > i) {
      st(r, j, 0.0f);
    } else if constexpr (keep_e) {
      st(r, j, ld(r, j) * inv);
    } else {
      st(r, j, expf(ld(r, j) - mx) * inv);
    }
  }
}
// Softmax backward in place on dP (rows of `heads` consecutive heads): dS = P⊙(dP − Σ P⊙dP)·scale.
template <typename T>
__global__ void k_softmax_backward(const T* P, T* dP, Index S, float scale) {
  __shared__ float sh[32];
  const Index row = blockIdx.x, i = row % S;
  const T* p = P + row * S;
  T* g = dP + row * S;
  float dot = 0.0f;
  for (Index j = threadIdx.x; j <= i; j += blockDim.x) dot += ld(p, j) * ld(g, j);
  dot = block_sum(dot, sh);
  for (Index j = threadIdx.x; j < S; j += blockDim.x) st(g, j, j <= i ? ld(p, j) * (ld(g, j) - dot) * scale : 0.0f);
}

template <typename T>
__global__ void k_swiglu_forward(const T* g, const T* u, T* a, Index n) {
  for (Index i = blockIdx.x * Index(blockDim.x) + threadIdx.x; i < n; i += Index(gridDim.x) * blockDim.x) {
    const float gi = ld(g, i);
    st(a, i, gi / (1.0f + expf(-gi)) * ld(u, i));
  }
}
template <typename T>
__global__ void k_swiglu_backward(const T* da, const T* g, const T* u, T* dg, T* du, Index n) {
  for (Index i = blockIdx.x * Index(blockDim.x) + threadIdx.x; i < n; i += Index(gridDim.x) * blockDim.x) {
    const float gi = ld(g, i), ui = ld(u, i);
    const float sig = 1.0f / (1.0f + expf(-gi));
    const float d = ld(da, i);
    st(dg, i, d * ui * sig * (1.0f + gi * (1.0f - sig)));
    st(du, i, d * gi * sig);
  }
}

// A row of the table per token: a copy, exact in any storage.
template <typename T>
__global__ void k_embedding(const std::int32_t* tokens, const T* table, T* out, Index M, Index H) {
  const Index n = M * H;
  for (Index t = blockIdx.x * Index(blockDim.x) + threadIdx.x; t < n; t += Index(gridDim.x) * blockDim.x)
    out[t] = table[static_cast<Index>(tokens[t / H]) * H + t % H];
}

// Cross-entropy over one row of logits (one block a row): logsumexp − logit[target], as ATen's
// log_softmax (max-shifted), in fp32 from logits of any storage; the loss sum is fp64. Rows whose
// target is ignore_index add nothing (backward: zeros).
template <typename T>
__global__ void k_cross_entropy(const T* logits, const std::int32_t* targets, T* dlogits, double inv_count, Index V,
                                double* loss_sum, bool backward) {
  __shared__ float sh[32];
  const Index m = blockIdx.x;
  const std::int32_t t = targets[m];
  const T* row = logits + m * V;
  if (t == kIgnoreIndex) {
    if (backward)
      for (Index j = threadIdx.x; j < V; j += blockDim.x) st(dlogits, m * V + j, 0.0f);
    return;
  }
  float mx = -INFINITY;
  for (Index j = threadIdx.x; j < V; j += blockDim.x) mx = fmaxf(mx, ld(row, j));
  mx = block_max(mx, sh);
  float s = 0.0f;
  for (Index j = threadIdx.x; j < V; j += blockDim.x) s += expf(ld(row, j) - mx);
  const float log_sum = logf(block_sum(s, sh));
  const float target_logit = ld(row, t);
  if (threadIdx.x == 0) atomicAdd(loss_sum, static_cast<double>(log_sum - (target_logit - mx)));
  if (!backward) return;
  __syncthreads();  // every thread has read row[t] before the row is overwritten in place
  const float inv = static_cast<float>(inv_count);
  for (Index j = threadIdx.x; j < V; j += blockDim.x) {
    float v = expf((ld(row, j) - mx) - log_sum) * inv;
    if (j == t) v -= inv;
    st(dlogits, m * V + j, v);
  }
}

template <typename T>
__global__ void k_add(const T* a, const T* b, T* out, Index n) {
  for (Index i = blockIdx.x * Index(blockDim.x) + threadIdx.x; i < n; i += Index(gridDim.x) * blockDim.x)
    st(out, i, ld(a, i) + ld(b, i));
}
template <typename T>
__global__ void k_scale(T* x, float s, Index n) {
  for (Index i = blockIdx.x * Index(blockDim.x) + threadIdx.x; i < n; i += Index(gridDim.x) * blockDim.x)
    st(x, i, ld(x, i) * s);
}
// Σ x² in fp64: block partial sums, one atomicAdd per block into *out (zeroed first).
template <typename T>
__global__ void k_sum_squares(const T* x, Index n, double* out) {
  __shared__ double sh[32];
  double s = 0.0;
  for (Index i = blockIdx.x * Index(blockDim.x) + threadIdx.x; i < n; i += Index(gridDim.x) * blockDim.x) {
    const double v = ld(x, i);
    s += v * v;
  }
  s = block_sum(s, sh);
  if (threadIdx.x == 0) atomicAdd(out, s);
}

// torch.optim.AdamW's single-tensor step (torch/optim/adam.py _single_tensor_adam with
// decoupled weight decay), element for element as optim.cpp adamw_step computes it in fp32.
__global__ void k_adamw(float* param, const float* grad, float* m, float* v, Index n, AdamWScalars c) {
  for (Index i = blockIdx.x * Index(blockDim.x) + threadIdx.x; i < n; i += Index(gridDim.x) * blockDim.x) {
    float p = param[i];
    const float g = grad[i];
    if (c.decoupled) p = p * c.decay;
    float mi = m[i];
    mi = fabsf(c.lerp_w) < 0.5f ? mi + c.lerp_w * (g - mi) : g - (g - mi) * (1.0f - c.lerp_w);
    float vi = v[i] * c.beta2;
    vi = vi + c.one_m_beta2 * g * g;
    const float denom = sqrtf(vi) / c.bc2_sqrt + c.eps;
    p = p + c.neg_step_size * mi / denom;
    m[i] = mi;
    v[i] = vi;
    param[i] = p;
  }
}

// Conversions: __float2bfloat16_rn / __float2half_rn round to nearest even (NaN stays NaN,
// overflow becomes ±inf), the widening ones are exact, as kernels.h's CPU conversions.
__global__ void k_f32_to_bf16(const float* s, __nv_bfloat16* d, Index n) {
  for (Index i = blockIdx.x * Index(blockDim.x) + threadIdx.x; i < n; i += Index(gridDim.x) * blockDim.x) d[i] = __float2bfloat16_rn(s[i]);
}
__global__ void k_bf16_to_f32(const __nv_bfloat16* s, float* d, Index n) {
  for (Index i = blockIdx.x * Index(blockDim.x) + threadIdx.x; i < n; i += Index(gridDim.x) * blockDim.x) d[i] = __bfloat162float(s[i]);
}
__global__ void k_f32_to_f16(const float* s, __half* d, Index n) {
  for (Index i = blockIdx.x * Index(blockDim.x) + threadIdx.x; i < n; i += Index(gridDim.x) * blockDim.x) d[i] = __float2half_rn(s[i]);
}
__global__ void k_f16_to_f32(const __half* s, float* d, Index n) {
  for (Index i = blockIdx.x * Index(blockDim.x) + threadIdx.x; i < n; i += Index(gridDim.x) * blockDim.x) d[i] = __half2float(s[i]);
}
__global__ void k_bf16_to_f16(const __nv_bfloat16* s, __half* d, Index n) {
  for (Index i = blockIdx.x * Index(blockDim.x) + threadIdx.x; i < n; i += Index(gridDim.x) * blockDim.x) d[i] = __float2half_rn(__bfloat162float(s[i]));
}
__global__ void k_f16_to_bf16(const __half* s, __nv_bfloat16* d, Index n) {
  for (Index i = blockIdx.x * Index(blockDim.x) + threadIdx.x; i < n; i += Index(gridDim.x) * blockDim.x) d[i] = __float2bfloat16_rn(__half2float(s[i]));
}


// --------------------------------------------------------------------------- flash attention
//
// Causal GQA attention in fp32 tiles that stay on chip (Dao, "FlashAttention-2: Faster Attention
// with Better Parallelism and Work Partitioning", 2023). The forward is Algorithm 1: one block per
// (batch, head, query tile) runs an online softmax over the key tiles up to the diagonal and
// writes out and lse = m + log l. The backward is Algorithm 2 split in two kernels so that no
// gradient is summed across blocks (no atomics: deterministic): one block per query tile makes dq
// over the key tiles up to the diagonal, one per (batch, kv head, key tile) makes dk and dv over
// the rep query heads sharing the kv head and the query tiles from the diagonal on. Both
// recompute the scores and P = e^(score − lse); each row's D = Σ dout ⊙ out is made in the block.
// q, k, v, out and the gradients are stored in T (fp32 or bf16), lse in fp32: a tile is widened
// to fp32 as it loads into shared memory (the same tiles and bytes for either storage) and each
// output element is rounded to T once, when it is written; P, dS and the sums never leave fp32.
//
// Threads: 256 a block, a 16 × 16 grid (tx = threadIdx.x % 16, a half-warp; ty = threadIdx.x / 16).
// Of a score tile [R][C] thread (ty, tx) holds rows ty + 16a (a < R/16) and columns tx + 16b
// (b < C/16), so a row's max and sum are shuffles within one half-warp; of an accumulator [R][D]
// it holds the same rows and the float4 column groups 4tx + 64g (g < D/64). D is the head dim
// rounded up to 64, 128 or 256 (kernels for each; columns past d are zero in shared memory and
// never written). Shared rows are D + 4 floats apart: (D + 4)/4 ≡ 1 (mod 8), so the 8 lanes of one
// 128-bit shared-load phase reading 8 consecutive rows hit 8 different bank quads.
//
// Tile sizes (rows × columns of the score tile) and dynamic shared memory per block:
//   D     forward (q × k)       dq (q × k)            dk, dv (k × q)
//   64    64 × 64   68.0 KiB    64 × 32   60.0 KiB    64 × 32   69.3 KiB
//   128   64 × 32   75.0 KiB    32 × 32   70.5 KiB    32 × 32   75.3 KiB
//   256   32 × 16   67.5 KiB    16 × 16   66.3 KiB    16 × 16   67.6 KiB
// chosen so that every block fits 99 KiB, the smallest opt-in shared memory of the GPUs that run
// this build's sm_90 code (sm_120 has 99 KiB; sm_90 and sm_100 227 KiB), lets two blocks share an
// H100 SM (ptxas gives the kernels 64-128 registers a thread, so registers allow two as well), and
// keeps each thread's accumulators at 16-32 floats; the backward tiles are smaller because each
// block holds four operand tiles instead of three. Global loads are plain (no cp.async pipeline)
// and the products run on the fp32 cores: correct and deterministic first.

constexpr int kFlashThreads = 256;
constexpr std::size_t kFlashMaxSharedBytes = 99 * 1024;

template <int D>
struct FlashTiles;
template <>
struct FlashTiles<64> {
  static constexpr int fwd_q = 64, fwd_k = 64, dq_q = 64, dq_k = 32, dkv_k = 64, dkv_q = 32;
};
template <>
struct FlashTiles<128> {
  static constexpr int fwd_q = 64, fwd_k = 32, dq_q = 32, dq_k = 32, dkv_k = 32, dkv_q = 32;
};
template <>
struct FlashTiles<256> {
  static constexpr int fwd_q = 32, fwd_k = 16, dq_q = 16, dq_k = 16, dkv_k = 16, dkv_q = 16;
};

// Bytes of dynamic shared memory of each kernel (R score rows, C score columns; rows of operands
// D + 4 floats, rows of score tiles C + 4 floats).
constexpr std::size_t flash_forward_smem(int D, int R, int C) {  // Q[R], K[C], V[C]; P[R][C]
  return sizeof(float) * (std::size_t(R + 2 * C) * (D + 4) + std::size_t(R) * (C + 4));
}
constexpr std::size_t flash_dq_smem(int D, int R, int C) {  // Q[R], dO[R], K[C], V[C]; dS[R][C]
  return sizeof(float) * (std::size_t(2 * R + 2 * C) * (D + 4) + std::size_t(R) * (C + 4));
}
constexpr std::size_t flash_dkdv_smem(int D, int R, int C) {  // K[R], V[R], Q[C], dO[C]; P, dS[R][C]; lse, D[C]
  return sizeof(float) * (std::size_t(2 * R + 2 * C) * (D + 4) + 2 * std::size_t(R) * (C + 4) + 2 * std::size_t(C));
}

__device__ inline float half_warp_max(float v) {
  for (int o = 8; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
// Butterfly: every lane of the half-warp ends with the same bits (a + b == b + a).
__device__ inline float half_warp_sum(float v) {
  for (int o = 8; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ inline float component(const float4& v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }
__device__ inline float4 scaled(const float4& v, float f) { return make_float4(v.x * f, v.y * f, v.z * f, v.w * f); }

// sh[rows][D + 4] = rows [0, valid) × columns [0, d) of src (row stride `stride` elements of T),
// widened to fp32, zero elsewhere: rows past S and columns past d contribute nothing to a dot
// product or a sum.
template <int D, typename T>
__device__ void flash_load(float* sh, int rows, const T* src, Index stride, int valid, int d) {
  for (int t = threadIdx.x; t < rows * D; t += kFlashThreads) {
    const int r = t / D, c = t % D;
    sh[r * (D + 4) + c] = r < valid && c < d ? ld(src, r * stride + c) : 0.0f;
  }
}

// acc[a][b] += Σ_{c < dk4} A[ty + 16a][c]·Bm[tx + 16b][c] (A, Bm: shared [·][D + 4]; dk4 = d
// rounded up to 4, the columns past d being zero).
template <int D, int RM, int SN>
__device__ void flash_dot(float (&acc)[RM][SN], const float* A, const float* Bm, int dk4) {
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
#pragma unroll 2
  for (int c = 0; c < dk4; c += 4) {
    float4 a4[RM], b4[SN];
#pragma unroll
    for (int a = 0; a < RM; ++a) a4[a] = *reinterpret_cast<const float4*>(A + (ty + 16 * a) * (D + 4) + c);
#pragma unroll
    for (int b = 0; b < SN; ++b) b4[b] = *reinterpret_cast<const float4*>(Bm + (tx + 16 * b) * (D + 4) + c);
#pragma unroll
    for (int a = 0; a < RM; ++a)
#pragma unroll
      for (int b = 0; b < SN; ++b) {
        acc[a][b] += a4[a].x * b4[b].x;
        acc[a][b] += a4[a].y * b4[b].y;
        acc[a][b] += a4[a].z * b4[b].z;
        acc[a][b] += a4[a].w * b4[b].w;
      }
  }
}

// acc[a][g] += Σ_{j < C} T[ty + 16a][j]·X[j][4tx + 64g .. +3] (T: shared [R][C + 4], a score
// tile; X: shared [C][D + 4], an operand tile).
template <int D, int C, int RM>
__device__ void flash_accumulate(float4 (&acc)[RM][D / 64], const float* T, const float* X) {
  constexpr int CN = D / 64;
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
#pragma unroll 2
  for (int j = 0; j < C; j += 4) {
    float4 t4[RM];
#pragma unroll
    for (int a = 0; a < RM; ++a) t4[a] = *reinterpret_cast<const float4*>(T + (ty + 16 * a) * (C + 4) + j);
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      float4 x4[CN];
#pragma unroll
      for (int g = 0; g < CN; ++g) x4[g] = *reinterpret_cast<const float4*>(X + (j + jj) * (D + 4) + 4 * tx + 64 * g);
#pragma unroll
      for (int a = 0; a < RM; ++a) {
        const float t = component(t4[a], jj);
#pragma unroll
        for (int g = 0; g < CN; ++g) {
          acc[a][g].x += t * x4[g].x;
          acc[a][g].y += t * x4[g].y;
          acc[a][g].z += t * x4[g].z;
          acc[a][g].w += t * x4[g].w;
        }
      }
    }
  }
}

// row[c .. c+3] = v·f rounded to T, the columns below d only.
template <typename T>
__device__ inline void flash_store(T* row, int c, const float4& v, float f, int d) {
  if (c < d) st(row, c, v.x * f);
  if (c + 1 < d) st(row, c + 1, v.y * f);
  if (c + 2 < d) st(row, c + 2, v.z * f);
  if (c + 3 < d) st(row, c + 3, v.w * f);
}

// Σ_c dout[row][c]·out[row][c] over one row, by the 16 lanes of a half-warp (every lane gets it;
// all 32 lanes of the warp call it, `live` false giving 0).
template <typename T>
__device__ inline float flash_row_dot(const T* dout_row, const T* out_row, int d, bool live) {
  float part = 0.0f;
  if (live)
    for (int c = threadIdx.x % 16; c < d; c += 16) part += ld(dout_row, c) * ld(out_row, c);
  return half_warp_sum(part);
}

// Algorithm 1. Block id → (batch·head bh, query tile), the query tiles with the most key tiles first.
template <int D, int BR, int BC, typename T>
__global__ void __launch_bounds__(kFlashThreads)
    k_flash_forward(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                    float* __restrict__ lse, T* __restrict__ out, Index B, Index S, Index nh, Index nkv, int d,
                    float scale) {
  constexpr int RM = BR / 16, SN = BC / 16, CN = D / 64, ldt = D + 4, lp = BC + 4;
  extern __shared__ float4 flash_shared[];
  float* Qs = reinterpret_cast<float*>(flash_shared);  // [BR][ldt]
  float* Ks = Qs + BR * ldt;                            // [BC][ldt]
  float* Vs = Ks + BC * ldt;                            // [BC][ldt]
  float* Ps = Vs + BC * ldt;                            // [BR][lp]
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const Index heads = B * nh, tiles = (S + BR - 1) / BR;
  const Index bh = blockIdx.x % heads, qt = tiles - 1 - blockIdx.x / heads;
  const Index b = bh / nh, h = bh % nh, kvh = h / (nh / nkv);
  const Index q0 = qt * BR, qs = nh * d, ks = nkv * d;  // first query; row strides
  const int rows = static_cast<int>(S - q0 < BR ? S - q0 : BR), dk4 = (d + 3) & ~3;
  flash_load<D>(Qs, BR, q + ((b * S + q0) * nh + h) * d, qs, rows, d);
  const T* kb = k + (b * S * nkv + kvh) * d;
  const T* vb = v + (b * S * nkv + kvh) * d;

  float m[RM], l[RM];  // running max and Σ e^(s − m) of each row (equal in the row's 16 lanes)
  float4 o[RM][CN];    // unnormalised output rows
#pragma unroll
  for (int a = 0; a < RM; ++a) {
    m[a] = -INFINITY;
    l[a] = 0.0f;
#pragma unroll
    for (int g = 0; g < CN; ++g) o[a][g] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
  const Index key_tiles = (q0 + rows - 1) / BC + 1;  // up to the tile of the last query
  for (Index kt = 0; kt < key_tiles; ++kt) {
    const Index k0 = kt * BC;
    const int keys = static_cast<int>(S - k0 < BC ? S - k0 : BC);
    __syncthreads();  // the previous tile's K, V and P are read
    flash_load<D>(Ks, BC, kb + k0 * ks, ks, keys, d);
    flash_load<D>(Vs, BC, vb + k0 * ks, ks, keys, d);
    __syncthreads();
    float s[RM][SN] = {};
    flash_dot<D, RM, SN>(s, Qs, Ks, dk4);
#pragma unroll
    for (int a = 0; a < RM; ++a) {
      const int i = static_cast<int>(q0) + ty + 16 * a;
      float mx = -INFINITY;
#pragma unroll
      for (int bb = 0; bb < SN; ++bb) {
        const int j = static_cast<int>(k0) + tx + 16 * bb;
        s[a][bb] = j <= i ? s[a][bb] * scale : -INFINITY;  // causal; keys past S are past every query
        mx = fmaxf(mx, s[a][bb]);
      }
      // m' = max(m, rowmax), l' = e^(m−m')·l + Σ e^(s−m'), O' = e^(m−m')·O + P·V. Key tile 0 holds
      // key 0, so m' is finite from the first tile on; the guard only keeps e^(−∞ − −∞) out.
      const float m_new = fmaxf(m[a], half_warp_max(mx));
      const float base = m_new == -INFINITY ? 0.0f : m_new;
      const float alpha = expf(m[a] - base);
      float sum = 0.0f;
#pragma unroll
      for (int bb = 0; bb < SN; ++bb) {
        const float p = expf(s[a][bb] - base);
        Ps[(ty + 16 * a) * lp + tx + 16 * bb] = p;
        sum += p;
      }
      l[a] = l[a] * alpha + half_warp_sum(sum);
      m[a] = m_new;
#pragma unroll
      for (int g = 0; g < CN; ++g) o[a][g] = scaled(o[a][g], alpha);
    }
    __syncthreads();  // P is whole
    flash_accumulate<D, BC, RM>(o, Ps, Vs);
  }
#pragma unroll
  for (int a = 0; a < RM; ++a) {
    const Index i = q0 + ty + 16 * a;
    if (i >= S) continue;
    T* row = out + ((b * S + i) * nh + h) * d;
    const float inv = 1.0f / l[a];
#pragma unroll
    for (int g = 0; g < CN; ++g) flash_store(row, 4 * tx + 64 * g, o[a][g], inv, d);
    if (tx == 0) lse[bh * S + i] = m[a] + logf(l[a]);
  }
}

// Algorithm 2, dq half: dq_i = Σ_j dS_ij k_j / √d over the key tiles up to the diagonal,
// dS_ij = P_ij (dout_i·v_j − D_i), P_ij = e^(s_ij − lse_i). Block id as the forward's.
template <int D, int BR, int BC, typename T>
__global__ void __launch_bounds__(kFlashThreads)
    k_flash_backward_dq(const T* __restrict__ dout, const T* __restrict__ q, const T* __restrict__ k,
                        const T* __restrict__ v, const T* __restrict__ out, const float* __restrict__ lse,
                        T* __restrict__ dq, Index B, Index S, Index nh, Index nkv, int d, float scale) {
  constexpr int RM = BR / 16, SN = BC / 16, CN = D / 64, ldt = D + 4, lp = BC + 4;
  extern __shared__ float4 flash_shared[];
  float* Qs = reinterpret_cast<float*>(flash_shared);  // [BR][ldt]
  float* dOs = Qs + BR * ldt;                           // [BR][ldt]
  float* Ks = dOs + BR * ldt;                           // [BC][ldt]
  float* Vs = Ks + BC * ldt;                            // [BC][ldt]
  float* dSs = Vs + BC * ldt;                           // [BR][lp]
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const Index heads = B * nh, tiles = (S + BR - 1) / BR;
  const Index bh = blockIdx.x % heads, qt = tiles - 1 - blockIdx.x / heads;
  const Index b = bh / nh, h = bh % nh, kvh = h / (nh / nkv);
  const Index q0 = qt * BR, qs = nh * d, ks = nkv * d;
  const int rows = static_cast<int>(S - q0 < BR ? S - q0 : BR), dk4 = (d + 3) & ~3;
  const Index first = (b * S + q0) * nh + h;  // row index of (b, q0, h) in [B·S·nh, d]
  flash_load<D>(Qs, BR, q + first * d, qs, rows, d);
  flash_load<D>(dOs, BR, dout + first * d, qs, rows, d);
  const T* kb = k + (b * S * nkv + kvh) * d;
  const T* vb = v + (b * S * nkv + kvh) * d;

  float L[RM], Dr[RM];  // lse and D = Σ dout ⊙ out of each row
  float4 acc[RM][CN];
#pragma unroll
  for (int a = 0; a < RM; ++a) {
    const Index i = q0 + ty + 16 * a;
    const Index row = ((b * S + i) * nh + h) * d;
    Dr[a] = flash_row_dot(dout + row, out + row, d, i < S);
    L[a] = i < S ? lse[bh * S + i] : 0.0f;
#pragma unroll
    for (int g = 0; g < CN; ++g) acc[a][g] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
  const Index key_tiles = (q0 + rows - 1) / BC + 1;
  for (Index kt = 0; kt < key_tiles; ++kt) {
    const Index k0 = kt * BC;
    const int keys = static_cast<int>(S - k0 < BC ? S - k0 : BC);
    __syncthreads();  // the previous tile's K and dS are read
    flash_load<D>(Ks, BC, kb + k0 * ks, ks, keys, d);
    flash_load<D>(Vs, BC, vb + k0 * ks, ks, keys, d);
    __syncthreads();
    float s[RM][SN] = {}, dp[RM][SN] = {};
    flash_dot<D, RM, SN>(s, Qs, Ks, dk4);
    flash_dot<D, RM, SN>(dp, dOs, Vs, dk4);
#pragma unroll
    for (int a = 0; a < RM; ++a) {
      const int i = static_cast<int>(q0) + ty + 16 * a;
#pragma unroll
      for (int bb = 0; bb < SN; ++bb) {
        const int j = static_cast<int>(k0) + tx + 16 * bb;
        const bool live = j <= i && i < S;
        const float p = live ? expf(s[a][bb] * scale - L[a]) : 0.0f;
        dSs[(ty + 16 * a) * lp + tx + 16 * bb] = live ? p * (dp[a][bb] - Dr[a]) : 0.0f;
      }
    }
    __syncthreads();  // dS is whole
    flash_accumulate<D, BC, RM>(acc, dSs, Ks);
  }
#pragma unroll
  for (int a = 0; a < RM; ++a) {
    const Index i = q0 + ty + 16 * a;
    if (i >= S) continue;
    T* row = dq + ((b * S + i) * nh + h) * d;
#pragma unroll
    for (int g = 0; g < CN; ++g) flash_store(row, 4 * tx + 64 * g, acc[a][g], scale, d);
  }
}

// Algorithm 2, dk/dv half: for the keys of one tile, dv_j = Σ_i P_ij dout_i and
// dk_j = Σ_i dS_ij q_i / √d over the rep query heads of the kv head and the queries i >= j.
// Block id → (batch·kv head, key tile), the key tiles with the most query tiles first. The score
// tiles are transposed here: rows are keys, columns queries.
template <int D, int BR, int BC, typename T>
__global__ void __launch_bounds__(kFlashThreads)
    k_flash_backward_dkdv(const T* __restrict__ dout, const T* __restrict__ q, const T* __restrict__ k,
                          const T* __restrict__ v, const T* __restrict__ out, const float* __restrict__ lse,
                          T* __restrict__ dk, T* __restrict__ dv, Index B, Index S, Index nh, Index nkv, int d,
                          float scale) {
  constexpr int RM = BR / 16, SN = BC / 16, CN = D / 64, ldt = D + 4, lp = BC + 4;
  extern __shared__ float4 flash_shared[];
  float* Ks = reinterpret_cast<float*>(flash_shared);  // [BR][ldt]
  float* Vs = Ks + BR * ldt;                            // [BR][ldt]
  float* Qs = Vs + BR * ldt;                            // [BC][ldt]
  float* dOs = Qs + BC * ldt;                           // [BC][ldt]
  float* Ps = dOs + BC * ldt;                           // [BR][lp]
  float* dSs = Ps + BR * lp;                           // [BR][lp]
  float* Ls = dSs + BR * lp;                           // [BC]: lse of the tile's queries
  float* Ds = Ls + BC;                                 // [BC]: Σ dout ⊙ out of the tile's queries
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const Index kv_heads = B * nkv, rep = nh / nkv;
  const Index bkv = blockIdx.x % kv_heads, kt = blockIdx.x / kv_heads;
  const Index b = bkv / nkv, kvh = bkv % nkv;
  const Index k0 = kt * BR, qs = nh * d, ks = nkv * d;
  const int keys = static_cast<int>(S - k0 < BR ? S - k0 : BR), dk4 = (d + 3) & ~3;
  flash_load<D>(Ks, BR, k + ((b * S + k0) * nkv + kvh) * d, ks, keys, d);
  flash_load<D>(Vs, BR, v + ((b * S + k0) * nkv + kvh) * d, ks, keys, d);

  float4 adk[RM][CN], adv[RM][CN];
#pragma unroll
  for (int a = 0; a < RM; ++a)
#pragma unroll
    for (int g = 0; g < CN; ++g) {
      adk[a][g] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      adv[a][g] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
  const Index query_tiles = (S + BC - 1) / BC;
  for (Index r = 0; r < rep; ++r) {
    const Index h = kvh * rep + r, bh = b * nh + h;
    for (Index qt = k0 / BC; qt < query_tiles; ++qt) {  // from the tile of the first key on
      const Index q0 = qt * BC;
      const int queries = static_cast<int>(S - q0 < BC ? S - q0 : BC);
      const Index first = (b * S + q0) * nh + h;
      __syncthreads();  // the previous tile's Q, dO, P, dS, lse and D are read
      flash_load<D>(Qs, BC, q + first * d, qs, queries, d);
      flash_load<D>(dOs, BC, dout + first * d, qs, queries, d);
#pragma unroll
      for (int a = 0; a < SN; ++a) {  // half-warp ty takes queries ty + 16a
        const int c = ty + 16 * a;
        const Index i = q0 + c;
        const float Di = flash_row_dot(dout + (first + c * nh) * d, out + (first + c * nh) * d, d, i < S);
        if (tx == 0) {
          Ds[c] = Di;
          Ls[c] = i < S ? lse[bh * S + i] : 0.0f;
        }
      }
      __syncthreads();
      float s[RM][SN] = {}, dp[RM][SN] = {};  // sᵀ = k·qᵀ, dPᵀ = v·doutᵀ
      flash_dot<D, RM, SN>(s, Ks, Qs, dk4);
      flash_dot<D, RM, SN>(dp, Vs, dOs, dk4);
#pragma unroll
      for (int a = 0; a < RM; ++a) {
        const int j = static_cast<int>(k0) + ty + 16 * a;
#pragma unroll
        for (int bb = 0; bb < SN; ++bb) {
          const int c = tx + 16 * bb;
          const int i = static_cast<int>(q0) + c;
          const bool live = j <= i && i < S;
          const float p = live ? expf(s[a][bb] * scale - Ls[c]) : 0.0f;
          Ps[(ty + 16 * a) * lp + c] = p;
          dSs[(ty + 16 * a) * lp + c] = live ? p * (dp[a][bb] - Ds[c]) : 0.0f;
        }
      }
      __syncthreads();  // Pᵀ and dSᵀ are whole
      flash_accumulate<D, BC, RM>(adv, Ps, dOs);
      flash_accumulate<D, BC, RM>(adk, dSs, Qs);
    }
  }
#pragma unroll
  for (int a = 0; a < RM; ++a) {
    const Index j = k0 + ty + 16 * a;
    if (j >= S) continue;
    const Index row = ((b * S + j) * nkv + kvh) * d;
#pragma unroll
    for (int g = 0; g < CN; ++g) {
      flash_store(dk + row, 4 * tx + 64 * g, adk[a][g], scale, d);
      flash_store(dv + row, 4 * tx + 64 * g, adv[a][g], 1.0f, d);
    }
  }
}

// Launches `blocks` blocks of kFlashThreads with `smem_bytes` of dynamic shared memory (more than
// the 48 KiB default needs the kernel's opt-in, set on every launch: it is per kernel and device).
template <typename... Params, typename... Args>
cudaError_t launch_flash(void (*kernel)(Params...), Index blocks, std::size_t smem_bytes, cudaStream_t s,
                         Args... args) {
  if (blocks == 0) return cudaSuccess;
  if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
  if (const cudaError_t e =
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem_bytes));
      e != cudaSuccess)
    return e;
  kernel<<<static_cast<unsigned>(blocks), kFlashThreads, smem_bytes, s>>>(args...);
  return cudaGetLastError();
}

template <int D, typename T>
cudaError_t flash_forward_for(cudaStream_t s, const T* q, const T* k, const T* v, float* lse, T* out, Index B, Index S,
                              Index nh, Index nkv, int d, float scale) {
  constexpr int R = FlashTiles<D>::fwd_q, C = FlashTiles<D>::fwd_k;
  constexpr std::size_t smem = flash_forward_smem(D, R, C);
  static_assert(smem <= kFlashMaxSharedBytes, "flash forward tile exceeds the shared memory budget");
  return launch_flash(k_flash_forward<D, R, C, T>, B * nh * ((S + R - 1) / R), smem, s, q, k, v, lse, out, B, S, nh,
                      nkv, d, scale);
}

template <int D, typename T>
cudaError_t flash_backward_for(cudaStream_t s, const T* dout, const T* q, const T* k, const T* v, const T* out,
                               const float* lse, T* dq, T* dk, T* dv, Index B, Index S, Index nh, Index nkv, int d,
                               float scale) {
  constexpr int QR = FlashTiles<D>::dq_q, QC = FlashTiles<D>::dq_k;
  constexpr int KR = FlashTiles<D>::dkv_k, KC = FlashTiles<D>::dkv_q;
  constexpr std::size_t dq_smem = flash_dq_smem(D, QR, QC), dkdv_smem = flash_dkdv_smem(D, KR, KC);
  static_assert(dq_smem <= kFlashMaxSharedBytes, "flash dq tile exceeds the shared memory budget");
  static_assert(dkdv_smem <= kFlashMaxSharedBytes, "flash dk/dv tile exceeds the shared memory budget");
  if (const cudaError_t e = launch_flash(k_flash_backward_dq<D, QR, QC, T>, B * nh * ((S + QR - 1) / QR), dq_smem, s,
                                         dout, q, k, v, out, lse, dq, B, S, nh, nkv, d, scale);
      e != cudaSuccess)
    return e;
  return launch_flash(k_flash_backward_dkdv<D, KR, KC, T>, B * nkv * ((S + KR - 1) / KR), dkdv_smem, s, dout, q, k, v,
                      out, lse, dk, dv, B, S, nh, nkv, d, scale);
}

}  // namespace

// Positions within a sequence are ints in the kernels' masks (a tile past S included).
const char* flash_shape_refusal(Index B, Index S, Index nh, Index nkv, Index d) {
  if (B < 0 || S < 0 || nh < 0) return "negative shape";
  if (nkv <= 0 || nh % nkv != 0) return "the heads are not a multiple of the kv heads";
  if (S >= kFlashMaxSeqLen) return "the sequence is not shorter than 2^30 (positions are ints in the kernels)";
  if (d < 1 || d > kFlashMaxHeadDim) return "head_dim is outside 1..256 (its tiles in shared memory)";
  return nullptr;
}

// Each launcher below dispatches on the storage first (with_storage: fp16 is cudaErrorInvalidValue
// whatever the shape), then launches the kernel of that element type T.

// mixed = splitmix64(key seed), computed on the host by the caller (cuda_backend.cpp).
cudaError_t dropout(cudaStream_t s, Storage st, const void* x, void* out, Index n, std::uint64_t mixed, double p) {
  return with_storage(st, [&](auto t) {
    using T = typename decltype(t)::type;
    k_dropout<T><<<blocks_for(n), kThreads, 0, s>>>(as<T>(x), as<T>(out), n, mixed, p,
                                                    static_cast<float>(1.0 / (1.0 - p)));
    return cudaGetLastError();
  });
}
cudaError_t dropout_backward_add(cudaStream_t s, Storage st, const void* g, void* dx, Index n, std::uint64_t mixed,
                                 double p) {
  return with_storage(st, [&](auto t) {
    using T = typename decltype(t)::type;
    k_dropout_backward_add<T><<<blocks_for(n), kThreads, 0, s>>>(as<T>(g), as<T>(dx), n, mixed, p,
                                                                 static_cast<float>(1.0 / (1.0 - p)));
    return cudaGetLastError();
  });
}
cudaError_t add_bias(cudaStream_t s, Storage st, void* y, const void* bias, Index M, Index N) {
  return with_storage(st, [&](auto t) {
    using T = typename decltype(t)::type;
    k_add_bias<T><<<blocks_for(M * N), kThreads, 0, s>>>(as<T>(y), as<T>(bias), M, N);
    return cudaGetLastError();
  });
}
cudaError_t broadcast_bias(cudaStream_t s, Storage st, void* y, const void* bias, Index M, Index N) {
  return with_storage(st, [&](auto t) {
    using T = typename decltype(t)::type;
    k_broadcast_bias<T><<<blocks_for(M * N), kThreads, 0, s>>>(as<T>(y), as<T>(bias), M, N);
    return cudaGetLastError();
  });
}
cudaError_t rmsnorm_forward(cudaStream_t s, Storage st, const void* x, const void* w, float eps, void* y, float* rstd,
                            Index M, Index H) {
  return with_storage(st, [&](auto t) {
    using T = typename decltype(t)::type;
    if (M == 0) return cudaSuccess;
    k_rmsnorm_forward<T><<<static_cast<unsigned>(M), row_threads(H), 0, s>>>(as<T>(x), as<T>(w), eps, as<T>(y), rstd,
                                                                             H);
    return cudaGetLastError();
  });
}
cudaError_t rmsnorm_backward(cudaStream_t s, Storage st, const void* dy, const void* x, const void* w, const float* rstd,
                             void* dx, Index M, Index H, bool accumulate) {
  return with_storage(st, [&](auto t) {
    using T = typename decltype(t)::type;
    if (M == 0) return cudaSuccess;
    k_rmsnorm_backward<T><<<static_cast<unsigned>(M), row_threads(H), 0, s>>>(as<T>(dy), as<T>(x), as<T>(w), rstd,
                                                                              as<T>(dx), H, accumulate);
    return cudaGetLastError();
  });
}
cudaError_t rope(cudaStream_t s, Storage st, void* x, const float* cos, const float* sin, Index B, Index S,
                 Index nheads, Index d, float sign) {
  return with_storage(st, [&](auto t) {
    using T = typename decltype(t)::type;
    k_rope<T><<<blocks_for(B * S * nheads * (d / 2)), kThreads, 0, s>>>(as<T>(x), cos, sin, B, S, nheads, d, sign);
    return cudaGetLastError();
  });
}
cudaError_t causal_softmax(cudaStream_t s, Storage st, void* P, Index rows, Index S) {
  return with_storage(st, [&](auto t) {
    using T = typename decltype(t)::type;
    if (rows == 0) return cudaSuccess;
    k_causal_softmax<T><<<static_cast<unsigned>(rows), row_threads(S), 0, s>>>(as<T>(P), S);
    return cudaGetLastError();
  });
}
cudaError_t softmax_backward(cudaStream_t s, Storage st, const void* P, void* dP, Index rows, Index S, float scale) {
  return with_storage(st, [&](auto t) {
    using T = typename decltype(t)::type;
    if (rows == 0) return cudaSuccess;
    k_softmax_backward<T><<<static_cast<unsigned>(rows), row_threads(S), 0, s>>>(as<T>(P), as<T>(dP), S, scale);
    return cudaGetLastError();
  });
}
cudaError_t swiglu_forward(cudaStream_t s, Storage st, const void* g, const void* u, void* a, Index n) {
  return with_storage(st, [&](auto t) {
    using T = typename decltype(t)::type;
    k_swiglu_forward<T><<<blocks_for(n), kThreads, 0, s>>>(as<T>(g), as<T>(u), as<T>(a), n);
    return cudaGetLastError();
  });
}
cudaError_t swiglu_backward(cudaStream_t s, Storage st, const void* da, const void* g, const void* u, void* dg,
                            void* du, Index n) {
  return with_storage(st, [&](auto t) {
    using T = typename decltype(t)::type;
    k_swiglu_backward<T><<<blocks_for(n), kThreads, 0, s>>>(as<T>(da), as<T>(g), as<T>(u), as<T>(dg), as<T>(du), n);
    return cudaGetLastError();
  });
}
cudaError_t embedding(cudaStream_t s, Storage st, const std::int32_t* tokens, const void* table, void* out, Index M,
                      Index H) {
  return with_storage(st, [&](auto t) {
    using T = typename decltype(t)::type;
    k_embedding<T><<<blocks_for(M * H), kThreads, 0, s>>>(tokens, as<T>(table), as<T>(out), M, H);
    return cudaGetLastError();
  });
}
cudaError_t cross_entropy(cudaStream_t s, Storage st, const void* logits, const std::int32_t* targets, void* dlogits,
                          double inv_count, Index M, Index V, double* loss_sum) {
  return with_storage(st, [&](auto t) {
    using T = typename decltype(t)::type;
    if (M == 0) return cudaSuccess;
    k_cross_entropy<T><<<static_cast<unsigned>(M), row_threads(V), 0, s>>>(
        as<T>(logits), targets, as<T>(dlogits), inv_count, V, loss_sum, dlogits != nullptr);
    return cudaGetLastError();
  });
}
cudaError_t add(cudaStream_t s, Storage st, const void* a, const void* b, void* out, Index n) {
  return with_storage(st, [&](auto t) {
    using T = typename decltype(t)::type;
    k_add<T><<<blocks_for(n), kThreads, 0, s>>>(as<T>(a), as<T>(b), as<T>(out), n);
    return cudaGetLastError();
  });
}
cudaError_t scale(cudaStream_t s, Storage st, void* x, float f, Index n) {
  return with_storage(st, [&](auto t) {
    using T = typename decltype(t)::type;
    k_scale<T><<<blocks_for(n), kThreads, 0, s>>>(as<T>(x), f, n);
    return cudaGetLastError();
  });
}
cudaError_t sum_squares(cudaStream_t s, Storage st, const void* x, Index n, double* out) {
  return with_storage(st, [&](auto t) {
    using T = typename decltype(t)::type;
    if (const cudaError_t e = cudaMemsetAsync(out, 0, sizeof(double), s); e != cudaSuccess) return e;
    if (n == 0) return cudaSuccess;
    k_sum_squares<T><<<blocks_for(n), kThreads, 0, s>>>(as<T>(x), n, out);
    return cudaGetLastError();
  });
}
cudaError_t adamw(cudaStream_t s, float* param, const float* grad, float* m, float* v, Index n, const AdamWScalars& c) {
  if (n == 0) return cudaSuccess;
  k_adamw<<<blocks_for(n), kThreads, 0, s>>>(param, grad, m, v, n, c);
  return cudaGetLastError();
}
cudaError_t convert(cudaStream_t s, const void* src, Storage from, void* dst, Storage to, Index n) {
  if (n == 0) return cudaSuccess;
  const int g = blocks_for(n);
  using B16 = __nv_bfloat16;
  if (from == Storage::fp32 && to == Storage::bf16) k_f32_to_bf16<<<g, kThreads, 0, s>>>(static_cast<const float*>(src), static_cast<B16*>(dst), n);
  else if (from == Storage::bf16 && to == Storage::fp32) k_bf16_to_f32<<<g, kThreads, 0, s>>>(static_cast<const B16*>(src), static_cast<float*>(dst), n);
  else if (from == Storage::fp32 && to == Storage::fp16) k_f32_to_f16<<<g, kThreads, 0, s>>>(static_cast<const float*>(src), static_cast<__half*>(dst), n);
  else if (from == Storage::fp16 && to == Storage::fp32) k_f16_to_f32<<<g, kThreads, 0, s>>>(static_cast<const __half*>(src), static_cast<float*>(dst), n);
  else if (from == Storage::bf16 && to == Storage::fp16) k_bf16_to_f16<<<g, kThreads, 0, s>>>(static_cast<const B16*>(src), static_cast<__half*>(dst), n);
  else if (from == Storage::fp16 && to == Storage::bf16) k_f16_to_bf16<<<g, kThreads, 0, s>>>(static_cast<const __half*>(src), static_cast<B16*>(dst), n);
  else return cudaErrorInvalidValue;  // equal storages are the caller's plain copy
  return cudaGetLastError();
}

cudaError_t flash_attention_forward(cudaStream_t s, Storage st, const void* q, const void* k, const void* v,
                                    float* lse, void* out, Index B, Index S, Index nh, Index nkv, Index d) {
  if (flash_shape_refusal(B, S, nh, nkv, d)) return cudaErrorInvalidValue;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));  // as the CPU kernels form it
  const int hd = static_cast<int>(d);
  return with_storage(st, [&](auto t) {
    using T = typename decltype(t)::type;
    const T *qt = as<T>(q), *kt = as<T>(k), *vt = as<T>(v);
    T* ot = as<T>(out);
    if (d <= 64) return flash_forward_for<64>(s, qt, kt, vt, lse, ot, B, S, nh, nkv, hd, scale);
    if (d <= 128) return flash_forward_for<128>(s, qt, kt, vt, lse, ot, B, S, nh, nkv, hd, scale);
    return flash_forward_for<256>(s, qt, kt, vt, lse, ot, B, S, nh, nkv, hd, scale);
  });
}
cudaError_t flash_attention_backward(cudaStream_t s, Storage st, const void* dout, const void* q, const void* k,
                                     const void* v, const void* out, const float* lse, void* dq, void* dk, void* dv,
                                     Index B, Index S, Index nh, Index nkv, Index d) {
  if (flash_shape_refusal(B, S, nh, nkv, d)) return cudaErrorInvalidValue;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const int hd = static_cast<int>(d);
  return with_storage(st, [&](auto t) {
    using T = typename decltype(t)::type;
    const T *dOt = as<T>(dout), *qt = as<T>(q), *kt = as<T>(k), *vt = as<T>(v), *ot = as<T>(out);
    T *dqt = as<T>(dq), *dkt = as<T>(dk), *dvt = as<T>(dv);
    if (d <= 64) return flash_backward_for<64>(s, dOt, qt, kt, vt, ot, lse, dqt, dkt, dvt, B, S, nh, nkv, hd, scale);
    if (d <= 128) return flash_backward_for<128>(s, dOt, qt, kt, vt, ot, lse, dqt, dkt, dvt, B, S, nh, nkv, hd, scale);
    return flash_backward_for<256>(s, dOt, qt, kt, vt, ot, lse, dqt, dkt, dvt, B, S, nh, nkv, hd, scale);
  });
}

}  // namespace peftplan::executor::cuda
