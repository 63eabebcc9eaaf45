// CPU compute kernels of the executor: forward and backward of every op in a Llama+LoRA decoder
// step, with Hugging Face / PyTorch / PEFT semantics, plus the dtype conversions they need.
//
// Conventions (every kernel):
//   - Tensors are row-major and contiguous; shapes are given in the comment on each declaration
//     using the project's dimension names: B micro-batch, S sequence, H hidden, nh query heads,
//     nkv key/value heads, d head_dim, I intermediate, V vocab, r LoRA rank, M = B*S token rows,
//     K in-features, N out-features.
//   - Kernels take raw pointers and explicit sizes and write into caller-provided outputs and
//     caller-provided scratch; they never allocate (the caller's tracked allocator sees every
//     byte). A kernel that needs scratch has a `*_scratch_elems(...)` function giving its exact
//     size in elements of T. The one exception is inside Eigen's GEMM, which packs panels into
//     its own cache-sized buffers (see gemm_packing_bytes_bound()).
//   - Templates on the scalar type T are instantiated for float (production: fp32 compute) and
//     double (tests: a double reference and finite differences).
//   - Outputs named "d*" are gradients. `Accum::add` adds into the output (gradient accumulation,
//     several contributions to one gradient); `Accum::overwrite` replaces it.
//
// Deliberately not here: memory management, the model's layer wiring, the Backend interface,
// GPU code, collectives. Those live above these functions.
#pragma once

#include <cstdint>

