// The kernels' operand contract: for every Kernel, what each operand slot of a compute op holds,
// the op's shape and its scalars, named, in one place. The builder emits compute ops through
// these structs (ops::emit), interpreters read them back through them (ops::read), and
// sim::verify checks an executable program's operands against the shapes (ops::check_sizes).
// ggml's op constructors and op_params are the model: the storage stays generic (a run of
// 64-bit values per op in Program::operands: ids, then dims, scalars and integer parameters), so
// that passes which only ask "which buffers does this op touch" (liveness, the caching-allocator
// replay) visit every kernel alike, and each kernel's meaning of its values is written down
// once, here.
//
// Conventions: buffers are row-major; M token rows, K in-features, N out-features, r LoRA rank,
// H hidden, I intermediate (times experts per token), V vocabulary, B micro-batch, S sequence,
// nh / nkv heads, d head dimension. "Elements" are in the compute dtype unless a slot says
// otherwise; an executable program (Program::executable) stores them in Program::compute_dtype.
// Deliberately not here: costs (sim::ComputeWork), how a kernel computes (executor/backend.h),
// and which kernels a profile emits (planner/program.cpp).
#pragma once

#include <array>
#include <bit>
#include <optional>
#include <span>
#include <vector>
#include <cstdint>
#include <string_view>
#include <type_traits>

#include "peftplan/common/dtype.h"
#include "peftplan/common/error.h"
#include "peftplan/sim/program.h"

