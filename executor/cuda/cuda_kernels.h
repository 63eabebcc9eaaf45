// Launchers of the CUDA backend's kernels (cuda_kernels.cu), called by cuda_backend.cpp: each
// enqueues one kernel on `stream` and returns the launch's error (a fault inside a kernel shows
// at the next synchronize). Shapes and semantics are kernels.h's and backend.h's; this header is
// kept free of our other headers so that nvcc compiles the kernels without them.
//
// Storage: a launcher's `void*` / `const void*` operands hold elements of its `Storage` (fp32 or
// bf16; the kernels widen them to fp32, compute in fp32 and round each store to nearest even),
// its `float*` operands fp32 whatever the storage (RMSNorm's rstd, RoPE's tables, flash
// attention's lse, AdamW's tensors). fp16 is a storage convert() reads and writes but no kernel
// computes on: a launcher given it returns cudaErrorInvalidValue and enqueues nothing.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace peftplan::executor::cuda {

using Index = std::int64_t;

enum class Storage : std::uint8_t { fp32, bf16, fp16 };

// AdamW's per-step scalars in fp32, as optim.h adamw_scalars forms them.
struct AdamWScalars {
  float decay, lerp_w, beta2, one_m_beta2, neg_step_size, bc2_sqrt, eps;
  bool decoupled;
};

cudaError_t dropout(cudaStream_t s, Storage st, const void* x, void* out, Index n, std::uint64_t mixed, double p);
// dx[i] += keep ? g[i]·s : 0 (g and dx of `st`).
cudaError_t dropout_backward_add(cudaStream_t s, Storage st, const void* g, void* dx, Index n, std::uint64_t mixed,
                                 double p);
// y[M,N] += bias[N] on every row.
cudaError_t add_bias(cudaStream_t s, Storage st, void* y, const void* bias, Index M, Index N);
// y[M,N] = bias[N] on every row (a GEMM with beta 1 then adds its product in fp32).
cudaError_t broadcast_bias(cudaStream_t s, Storage st, void* y, const void* bias, Index M, Index N);
cudaError_t rmsnorm_forward(cudaStream_t s, Storage st, const void* x, const void* w, float eps, void* y, float* rstd,
                            Index M, Index H);
cudaError_t rmsnorm_backward(cudaStream_t s, Storage st, const void* dy, const void* x, const void* w, const float* rstd,
                             void* dx, Index M, Index H, bool accumulate);
cudaError_t rope(cudaStream_t s, Storage st, void* x, const float* cos, const float* sin, Index B, Index S,
                 Index nheads, Index d, float sign);
// Causal softmax in place over `rows` score rows of length S (row r is query position r % S).
cudaError_t causal_softmax(cudaStream_t s, Storage st, void* P, Index rows, Index S);
// dP (in place) = P ⊙ (dP − Σ P⊙dP) · scale over `rows` rows, zero above the diagonal.
cudaError_t softmax_backward(cudaStream_t s, Storage st, const void* P, void* dP, Index rows, Index S, float scale);
cudaError_t swiglu_forward(cudaStream_t s, Storage st, const void* g, const void* u, void* a, Index n);
cudaError_t swiglu_backward(cudaStream_t s, Storage st, const void* da, const void* g, const void* u, void* dg,
                            void* du, Index n);
cudaError_t embedding(cudaStream_t s, Storage st, const std::int32_t* tokens, const void* table, void* out, Index M,
                      Index H);
// *loss_sum (fp64) += Σ rows' loss; with dlogits non-null also the gradient (dlogits may alias
// logits).
cudaError_t cross_entropy(cudaStream_t s, Storage st, const void* logits, const std::int32_t* targets, void* dlogits,
                          double inv_count, Index M, Index V, double* loss_sum);
cudaError_t add(cudaStream_t s, Storage st, const void* a, const void* b, void* out, Index n);
cudaError_t scale(cudaStream_t s, Storage st, void* x, float f, Index n);
// *out = Σ x² in fp64.
cudaError_t sum_squares(cudaStream_t s, Storage st, const void* x, Index n, double* out);
// fp32 only: the optimizer steps fp32 masters.
cudaError_t adamw(cudaStream_t s, float* param, const float* grad, float* m, float* v, Index n, const AdamWScalars& c);
cudaError_t convert(cudaStream_t s, const void* src, Storage from, void* dst, Storage to, Index n);

// Flash attention (kernels.h §5b; Dao, FlashAttention-2, 2023, Algorithms 1 and 2): causal GQA in
// on-chip fp32 tiles (q, k, v, out and the gradients stored in `st`, widened as a tile loads),
// no scratch. Head dims up to kFlashMaxHeadDim (the largest tile the kernels hold in shared
// memory), sequences shorter than kFlashMaxSeqLen (positions are ints inside the kernels),
// nkv > 0 and nh % nkv == 0; a shape outside these is cudaErrorInvalidValue.
inline constexpr Index kFlashMaxHeadDim = 256;
inline constexpr Index kFlashMaxSeqLen = Index(1) << 30;
// Why the flash kernels refuse a shape, in words, or null when they take it (the one rule the
// launchers and the backend's error message share).
const char* flash_shape_refusal(Index B, Index S, Index nh, Index nkv, Index d);
// q[B,S,nh,d], k[B,S,nkv,d], v[B,S,nkv,d] -> out[B,S,nh,d], lse[B,nh,S] (fp32; log Σ_{j<=i} e^{score_ij}).
cudaError_t flash_attention_forward(cudaStream_t s, Storage st, const void* q, const void* k, const void* v,
                                    float* lse, void* out, Index B, Index S, Index nh, Index nkv, Index d);
// dout[B,S,nh,d] (with the forward's out[B,S,nh,d] and lse[B,nh,S]) -> dq[B,S,nh,d], dk[B,S,nkv,d],
// dv[B,S,nkv,d], all overwritten; two kernels, no atomics (deterministic).
cudaError_t flash_attention_backward(cudaStream_t s, Storage st, const void* dout, const void* q, const void* k,
                                     const void* v, const void* out, const float* lse, void* dq, void* dk, void* dv,
                                     Index B, Index S, Index nh, Index nkv, Index d);

}  // namespace peftplan::executor::cuda