namespace peftplan::executor::cpu {

using Index = std::int64_t;

// Whether a kernel adds into its output or replaces it.
enum class Accum : bool { overwrite = false, add = true };

// ---------------------------------------------------------------------------------------------
// dtype conversion (IEEE-754 binary16 and bfloat16 stored as raw uint16 bit patterns)
// ---------------------------------------------------------------------------------------------

// fp32 -> bf16 with round-to-nearest-even; NaN stays NaN (quiet bit set), ±inf stays ±inf, and
// values that round past the largest finite bf16 become ±inf (as PyTorch's c10::BFloat16 does).
std::uint16_t fp32_to_bf16(float x);
// bf16 -> fp32 is exact (bf16 is the top half of an fp32).
float bf16_to_fp32(std::uint16_t bits);
// IEEE binary16 <-> fp32; fp32 -> fp16 rounds to nearest even, handles subnormals, inf and NaN.
std::uint16_t fp32_to_fp16(float x);
float fp16_to_fp32(std::uint16_t bits);

// Array forms (OpenMP-parallel for large n): src[n] -> dst[n].
void bf16_to_fp32(const std::uint16_t* src, float* dst, Index n);
void fp32_to_bf16(const float* src, std::uint16_t* dst, Index n);
void fp16_to_fp32(const std::uint16_t* src, float* dst, Index n);
void fp32_to_fp16(const float* src, std::uint16_t* dst, Index n);

// Bytes Eigen's GEMM allocates internally for its packed panels when multiplying [M,K]·[K,N]
// on `threads` threads: threads · kc·(mc + nc) fp32 scalars, from Eigen's own cache blocking
// (computeProductBlockingSizes). An estimate the allocator books as `workspace`; panels under
// 128 KiB live on the stack instead.
std::uint64_t gemm_packing_bytes(Index M, Index N, Index K, int threads);

// ---------------------------------------------------------------------------------------------
// 1. Linear (torch.nn.Linear: weight [N,K], y = x W^T + b)
// ---------------------------------------------------------------------------------------------

// y[M,N] (=|+=) x[M,K] · W[N,K]^T (+ bias[N] when bias != nullptr, in either mode).
template <typename T>
void linear_forward(const T* x, const T* W, const T* bias, T* y, Index M, Index K, Index N,
                    Accum mode = Accum::overwrite);
// dx[M,K] (=|+=) dy[M,N] · W[N,K].
template <typename T>
void linear_backward_input(const T* dy, const T* W, T* dx, Index M, Index K, Index N, Accum mode);
// dW[N,K] (=|+=) dy[M,N]^T · x[M,K]; db[N] (=|+=) column sums of dy when db != nullptr.
// Call only for trainable weights (full fine-tuning); LoRA leaves the base weight frozen.
template <typename T>
void linear_backward_weight(const T* dy, const T* x, T* dW, T* db, Index M, Index K, Index N,
                            Accum mode);

// ---------------------------------------------------------------------------------------------
// 2. LoRA branch (PEFT peft/tuners/lora/layer.py, Linear.forward):
//    result += lora_B(lora_A(dropout(x))) * scaling
//    A [r,K] (lora_A.weight), B [N,r] (lora_B.weight), scaling = alpha/r (or alpha/sqrt(r), rsLoRA).
// ---------------------------------------------------------------------------------------------

// PEFT's scaling factor: lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora.
double lora_scaling(double lora_alpha, Index r, bool use_rslora);

// Dropout keep-mask for n elements: mask[i] = 1 (keep) with probability 1-p, else 0. Counter-based
// (SplitMix64 of seed and offset+i), so the same (seed, offset) reproduces the same mask on
// recompute and on any rank or thread count. p in [0, 1).
void dropout_mask(std::uint64_t seed, std::uint64_t offset, double p, std::uint8_t* mask, Index n);

// Scratch for lora_forward: M*K when dropout is active (keep_mask != nullptr), else 0.
Index lora_forward_scratch_elems(Index M, Index K, bool dropout);
// y[M,N] += scaling · (drop(x)[M,K] · A[r,K]^T) · B[N,r]^T, and saves u[M,r] = drop(x) · A^T.
// drop(x) = x ⊙ keep_mask / (1-p) (inverted dropout, torch.nn.Dropout in training mode); pass
// keep_mask = nullptr for p = 0 (PEFT uses nn.Identity then). scratch: lora_forward_scratch_elems.
template <typename T>
void lora_forward(const T* x, const T* A, const T* B, T scaling, const std::uint8_t* keep_mask,
                  T dropout_p, T* u, T* y, T* scratch, Index M, Index K, Index N, Index r);

// Scratch for lora_backward: M*r, plus M*K when dropout is active.
Index lora_backward_scratch_elems(Index M, Index K, Index r, bool dropout);
// Given dy[M,N], the saved u[M,r] and the forward's x, keep_mask, p:
//   dB[N,r] (=|+=) scaling · dy^T · u
//   dA[r,K] (=|+=) (scaling · dy · B)^T · drop(x)
//   dx[M,K] (=|+=) drop'( (scaling · dy · B) · A )   (mask and 1/(1-p) applied again)
// grad_mode applies to dA and dB; dx_mode to dx (usually Accum::add over the base linear's dx).
// dx may be nullptr when the input gradient is not needed (first layer of a frozen model).
template <typename T>
void lora_backward(const T* dy, const T* x, const T* A, const T* B, const T* u, T scaling,
                   const std::uint8_t* keep_mask, T dropout_p, T* dA, T* dB, T* dx, T* scratch,
                   Index M, Index K, Index N, Index r, Accum grad_mode, Accum dx_mode);

// ---------------------------------------------------------------------------------------------
// 3. RMSNorm (transformers LlamaRMSNorm): y = w ⊙ x · rsqrt(mean(x²) + eps), per row of H.
// ---------------------------------------------------------------------------------------------

// x[M,H], w[H] -> y[M,H]; saves rstd[M] = rsqrt(mean(x²) + eps).
template <typename T>
void rmsnorm_forward(const T* x, const T* w, T eps, T* y, T* rstd, Index M, Index H);
// With x̂ = x·rstd and g = dy ⊙ w:  dx = rstd · (g − x̂ · mean(g ⊙ x̂))   (=|+= per dx_mode)
//                                    dw = Σ_rows dy ⊙ x̂                (=|+= per dw_mode; skipped if dw == nullptr)
template <typename T>
void rmsnorm_backward(const T* dy, const T* x, const T* w, const T* rstd, T* dx, T* dw, Index M,
                      Index H, Accum dx_mode, Accum dw_mode);

// ---------------------------------------------------------------------------------------------
// 4. RoPE (transformers modeling_llama.py, rotate_half convention; pairs (i, i + d/2))
//    x' = x·cos + rotate_half(x)·sin, rotate_half(x) = cat(−x[d/2:], x[:d/2]).
// ---------------------------------------------------------------------------------------------

// Elements of each table: S * d/2.
Index rope_table_elems(Index S, Index d);
// cos[S, d/2], sin[S, d/2] for positions 0..S-1: inv_freq_i = 1/theta^(2i/d), angle = pos·inv_freq_i,
// computed in T the way HF computes them in fp32 (LlamaRotaryEmbedding, default rope type).
template <typename T>
void rope_tables(T* cos, T* sin, Index S, Index d, double theta);
// In place on x[B,S,nheads,d] (q with nheads = nh, k with nheads = nkv).
template <typename T>
void rope_forward(T* x, const T* cos, const T* sin, Index B, Index S, Index nheads, Index d);
// In place on the gradient dx[B,S,nheads,d]: the transpose of the rotation, i.e. a rotation by
// −angle: dx = g·cos − rotate_half(g·sin).
template <typename T>
void rope_backward(T* dx, const T* cos, const T* sin, Index B, Index S, Index nheads, Index d);

// ---------------------------------------------------------------------------------------------
// 5. Eager grouped-query causal attention (transformers eager_attention_forward + repeat_kv):
//    query head h uses kv head h / (nh/nkv); scores = q k^T / sqrt(d) + causal mask; softmax in
//    fp32 (T); out = P v.
// ---------------------------------------------------------------------------------------------

// q[B,S,nh,d], k[B,S,nkv,d], v[B,S,nkv,d] -> out[B,S,nh,d]; saves P[B,nh,S,S] (masked entries 0).
template <typename T>
void attention_forward(const T* q, const T* k, const T* v, T* P, T* out, Index B, Index S,
                       Index nh, Index nkv, Index d);
// Scratch for attention_backward: one S×S block per worker; `workers` (>= 1) bounds parallelism
// over (batch, kv head) pairs. Pass the same value the scratch was sized with to the kernel
// through scratch_elems (it uses scratch_elems / (S*S) workers).
Index attention_backward_scratch_elems(Index S, Index workers);
// dout[B,S,nh,d] -> dq[B,S,nh,d] (overwritten), dk, dv [B,S,nkv,d] (overwritten; the nh/nkv
// query heads sharing a kv head are summed).
template <typename T>
void attention_backward(const T* dout, const T* q, const T* k, const T* v, const T* P, T* dq,
                        T* dk, T* dv, T* scratch, Index scratch_elems, Index B, Index S, Index nh,
                        Index nkv, Index d);

// ---------------------------------------------------------------------------------------------
// 5b. Flash attention (Dao, "FlashAttention-2: Faster Attention with Better Parallelism and Work
//     Partitioning", 2023, Algorithms 1 and 2): the same causal GQA attention computed in tiles
//     of queries against tiles of keys with an online softmax, so the S×S probabilities are never
//     stored (the CPU: kExecAttentionRows queries against up to 4 × as many keys; CUDA: its own
//     tiles, cuda_kernels.cu). Saved for backward: lse[B,nh,S] = m + log l per row (m the
//     row's largest scaled score, l Σ exp(score − m)); the backward recomputes each tile's
//     probabilities as exp(score − lse) and takes D = Σ dout ⊙ out per row from the forward's out.
//     Keys past a query tile's last row are skipped, so on the CPU the work done is eager
//     attention's causal blocks (planner Builder::score_work_fraction).
// ---------------------------------------------------------------------------------------------

// q[B,S,nh,d], k[B,S,nkv,d], v[B,S,nkv,d] -> out[B,S,nh,d], lse[B,nh,S].
template <typename T>
void flash_attention_forward(const T* q, const T* k, const T* v, T* lse, T* out, Index B,
                             Index S, Index nh, Index nkv, Index d);
// dout[B,S,nh,d] -> dq[B,S,nh,d], dk, dv[B,S,nkv,d] (all overwritten), from the forward's out
// and lse.
template <typename T>
void flash_attention_backward(const T* dout, const T* q, const T* k, const T* v, const T* out,
                              const T* lse, T* dq, T* dk, T* dv, Index B, Index S, Index nh,
                              Index nkv, Index d);

// ---------------------------------------------------------------------------------------------
// 6. SwiGLU (LlamaMLP: down(silu(gate(x)) * up(x))): a = silu(g) ⊙ u, silu(z) = z·σ(z).
// ---------------------------------------------------------------------------------------------

// g[n], u[n] -> a[n] (n = M*I).
template <typename T>
void swiglu_forward(const T* g, const T* u, T* a, Index n);
// dg = da ⊙ u ⊙ σ(g)(1 + g(1 − σ(g))), du = da ⊙ silu(g). Overwrites dg, du.
template <typename T>
void swiglu_backward(const T* da, const T* g, const T* u, T* dg, T* du, Index n);

// ---------------------------------------------------------------------------------------------
// 7. Embedding (torch.nn.Embedding)
// ---------------------------------------------------------------------------------------------

// out[M,H] = table[tokens[m], :]; table [V,H]. Token ids outside [0, V) are an InternalError
// (the data loader validates ids against the vocabulary at the edge).
template <typename T>
void embedding_forward(const std::int32_t* tokens, const T* table, T* out, Index M, Index V,
                       Index H);
// dtable[V,H] (=|+=) scatter-add of dout[M,H] rows at tokens[m]. Deterministic (no atomics).
template <typename T>
void embedding_backward(const std::int32_t* tokens, const T* dout, T* dtable, Index M, Index V,
                        Index H, Accum mode);

// ---------------------------------------------------------------------------------------------
// 8. Cross-entropy (transformers ForCausalLMLoss with reduction "sum" / num_items_in_batch)
// ---------------------------------------------------------------------------------------------

// The label that contributes nothing (torch.nn.CrossEntropyLoss ignore_index default).
inline constexpr std::int32_t kIgnoreIndex = -100;

// Sum over rows with targets[m] != kIgnoreIndex of logsumexp(logits[m,:]) − logits[m, targets[m]]
// (already-shifted targets: targets[m] is the token row m predicts). logits [M,V]. The caller
// divides by the token count of the whole (global) batch, so averages across micro-batches and
// ranks come out exactly.
template <typename T>
double cross_entropy_forward(const T* logits, const std::int32_t* targets, Index M, Index V);
// dlogits[M,V] = (softmax(logits) − onehot(target)) / count for counted rows, 0 for ignored
// rows. dlogits may alias logits (in place). Returns the same loss sum as the forward, computed
// on the way, so a fused forward+backward needs one pass.
template <typename T>
double cross_entropy_backward(const T* logits, const std::int32_t* targets, T* dlogits,
                              double count, Index M, Index V);

// ---------------------------------------------------------------------------------------------
// 9. Elementwise helpers and reductions
// ---------------------------------------------------------------------------------------------

// out[n] = a[n] + b[n] (out may alias a or b).
template <typename T>
void add(const T* a, const T* b, T* out, Index n);
// y[n] += x[n].
template <typename T>
void add_inplace(T* y, const T* x, Index n);
// x[n] *= s (gradient clipping, loss scaling).
template <typename T>
void scale_inplace(T* x, T s, Index n);
// Σ x² accumulated in double (for global gradient norms).
template <typename T>
double sum_squares(const T* x, Index n);

}  // namespace peftplan::executor::cpu