namespace peftplan::sim::ops {

using Id = std::int32_t;   // a buffer id, -1 when the slot is empty
using Dim = std::int64_t;

// How the slot's bytes follow from the op's shape, for the size check of an executable program.
enum class Elem : std::uint8_t {
  compute,  // elements in the program's compute dtype (Program::compute_dtype: fp32 or bf16)
  f32,      // fp32 elements whatever the compute dtype (norm statistics, RoPE tables, the
            //   log-sum-exp, the optimizer's master weights, fp32 gradients and moments)
  i32,      // int32 elements (token ids)
  cast_src, // the cast's source dtype (Cast::from)
  cast_dst, // the cast's destination dtype (Cast::to)
  any,      // not determined by the shape (a whole gradient partition, a touched buffer)
};

// A slot as the visitors see it: its name, whether an executable program must fill it, how many
// elements it holds (from the shape; -1: any) and their kind.
struct SlotSpec {
  std::string_view name;
  bool required = true;
  Dim elems = -1;
  Elem elem = Elem::compute;
};

// --- the kernels -----------------------------------------------------------------------------
// Each struct's visit() names its dims, scalars and integer parameters first, then its slots:
// the order of its values in Program::operands.

// embedding_fwd: out[M,H] = table[tokens[0, M)].
struct EmbeddingFwd {
  static constexpr Kernel kernel = Kernel::embedding_fwd;
  Id tokens = -1, table = -1, out = -1;
  Dim M = 0, V = 0, H = 0;
  template <class S, class Vis> static void visit(S& s, Vis& v) {
    v.dim(s.M); v.dim(s.V); v.dim(s.H);
    v.slot(s.tokens, {"tokens", true, 2 * s.M, Elem::i32});  // ids then targets (shifted ids)
    v.slot(s.table, {"table", true, s.V * s.H});
    v.slot(s.out, {"out", true, s.M * s.H});
  }
};
// embedding_bwd: d_table[tokens] += d_out (full fine-tuning only).
struct EmbeddingBwd {
  static constexpr Kernel kernel = Kernel::embedding_bwd;
  Id tokens = -1, d_out = -1, d_table = -1;
  Dim M = 0, V = 0, H = 0;
  template <class S, class Vis> static void visit(S& s, Vis& v) {
    v.dim(s.M); v.dim(s.V); v.dim(s.H);
    v.slot(s.tokens, {"tokens", true, 2 * s.M, Elem::i32});
    v.slot(s.d_out, {"d_out", true, s.M * s.H});
    v.slot(s.d_table, {"d_table", true, -1, Elem::any});
  }
};
// norm_fwd: RMSNorm y = w ⊙ x·rstd, rstd[M] saved (w empty: a norm without weight).
struct NormFwd {
  static constexpr Kernel kernel = Kernel::norm_fwd;
  Id x = -1, w = -1, y = -1, rstd = -1;
  Dim M = 0, H = 0;
  double eps = 0.0;
  template <class S, class Vis> static void visit(S& s, Vis& v) {
    v.dim(s.M); v.dim(s.H);
    v.scalar(s.eps);
    v.slot(s.x, {"x", true, s.M * s.H});
    v.slot(s.w, {"w", true, s.H});
    v.slot(s.y, {"y", true, s.M * s.H});
    v.slot(s.rstd, {"rstd", true, s.M, Elem::f32});
  }
};
// norm_bwd: dx (=|+= with Op::accumulate) the input gradient; the frozen weight gets none.
struct NormBwd {
  static constexpr Kernel kernel = Kernel::norm_bwd;
  Id dy = -1, x = -1, w = -1, rstd = -1, dx = -1;
  Dim M = 0, H = 0;
  template <class S, class Vis> static void visit(S& s, Vis& v) {
    v.dim(s.M); v.dim(s.H);
    v.slot(s.dy, {"dy", true, s.M * s.H});
    v.slot(s.x, {"x", true, s.M * s.H});
    v.slot(s.w, {"w", true, s.H});
    v.slot(s.rstd, {"rstd", true, s.M, Elem::f32});
    v.slot(s.dx, {"dx", true, s.M * s.H});
  }
};
// cast: dst[n] (dtype `to`) = src[n] converted from dtype `from` (a quantised source also holds
// its block constants, so its size is not checked). The executor runs bf16 -> fp32 and a copy
// between equal dtypes.
struct Cast {
  static constexpr Kernel kernel = Kernel::cast;
  Id src = -1, dst = -1;
  Dim n = 0;
  DType from = DType::fp32, to = DType::fp32;
  template <class S, class Vis> static void visit(S& s, Vis& v) {
    v.dim(s.n);
    v.dtype(s.from); v.dtype(s.to);
    v.slot(s.src, {"src", true, s.n, Elem::cast_src});
    v.slot(s.dst, {"dst", true, s.n, Elem::cast_dst});
  }
};
// linear_fwd: y[M,N] (=|+=) x[M,K]·W[N,K]ᵀ (+ bias[N]).
struct LinearFwd {
  static constexpr Kernel kernel = Kernel::linear_fwd;
  Id x = -1, w = -1, y = -1, bias = -1;
  Dim M = 0, K = 0, N = 0;
  template <class S, class Vis> static void visit(S& s, Vis& v) {
    v.dim(s.M); v.dim(s.K); v.dim(s.N);
    v.slot(s.x, {"x", true, s.M * s.K});
    v.slot(s.w, {"w", true, s.N * s.K});
    v.slot(s.y, {"y", true, s.M * s.N});
    v.slot(s.bias, {"bias", false, s.N});
  }
};
// linear_bwd_data: dx[M,K] (=|+=) dy[M,N]·W[N,K].
struct LinearBwdData {
  static constexpr Kernel kernel = Kernel::linear_bwd_data;
  Id dy = -1, w = -1, dx = -1;
  Dim M = 0, K = 0, N = 0;
  template <class S, class Vis> static void visit(S& s, Vis& v) {
    v.dim(s.M); v.dim(s.K); v.dim(s.N);
    v.slot(s.dy, {"dy", true, s.M * s.N});
    v.slot(s.w, {"w", true, s.N * s.K});
    v.slot(s.dx, {"dx", true, s.M * s.K});
  }
};
// linear_bwd_weight: dW[N,K] += dy[M,N]ᵀ·x[M,K] (full fine-tuning only).
struct LinearBwdWeight {
  static constexpr Kernel kernel = Kernel::linear_bwd_weight;
  Id dy = -1, x = -1, dw = -1;
  Dim M = 0, K = 0, N = 0;
  template <class S, class Vis> static void visit(S& s, Vis& v) {
    v.dim(s.M); v.dim(s.K); v.dim(s.N);
    v.slot(s.dy, {"dy", true, s.M * s.N});
    v.slot(s.x, {"x", true, s.M * s.K});
    v.slot(s.dw, {"dw", true, s.N * s.K});
  }
};
// dropout: out[n] = x ⊙ keep / (1 − p). The keep mask is a counter-based hash of the run's seed,
// the step, the micro-batch and `adapter` (the LoRA module's place among the inventory's LoRA
// modules), so that the recompute and the backward regenerate it.
struct Dropout {
  static constexpr Kernel kernel = Kernel::dropout;
  Id x = -1, out = -1;
  Dim n = 0;
  double p = 0.0;
  std::int32_t adapter = -1;
  template <class S, class Vis> static void visit(S& s, Vis& v) {
    v.dim(s.n);
    v.scalar(s.p);
    v.iparam(s.adapter);
    v.slot(s.x, {"x", true, s.n});
    v.slot(s.out, {"out", true, s.n});
  }
};
// lora_fwd: u[M,r] = x_in[M,K]·A[r,K]ᵀ; y[M,N] += scale·u·B[N,r]ᵀ (x_in: the dropped input when
// p > 0). r = 0 is IA3: y scaled in place by a learned vector (cost-only; only y is named).
struct LoraFwd {
  static constexpr Kernel kernel = Kernel::lora_fwd;
  Id x_in = -1, a = -1, b = -1, u = -1, y = -1;
  Dim M = 0, K = 0, N = 0, r = 0;
  double scale = 0.0;
  std::int32_t adapter = -1;
  template <class S, class Vis> static void visit(S& s, Vis& v) {
    v.dim(s.M); v.dim(s.K); v.dim(s.N); v.dim(s.r);
    v.scalar(s.scale);
    v.iparam(s.adapter);
    v.slot(s.x_in, {"x_in", true, s.M * s.K});
    v.slot(s.a, {"A", true, s.r * s.K});
    v.slot(s.b, {"B", true, s.N * s.r});
    v.slot(s.u, {"u", true, s.M * s.r});
    v.slot(s.y, {"y", true, s.M * s.N});
  }
};
// lora_bwd: with s = scale, du = s·dy·B (scratch[0, M·r)), dB += s·dyᵀ·u, dA += duᵀ·x_in,
// dx += drop'(du·A) (dx may be empty). With p > 0 x_in is the saved dropped input and du·A goes
// through scratch[M·r, M·r + M·K) before the mask (of `adapter`, as in Dropout) is applied.
struct LoraBwd {
  static constexpr Kernel kernel = Kernel::lora_bwd;
  Id dy = -1, x_in = -1, a = -1, b = -1, u = -1, scratch = -1, dx = -1, da = -1, db = -1;
  Dim M = 0, K = 0, N = 0, r = 0;
  double scale = 0.0, p = 0.0;
  std::int32_t adapter = -1;
  template <class S, class Vis> static void visit(S& s, Vis& v) {
    v.dim(s.M); v.dim(s.K); v.dim(s.N); v.dim(s.r);
    v.scalar(s.scale); v.scalar(s.p);
    v.iparam(s.adapter);
    v.slot(s.dy, {"dy", true, s.M * s.N});
    v.slot(s.x_in, {"x_in", true, s.M * s.K});
    v.slot(s.a, {"A", true, s.r * s.K});
    v.slot(s.b, {"B", true, s.N * s.r});
    v.slot(s.u, {"u", true, s.M * s.r});
    v.slot(s.scratch, {"scratch", true, s.M * (s.r + (s.p > 0.0 ? s.K : 0))});
    v.slot(s.dx, {"dx", false, s.M * s.K});
    v.slot(s.da, {"dA", true, s.r * s.K});
    v.slot(s.db, {"dB", true, s.N * s.r});
  }
};
// rope_tables: tables = cos[S, d/2] then sin[S, d/2] for positions 0..S-1 at base theta.
struct RopeTables {
  static constexpr Kernel kernel = Kernel::rope_tables;
  Id tables = -1;
  Dim S = 0, d = 0;
  double theta = 0.0;
  template <class Sx, class Vis> static void visit(Sx& s, Vis& v) {
    v.dim(s.S); v.dim(s.d);
    v.scalar(s.theta);
    v.slot(s.tables, {"tables", true, s.S * s.d, Elem::f32});
  }
};
// rope_fwd / rope_bwd: q[B,S,nh,d] and k[B,S,nkv,d] rotated in place (backward: the transposed
// rotation of their gradients).
struct Rope {
  Id q = -1, k = -1, tables = -1;
  Dim B = 0, S = 0, nh = 0, nkv = 0, d = 0;
  template <class Sx, class Vis> static void visit(Sx& s, Vis& v) {
    v.dim(s.B); v.dim(s.S); v.dim(s.nh); v.dim(s.nkv); v.dim(s.d);
    v.slot(s.q, {"q", true, s.B * s.S * s.nh * s.d});
    v.slot(s.k, {"k", true, s.B * s.S * s.nkv * s.d});
    v.slot(s.tables, {"tables", true, s.S * s.d, Elem::f32});
  }
};
struct RopeFwd : Rope { static constexpr Kernel kernel = Kernel::rope_fwd; };
struct RopeBwd : Rope { static constexpr Kernel kernel = Kernel::rope_bwd; };
// attention_fwd: eager causal GQA attention over S_kv = S positions; keeps the probabilities
// P[B,nh,S,S].
struct AttentionFwd {
  static constexpr Kernel kernel = Kernel::attention_fwd;
  Id q = -1, k = -1, v = -1, probs = -1, out = -1;
  Dim B = 0, S = 0, nh = 0, nkv = 0, d = 0;
  template <class Sx, class Vis> static void visit(Sx& s, Vis& v) {
    v.dim(s.B); v.dim(s.S); v.dim(s.nh); v.dim(s.nkv); v.dim(s.d);
    v.slot(s.q, {"q", true, s.B * s.S * s.nh * s.d});
    v.slot(s.k, {"k", true, s.B * s.S * s.nkv * s.d});
    v.slot(s.v, {"v", true, s.B * s.S * s.nkv * s.d});
    v.slot(s.probs, {"P", true, s.B * s.nh * s.S * s.S});
    v.slot(s.out, {"out", true, s.B * s.S * s.nh * s.d});
  }
};
// attention_bwd: dq, dk, dv (overwritten) from d_out and the saved P; the scratch is d_probs
// [B,nh,S,S] (eager only).
struct AttentionBwd {
  static constexpr Kernel kernel = Kernel::attention_bwd;
  Id d_out = -1, probs = -1, q = -1, k = -1, v = -1, dq = -1, dk = -1, dv = -1, scratch = -1;
  Dim B = 0, S = 0, nh = 0, nkv = 0, d = 0;
  template <class Sx, class Vis> static void visit(Sx& s, Vis& v) {
    v.dim(s.B); v.dim(s.S); v.dim(s.nh); v.dim(s.nkv); v.dim(s.d);
    const Dim q = s.B * s.S * s.nh * s.d, kv = s.B * s.S * s.nkv * s.d, pp = s.B * s.nh * s.S * s.S;
    v.slot(s.d_out, {"d_out", true, q});
    v.slot(s.probs, {"P", true, pp});
    v.slot(s.q, {"q", true, q});
    v.slot(s.k, {"k", true, kv});
    v.slot(s.v, {"v", true, kv});
    v.slot(s.dq, {"dq", true, q});
    v.slot(s.dk, {"dk", true, kv});
    v.slot(s.dv, {"dv", true, kv});
    v.slot(s.scratch, {"scratch", true, pp});
  }
};
// flash_attention_fwd: the same attention in tiles (executor kernels.h §5b); keeps the
// log-sum-exp lse[B,nh,S] (fp32) instead of the probabilities.
struct FlashAttentionFwd {
  static constexpr Kernel kernel = Kernel::flash_attention_fwd;
  Id q = -1, k = -1, v = -1, lse = -1, out = -1;
  Dim B = 0, S = 0, nh = 0, nkv = 0, d = 0;
  template <class Sx, class Vis> static void visit(Sx& s, Vis& v) {
    v.dim(s.B); v.dim(s.S); v.dim(s.nh); v.dim(s.nkv); v.dim(s.d);
    v.slot(s.q, {"q", true, s.B * s.S * s.nh * s.d});
    v.slot(s.k, {"k", true, s.B * s.S * s.nkv * s.d});
    v.slot(s.v, {"v", true, s.B * s.S * s.nkv * s.d});
    v.slot(s.lse, {"lse", true, s.B * s.nh * s.S, Elem::f32});
    v.slot(s.out, {"out", true, s.B * s.S * s.nh * s.d});
  }
};
// flash_attention_bwd: dq, dk, dv (overwritten) from d_out, the saved q, k, v, out and lse (the
// probabilities recomputed tile by tile; no scratch).
struct FlashAttentionBwd {
  static constexpr Kernel kernel = Kernel::flash_attention_bwd;
  Id d_out = -1, q = -1, k = -1, v = -1, out = -1, lse = -1, dq = -1, dk = -1, dv = -1;
  Dim B = 0, S = 0, nh = 0, nkv = 0, d = 0;
  template <class Sx, class Vis> static void visit(Sx& s, Vis& v) {
    v.dim(s.B); v.dim(s.S); v.dim(s.nh); v.dim(s.nkv); v.dim(s.d);
    const Dim q = s.B * s.S * s.nh * s.d, kv = s.B * s.S * s.nkv * s.d;
    v.slot(s.d_out, {"d_out", true, q});
    v.slot(s.q, {"q", true, q});
    v.slot(s.k, {"k", true, kv});
    v.slot(s.v, {"v", true, kv});
    v.slot(s.out, {"out", true, q});
    v.slot(s.lse, {"lse", true, s.B * s.nh * s.S, Elem::f32});
    v.slot(s.dq, {"dq", true, q});
    v.slot(s.dk, {"dk", true, kv});
    v.slot(s.dv, {"dv", true, kv});
  }
};
// residual_add: out[n] = a + b (out empty: the sum is not kept, as in a recompute's last add).
struct ResidualAdd {
  static constexpr Kernel kernel = Kernel::residual_add;
  Id a = -1, b = -1, out = -1;
  Dim n = 0;
  template <class S, class Vis> static void visit(S& s, Vis& v) {
    v.dim(s.n);
    v.slot(s.a, {"a", true, s.n});
    v.slot(s.b, {"b", true, s.n});
    v.slot(s.out, {"out", false, s.n});
  }
};
// mlp_act_fwd: act[n] = silu(gate) ⊙ up (SwiGLU; GELU models name only gate).
struct MlpActFwd {
  static constexpr Kernel kernel = Kernel::mlp_act_fwd;
  Id gate = -1, up = -1, act = -1;
  Dim n = 0;
  template <class S, class Vis> static void visit(S& s, Vis& v) {
    v.dim(s.n);
    v.slot(s.gate, {"gate", true, s.n});
    v.slot(s.up, {"up", true, s.n});
    v.slot(s.act, {"act", true, s.n});
  }
};
// mlp_act_bwd: d_gate, d_up (overwritten) from d_act and the saved gate and up.
struct MlpActBwd {
  static constexpr Kernel kernel = Kernel::mlp_act_bwd;
  Id d_act = -1, gate = -1, up = -1, d_gate = -1, d_up = -1;
  Dim n = 0;
  template <class S, class Vis> static void visit(S& s, Vis& v) {
    v.dim(s.n);
    v.slot(s.d_act, {"d_act", true, s.n});
    v.slot(s.gate, {"gate", true, s.n});
    v.slot(s.up, {"up", true, s.n});
    v.slot(s.d_gate, {"d_gate", true, s.n});
    v.slot(s.d_up, {"d_up", true, s.n});
  }
};
// cross_entropy_fwd: the loss summed over the M rows of logits[M,V] (fp32) against the targets
// (tokens[M, 2M)).
struct CrossEntropyFwd {
  static constexpr Kernel kernel = Kernel::cross_entropy_fwd;
  Id logits = -1, tokens = -1;
  Dim M = 0, V = 0;
  template <class S, class Vis> static void visit(S& s, Vis& v) {
    v.dim(s.M); v.dim(s.V);
    v.slot(s.logits, {"logits", true, s.M * s.V, Elem::f32});
    v.slot(s.tokens, {"tokens", true, 2 * s.M, Elem::i32});
  }
};
// cross_entropy_bwd: d_logits = (softmax(logits) − onehot) / divisor, divisor = the target
// tokens of the whole step on all ranks (d_logits may be logits itself).
struct CrossEntropyBwd {
  static constexpr Kernel kernel = Kernel::cross_entropy_bwd;
  Id logits = -1, tokens = -1, d_logits = -1;
  Dim M = 0, V = 0;
  double divisor = 0.0;
  template <class S, class Vis> static void visit(S& s, Vis& v) {
    v.dim(s.M); v.dim(s.V);
    v.scalar(s.divisor);
    v.slot(s.logits, {"logits", true, s.M * s.V, Elem::f32});
    v.slot(s.tokens, {"tokens", true, 2 * s.M, Elem::i32});
    v.slot(s.d_logits, {"d_logits", true, s.M * s.V, Elem::f32});
  }
};
// grad_norm: the sum of squares of this rank's gradient partition (then all-reduced as a
// ScalarReduction::grad_sumsq when the partitions differ).
struct GradNorm {
  static constexpr Kernel kernel = Kernel::grad_norm;
  Id grads = -1;
  template <class S, class Vis> static void visit(S& s, Vis& v) { v.slot(s.grads, {"grads", true, -1, Elem::any}); }
};
// optimizer_step: AdamW over n elements of this rank's partition. states holds m then v, n fp32
// elements each; params is n elements, or N·n (this rank's block of a replicated flat: ZeRO-1/2);
// sqrt_v is torch's foreach temporary (cost-only). Mixed precision (DeepSpeed's
// single_partition_of_fp32_groups, stage_1_and_2.py): master holds the partition's fp32 weights;
// the step widens grads into grads32, steps master and rounds it into params.
struct OptimizerStep {
  static constexpr Kernel kernel = Kernel::optimizer_step;
  Id params = -1, grads = -1, states = -1, sqrt_v = -1, master = -1, grads32 = -1;
  Dim n = 0;
  template <class S, class Vis> static void visit(S& s, Vis& v) {
    v.dim(s.n);
    v.slot(s.params, {"params", true, -1, Elem::any});
    v.slot(s.grads, {"grads", true, s.n});
    v.slot(s.states, {"states", true, 2 * s.n, Elem::f32});
    v.slot(s.sqrt_v, {"sqrt_v", false, -1, Elem::any});
    v.slot(s.master, {"master", false, s.n, Elem::f32});
    v.slot(s.grads32, {"grads32", false, s.n, Elem::f32});
  }
};
// accumulate: an elementwise pass the cost-only profiles emit (bucket packing, PEFT's scaling
// and add, the loss's shift copy): reads `in`, writes `out` (empty: in place). The executor runs
// none of them.
struct Accumulate {
  static constexpr Kernel kernel = Kernel::accumulate;
  Id in = -1, out = -1;
  template <class S, class Vis> static void visit(S& s, Vis& v) {
    v.slot(s.in, {"in", true, -1, Elem::any});
    v.slot(s.out, {"out", false, -1, Elem::any});
  }
};

// --- emit and read -----------------------------------------------------------------------------

// How many values a kernel's ops hold in Program::operands (0 for Kernel::none).
inline std::size_t values_of(Kernel k);

namespace detail {
struct Writer {
  std::int64_t* out;
  void slot(Id id, const SlotSpec&) { *out++ = id; }
  void dim(Dim x) { *out++ = x; }
  void scalar(double x) { *out++ = std::bit_cast<std::int64_t>(x); }
  void iparam(std::int32_t x) { *out++ = x; }
  void dtype(DType t) { *out++ = static_cast<std::int64_t>(t); }
};
struct Reader {
  const std::int64_t* in;
  void slot(Id& id, const SlotSpec&) { id = static_cast<Id>(*in++); }
  void dim(Dim& x) { x = *in++; }
  void scalar(double& x) { x = std::bit_cast<double>(*in++); }
  void iparam(std::int32_t& x) { x = static_cast<std::int32_t>(*in++); }
  void dtype(DType& t) { t = static_cast<DType>(*in++); }
};
}  // namespace detail

// Sets op's kernel and appends the operands, dims, scalars and integer parameters of `k` to
// program.operands (add the op to the program afterwards).
template <class K>
void emit(Program& program, Op& op, const K& k) {
  op.kernel = K::kernel;
  const std::size_t at = program.operands.size();
  op.operands = static_cast<std::int32_t>(at);
  program.operands.resize(at + values_of(K::kernel));
  detail::Writer w{program.operands.data() + at};
  K::visit(k, w);
}


// Whether op's values lie inside program.operands (sim::verify checks it before reading).
inline bool operands_in_range(const Program& program, const Op& op) {
  const std::size_t n = values_of(op.kernel);
  return n == 0 || (op.operands >= 0 && static_cast<std::size_t>(op.operands) + n <= program.operands.size());
}

// Reads a compute op of kernel K::kernel back (an InternalError for another kernel).
template <class K>
K read(const Program& program, const Op& op) {
  PEFTPLAN_CHECK_MSG(op.kind == OpKind::compute && op.kernel == K::kernel, "op of kernel {} read as {}", name_of(op.kernel),
                     name_of(K::kernel));
  PEFTPLAN_CHECK(operands_in_range(program, op));
  K k;
  detail::Reader r{program.operands.data() + op.operands};
  K::visit(k, r);
  return k;
}

// The k-th value of op's operands, for tests that break a program by hand: the dims, scalars
// and integer parameters come first, then the slots, in the order visit() names them.
inline std::int64_t& value(Program& program, const Op& op, std::size_t k) {
  PEFTPLAN_CHECK(operands_in_range(program, op) && k < values_of(op.kernel));
  return program.operands[static_cast<std::size_t>(op.operands) + k];
}

// Calls f(k) with the op read as its kernel's struct (Kernel::none: not called, returns false).
template <class F>
bool with_kernel(const Program& program, const Op& op, F&& f) {
  switch (op.kernel) {
    case Kernel::none: return false;
    case Kernel::embedding_fwd: f(read<EmbeddingFwd>(program, op)); return true;
    case Kernel::embedding_bwd: f(read<EmbeddingBwd>(program, op)); return true;
    case Kernel::norm_fwd: f(read<NormFwd>(program, op)); return true;
    case Kernel::norm_bwd: f(read<NormBwd>(program, op)); return true;
    case Kernel::linear_fwd: f(read<LinearFwd>(program, op)); return true;
    case Kernel::linear_bwd_data: f(read<LinearBwdData>(program, op)); return true;
    case Kernel::linear_bwd_weight: f(read<LinearBwdWeight>(program, op)); return true;
    case Kernel::lora_fwd: f(read<LoraFwd>(program, op)); return true;
    case Kernel::lora_bwd: f(read<LoraBwd>(program, op)); return true;
    case Kernel::rope_fwd: f(read<RopeFwd>(program, op)); return true;
    case Kernel::rope_bwd: f(read<RopeBwd>(program, op)); return true;
    case Kernel::attention_fwd: f(read<AttentionFwd>(program, op)); return true;
    case Kernel::attention_bwd: f(read<AttentionBwd>(program, op)); return true;
    case Kernel::flash_attention_fwd: f(read<FlashAttentionFwd>(program, op)); return true;
    case Kernel::flash_attention_bwd: f(read<FlashAttentionBwd>(program, op)); return true;
    case Kernel::mlp_act_fwd: f(read<MlpActFwd>(program, op)); return true;
    case Kernel::mlp_act_bwd: f(read<MlpActBwd>(program, op)); return true;
    case Kernel::residual_add: f(read<ResidualAdd>(program, op)); return true;
    case Kernel::cross_entropy_fwd: f(read<CrossEntropyFwd>(program, op)); return true;
    case Kernel::cross_entropy_bwd: f(read<CrossEntropyBwd>(program, op)); return true;
    case Kernel::cast: f(read<Cast>(program, op)); return true;
    case Kernel::grad_norm: f(read<GradNorm>(program, op)); return true;
    case Kernel::optimizer_step: f(read<OptimizerStep>(program, op)); return true;
    case Kernel::accumulate: f(read<Accumulate>(program, op)); return true;
    case Kernel::dropout: f(read<Dropout>(program, op)); return true;
    case Kernel::rope_tables: f(read<RopeTables>(program, op)); return true;
  }
  return false;
}

// Every slot of a compute op with its spec, in the order visit() names them: g(slot index, id,
// spec).
template <class G>
void for_each_slot(const Program& program, const Op& op, G&& g) {
  with_kernel(program, op, [&](const auto& k) {
    struct V {
      G& g;
      std::size_t i = 0;
      void slot(Id id, const SlotSpec& s) { g(i++, id, s); }
      void dim(Dim) {}
      void scalar(double) {}
      void iparam(std::int32_t) {}
      void dtype(DType) {}
    } v{g};
    std::remove_cvref_t<decltype(k)>::visit(k, v);
  });
}

// Bytes per element of a slot of this kind (0: not determined by the shape).
inline std::uint64_t elem_bytes(const Program& program, const Op& op, Elem e) {
  switch (e) {
    case Elem::compute: return bytes_of(program.compute_dtype);
    case Elem::f32:
    case Elem::i32: return 4;
    case Elem::cast_src: return bytes_of(read<Cast>(program, op).from);
    case Elem::cast_dst: return bytes_of(read<Cast>(program, op).to);
    case Elem::any: return 0;
  }
  return 0;
}

namespace detail {
// A kernel's values in Program::operands: how many, how many of them (the last ones) are slots,
// and which are scalars (bit i: value i holds a double's bits).
struct Layout {
  std::uint8_t values = 0, slots = 0;
  std::uint64_t scalars = 0;
};
struct SlotCounter {
  std::size_t values = 0, slots = 0;
  std::uint64_t scalars = 0;
  bool slots_last = true;  // no dim, scalar or parameter after a slot
  void slot(Id, const SlotSpec&) { ++values, ++slots; }
  void other() { ++values, slots_last = slots_last && slots == 0; }
  void dim(Dim) { other(); }
  void scalar(double) {
    scalars |= std::uint64_t{1} << values;
    other();
  }
  void iparam(std::int32_t) { other(); }
  void dtype(DType) { other(); }
};
template <class K>
Layout layout_of() {
  const K k{};
  SlotCounter c;
  K::visit(k, c);
  PEFTPLAN_CHECK_MSG(c.slots_last, "{}'s visit() names a value after a slot (slots come last)", name_of(K::kernel));
  PEFTPLAN_CHECK_MSG(c.values <= 64, "{} has {} values; the scalar mask holds 64", name_of(K::kernel), c.values);
  return {static_cast<std::uint8_t>(c.values), static_cast<std::uint8_t>(c.slots), c.scalars};
}
inline Layout compute_layout(Kernel k) {
  switch (k) {
    case Kernel::none: return {};
    case Kernel::embedding_fwd: return layout_of<EmbeddingFwd>();
    case Kernel::embedding_bwd: return layout_of<EmbeddingBwd>();
    case Kernel::norm_fwd: return layout_of<NormFwd>();
    case Kernel::norm_bwd: return layout_of<NormBwd>();
    case Kernel::linear_fwd: return layout_of<LinearFwd>();
    case Kernel::linear_bwd_data: return layout_of<LinearBwdData>();
    case Kernel::linear_bwd_weight: return layout_of<LinearBwdWeight>();
    case Kernel::lora_fwd: return layout_of<LoraFwd>();
    case Kernel::lora_bwd: return layout_of<LoraBwd>();
    case Kernel::rope_fwd: return layout_of<RopeFwd>();
    case Kernel::rope_bwd: return layout_of<RopeBwd>();
    case Kernel::attention_fwd: return layout_of<AttentionFwd>();
    case Kernel::attention_bwd: return layout_of<AttentionBwd>();
    case Kernel::flash_attention_fwd: return layout_of<FlashAttentionFwd>();
    case Kernel::flash_attention_bwd: return layout_of<FlashAttentionBwd>();
    case Kernel::mlp_act_fwd: return layout_of<MlpActFwd>();
    case Kernel::mlp_act_bwd: return layout_of<MlpActBwd>();
    case Kernel::residual_add: return layout_of<ResidualAdd>();
    case Kernel::cross_entropy_fwd: return layout_of<CrossEntropyFwd>();
    case Kernel::cross_entropy_bwd: return layout_of<CrossEntropyBwd>();
    case Kernel::cast: return layout_of<Cast>();
    case Kernel::grad_norm: return layout_of<GradNorm>();
    case Kernel::optimizer_step: return layout_of<OptimizerStep>();
    case Kernel::accumulate: return layout_of<Accumulate>();
    case Kernel::dropout: return layout_of<Dropout>();
    case Kernel::rope_tables: return layout_of<RopeTables>();
  }
  return {};
}
// Per kernel: its values in Program::operands, and how many of them (the last ones) are slots.
inline const std::array<Layout, kNumKernels>& layouts() {
  static const auto table = [] {
    std::array<Layout, kNumKernels> t{};
    for (int k = 0; k < kNumKernels; ++k) t[static_cast<std::size_t>(k)] = compute_layout(static_cast<Kernel>(k));
    return t;
  }();
  return table;
}
}  // namespace detail

inline std::size_t values_of(Kernel k) { return detail::layouts()[static_cast<std::size_t>(k)].values; }

// Whether a kernel's k-th value is a scalar (a double's bits, Writer::scalar) rather than an
// integer (a dim, a parameter, a dtype or a slot).
inline bool value_is_scalar(Kernel kernel, std::size_t k) {
  return k < 64 && (detail::layouts()[static_cast<std::size_t>(kernel)].scalars >> k & 1u) != 0;
}

// A compute op's buffer ids, in slot order (every visit() names its slots last). The op's values
// must lie in range (operands_in_range).
inline std::span<const std::int64_t> slot_ids(const Program& program, const Op& op) {
  const auto& l = detail::layouts()[static_cast<std::size_t>(op.kernel)];
  if (l.slots == 0) return {};
  return {program.operands.data() + op.operands + (l.values - l.slots), l.slots};
}

// operands_in_range and slot_ids in one read of the layout table: the op's buffer ids, or nullopt
// when its values do not lie inside program.operands (sim::verify reads every op this way).
inline std::optional<std::span<const std::int64_t>> checked_slot_ids(const Program& program, const Op& op) {
  const auto& l = detail::layouts()[static_cast<std::size_t>(op.kernel)];
  if (l.values == 0) return std::span<const std::int64_t>{};
  if (op.operands < 0 || static_cast<std::size_t>(op.operands) + l.values > program.operands.size()) return std::nullopt;
  return std::span<const std::int64_t>{program.operands.data() + op.operands + (l.values - l.slots), l.slots};
}

}  // namespace peftplan::sim::ops
