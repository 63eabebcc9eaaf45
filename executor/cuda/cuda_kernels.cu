// The CUDA backend's kernels (cuda_backend.cpp holds the Backend itself and the cuBLAS
// calls): the row- and element-wise ops of kernels.h on the GPU, each behind a launcher that
// enqueues it on a stream and returns the launch's error. One thread block per row where a row
// reduces (RMSNorm, softmax, cross-entropy), a grid-stride loop elsewhere; fp32 arithmetic in the
// same order of operations as the CPU kernels where the CPU has one (kernels.cpp, optim.cpp).
// This file includes no header of ours beyond cuda_kernels.h and kernels.h's plain declarations
// (nvcc compiles it; fmt and the C++20 headers stay with the host compiler).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda_kernels.h"
#include "peftplan/executor/kernels.h"  // plain declarations: cpu::kIgnoreIndex

namespace peftplan::executor::cuda {
namespace {

constexpr int kThreads = 256;
using cpu::kIgnoreIndex;  // torch.nn.CrossEntropyLoss's default

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

__global__ void k_dropout(const float* x, float* out, Index n, std::uint64_t mixed, double p, float s) {
  for (Index i = blockIdx.x * Index(blockDim.x) + threadIdx.x; i < n; i += Index(gridDim.x) * blockDim.x)
    out[i] = keep(mixed, p, i) ? x[i] * s : 0.0f;
}
// dx[i] += keep ? g[i]·s : 0 (the LoRA input gradient through the dropout mask).
__global__ void k_dropout_backward_add(const float* g, float* dx, Index n, std::uint64_t mixed, double p, float s) {
  for (Index i = blockIdx.x * Index(blockDim.x) + threadIdx.x; i < n; i += Index(gridDim.x) * blockDim.x)
    if (keep(mixed, p, i)) dx[i] += g[i] * s;
}

__global__ void k_add_bias(float* y, const float* bias, Index M, Index N) {
  const Index n = M * N;
  for (Index i = blockIdx.x * Index(blockDim.x) + threadIdx.x; i < n; i += Index(gridDim.x) * blockDim.x)
    y[i] += bias[i % N];
}

// LlamaRMSNorm (transformers modeling_llama.py): y = w ⊙ x·rsqrt(mean(x²) + eps); one block a row.
__global__ void k_rmsnorm_forward(const float* x, const float* w, float eps, float* y, float* rstd, Index H) {
  __shared__ float sh[32];
  const Index m = blockIdx.x;
  const float* xr = x + m * H;
  float s = 0.0f;
  for (Index j = threadIdx.x; j < H; j += blockDim.x) s += xr[j] * xr[j];
  s = block_sum(s, sh);
  const float rs = 1.0f / sqrtf(s / static_cast<float>(H) + eps);
  if (threadIdx.x == 0) rstd[m] = rs;
  for (Index j = threadIdx.x; j < H; j += blockDim.x) y[m * H + j] = xr[j] * rs * w[j];
}
// dx = rstd·(g⊙w − x·rstd·c), c = Σ(g⊙w⊙x)·rstd / H (kernels.h §3).
__global__ void k_rmsnorm_backward(const float* dy, const float* x, const float* w, const float* rstd, float* dx,
                                   Index H, bool accumulate) {
  __shared__ float sh[32];
  const Index m = blockIdx.x;
  const float rs = rstd[m];
  const float* g = dy + m * H;
  const float* xr = x + m * H;
  float s = 0.0f;
  for (Index j = threadIdx.x; j < H; j += blockDim.x) s += g[j] * w[j] * xr[j];
  const float c = block_sum(s, sh) * rs / static_cast<float>(H);
  for (Index j = threadIdx.x; j < H; j += blockDim.x) {
    const float v = rs * (g[j] * w[j] - xr[j] * (rs * c));
    dx[m * H + j] = accumulate ? dx[m * H + j] + v : v;
  }
}

// RoPE, rotate_half convention (kernels.h §4): sign +1 forward, −1 its transpose (backward).
__global__ void k_rope(float* x, const float* cos, const float* sin, Index B, Index S, Index nheads, Index d, float sign) {
  const Index half = d / 2, n = B * S * nheads * half;
  for (Index t = blockIdx.x * Index(blockDim.x) + threadIdx.x; t < n; t += Index(gridDim.x) * blockDim.x) {
    const Index i = t % half, row = t / half;  // row = (b·S + s)·nheads + h
    const Index s = (row / nheads) % S;
    float* v = x + row * d;
    const float c = cos[s * half + i], si = sign * sin[s * half + i];
    const float x1 = v[i], x2 = v[i + half];
    v[i] = x1 * c - x2 * si;
    v[i + half] = x2 * c + x1 * si;
  }
}

// Causal softmax of one score row (one block a row of P[B·nh·S, S]): the scale is already in the
// scores (the GEMM's alpha); masked columns j > i get probability 0, as kernels.h §5 saves P.
__global__ void k_causal_softmax(float* P, Index S) {
  __shared__ float sh[32];
  const Index row = blockIdx.x, i = row % S;
  float* r = P + row * S;
  float mx = -INFINITY;
  for (Index j = threadIdx.x; j <= i; j += blockDim.x) mx = fmaxf(mx, r[j]);
  mx = block_max(mx, sh);
  float s = 0.0f;
  for (Index j = threadIdx.x; j <= i; j += blockDim.x) {
    const float e = expf(r[j] - mx);
    r[j] = e;
    s += e;
  }
  const float inv = 1.0f / block_sum(s, sh);
  for (Index j = threadIdx.x; j < S; j += blockDim.x) r[j] = j <= i ? r[j] * inv : 0.0f;
}
// Softmax backward in place on dP (rows of `heads` consecutive heads): dS = P⊙(dP − Σ P⊙dP)·scale.
__global__ void k_softmax_backward(const float* P, float* dP, Index S, float scale) {
  __shared__ float sh[32];
  const Index row = blockIdx.x, i = row % S;
  const float* p = P + row * S;
  float* g = dP + row * S;
  float dot = 0.0f;
  for (Index j = threadIdx.x; j <= i; j += blockDim.x) dot += p[j] * g[j];
  dot = block_sum(dot, sh);
  for (Index j = threadIdx.x; j < S; j += blockDim.x) g[j] = j <= i ? p[j] * (g[j] - dot) * scale : 0.0f;
}

__global__ void k_swiglu_forward(const float* g, const float* u, float* a, Index n) {
  for (Index i = blockIdx.x * Index(blockDim.x) + threadIdx.x; i < n; i += Index(gridDim.x) * blockDim.x)
    a[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}
__global__ void k_swiglu_backward(const float* da, const float* g, const float* u, float* dg, float* du, Index n) {
  for (Index i = blockIdx.x * Index(blockDim.x) + threadIdx.x; i < n; i += Index(gridDim.x) * blockDim.x) {
    const float sig = 1.0f / (1.0f + expf(-g[i]));
    const float d = da[i];
    dg[i] = d * u[i] * sig * (1.0f + g[i] * (1.0f - sig));
    du[i] = d * g[i] * sig;
  }
}

__global__ void k_embedding(const std::int32_t* tokens, const float* table, float* out, Index M, Index H) {
  const Index n = M * H;
  for (Index t = blockIdx.x * Index(blockDim.x) + threadIdx.x; t < n; t += Index(gridDim.x) * blockDim.x)
    out[t] = table[static_cast<Index>(tokens[t / H]) * H + t % H];
}

// Cross-entropy over one row of logits (one block a row): logsumexp − logit[target], as ATen's
// log_softmax (max-shifted). Rows whose target is ignore_index add nothing (backward: zeros).
__global__ void k_cross_entropy(const float* logits, const std::int32_t* targets, float* dlogits, double inv_count,
                                Index V, double* loss_sum, bool backward) {
  __shared__ float sh[32];
  const Index m = blockIdx.x;
  const std::int32_t t = targets[m];
  const float* row = logits + m * V;
  if (t == kIgnoreIndex) {
    if (backward)
      for (Index j = threadIdx.x; j < V; j += blockDim.x) dlogits[m * V + j] = 0.0f;
    return;
  }
  float mx = -INFINITY;
  for (Index j = threadIdx.x; j < V; j += blockDim.x) mx = fmaxf(mx, row[j]);
  mx = block_max(mx, sh);
  float s = 0.0f;
  for (Index j = threadIdx.x; j < V; j += blockDim.x) s += expf(row[j] - mx);
  const float log_sum = logf(block_sum(s, sh));
  const float target_logit = row[t];
  if (threadIdx.x == 0) atomicAdd(loss_sum, static_cast<double>(log_sum - (target_logit - mx)));
  if (!backward) return;
  __syncthreads();  // every thread has read row[t] before the row is overwritten in place
  const float inv = static_cast<float>(inv_count);
  for (Index j = threadIdx.x; j < V; j += blockDim.x) {
    float v = expf((row[j] - mx) - log_sum) * inv;
    if (j == t) v -= inv;
    dlogits[m * V + j] = v;
  }
}

__global__ void k_add(const float* a, const float* b, float* out, Index n) {
  for (Index i = blockIdx.x * Index(blockDim.x) + threadIdx.x; i < n; i += Index(gridDim.x) * blockDim.x)
    out[i] = a[i] + b[i];
}
__global__ void k_scale(float* x, float s, Index n) {
  for (Index i = blockIdx.x * Index(blockDim.x) + threadIdx.x; i < n; i += Index(gridDim.x) * blockDim.x) x[i] *= s;
}
// Σ x² in fp64: block partial sums, one atomicAdd per block into *out (zeroed first).
__global__ void k_sum_squares(const float* x, Index n, double* out) {
  __shared__ double sh[32];
  double s = 0.0;
  for (Index i = blockIdx.x * Index(blockDim.x) + threadIdx.x; i < n; i += Index(gridDim.x) * blockDim.x) {
    const double v = x[i];
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


}  // namespace

// mixed = splitmix64(key seed), computed on the host by the caller (cuda_backend.cpp).
cudaError_t dropout(cudaStream_t s, const float* x, float* out, Index n, std::uint64_t mixed, double p) {
  k_dropout<<<blocks_for(n), kThreads, 0, s>>>(x, out, n, mixed, p, static_cast<float>(1.0 / (1.0 - p)));
  return cudaGetLastError();
}
cudaError_t dropout_backward_add(cudaStream_t s, const float* g, float* dx, Index n, std::uint64_t mixed, double p) {
  k_dropout_backward_add<<<blocks_for(n), kThreads, 0, s>>>(g, dx, n, mixed, p, static_cast<float>(1.0 / (1.0 - p)));
  return cudaGetLastError();
}
cudaError_t add_bias(cudaStream_t s, float* y, const float* bias, Index M, Index N) {
  k_add_bias<<<blocks_for(M * N), kThreads, 0, s>>>(y, bias, M, N);
  return cudaGetLastError();
}
cudaError_t rmsnorm_forward(cudaStream_t s, const float* x, const float* w, float eps, float* y, float* rstd, Index M, Index H) {
  if (M == 0) return cudaSuccess;
  k_rmsnorm_forward<<<static_cast<unsigned>(M), row_threads(H), 0, s>>>(x, w, eps, y, rstd, H);
  return cudaGetLastError();
}
cudaError_t rmsnorm_backward(cudaStream_t s, const float* dy, const float* x, const float* w, const float* rstd, float* dx,
                             Index M, Index H, bool accumulate) {
  if (M == 0) return cudaSuccess;
  k_rmsnorm_backward<<<static_cast<unsigned>(M), row_threads(H), 0, s>>>(dy, x, w, rstd, dx, H, accumulate);
  return cudaGetLastError();
}
cudaError_t rope(cudaStream_t s, float* x, const float* cos, const float* sin, Index B, Index S, Index nheads, Index d,
                 float sign) {
  k_rope<<<blocks_for(B * S * nheads * (d / 2)), kThreads, 0, s>>>(x, cos, sin, B, S, nheads, d, sign);
  return cudaGetLastError();
}
cudaError_t causal_softmax(cudaStream_t s, float* P, Index rows, Index S) {
  if (rows == 0) return cudaSuccess;
  k_causal_softmax<<<static_cast<unsigned>(rows), row_threads(S), 0, s>>>(P, S);
  return cudaGetLastError();
}
cudaError_t softmax_backward(cudaStream_t s, const float* P, float* dP, Index rows, Index S, float scale) {
  if (rows == 0) return cudaSuccess;
  k_softmax_backward<<<static_cast<unsigned>(rows), row_threads(S), 0, s>>>(P, dP, S, scale);
  return cudaGetLastError();
}
cudaError_t swiglu_forward(cudaStream_t s, const float* g, const float* u, float* a, Index n) {
  k_swiglu_forward<<<blocks_for(n), kThreads, 0, s>>>(g, u, a, n);
  return cudaGetLastError();
}
cudaError_t swiglu_backward(cudaStream_t s, const float* da, const float* g, const float* u, float* dg, float* du, Index n) {
  k_swiglu_backward<<<blocks_for(n), kThreads, 0, s>>>(da, g, u, dg, du, n);
  return cudaGetLastError();
}
cudaError_t embedding(cudaStream_t s, const std::int32_t* tokens, const float* table, float* out, Index M, Index H) {
  k_embedding<<<blocks_for(M * H), kThreads, 0, s>>>(tokens, table, out, M, H);
  return cudaGetLastError();
}
cudaError_t cross_entropy(cudaStream_t s, const float* logits, const std::int32_t* targets, float* dlogits,
                          double inv_count, Index M, Index V, double* loss_sum) {
  if (M == 0) return cudaSuccess;
  k_cross_entropy<<<static_cast<unsigned>(M), row_threads(V), 0, s>>>(logits, targets, dlogits, inv_count, V, loss_sum,
                                                                     dlogits != nullptr);
  return cudaGetLastError();
}
cudaError_t add(cudaStream_t s, const float* a, const float* b, float* out, Index n) {
  k_add<<<blocks_for(n), kThreads, 0, s>>>(a, b, out, n);
  return cudaGetLastError();
}
cudaError_t scale(cudaStream_t s, float* x, float f, Index n) {
  k_scale<<<blocks_for(n), kThreads, 0, s>>>(x, f, n);
  return cudaGetLastError();
}
cudaError_t sum_squares(cudaStream_t s, const float* x, Index n, double* out) {
  if (const cudaError_t e = cudaMemsetAsync(out, 0, sizeof(double), s); e != cudaSuccess) return e;
  if (n == 0) return cudaSuccess;
  k_sum_squares<<<blocks_for(n), kThreads, 0, s>>>(x, n, out);
  return cudaGetLastError();
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

}  // namespace peftplan::executor::cuda
