// Eager grouped-query causal attention on the CPU, forward and backward, as one GEMM pair per
// (batch, head) over strided views of the [B,S,heads,d] activations (no transposed copies).
// Mirrors transformers' eager_attention_forward with repeat_kv: query head h reads kv head
// h / (nh/nkv); scores = q·kᵀ · (1/√d) + causal mask; softmax in the compute type; out = P·v.
// Deliberately not here: flash-style tiling (the saved P[B,nh,S,S] is what the planner counts
// for eager attention), attention masks other than causal, dropout on P.
#include <algorithm>
#include <cmath>
#include <limits>

#include <omp.h>

#include "eigen_maps.h"
#include "peftplan/common/error.h"
#include "peftplan/executor/kernels.h"
#include "peftplan/planner/program.h"

namespace peftplan::executor::cpu {

using namespace detail;

template <typename T>
void attention_forward(const T* q, const T* k, const T* v, T* P, T* out, Index B, Index S,
                       Index nh, Index nkv, Index d) {
  PEFTPLAN_CHECK_MSG(nkv > 0 && nh % nkv == 0, "heads {} not a multiple of kv heads {}", nh, nkv);
  const Index rep = nh / nkv;
  const T scale = T(1) / std::sqrt(static_cast<T>(d));
  // One (batch, head) per task; Eigen sees it is inside a parallel region and runs serially.
#pragma omp parallel for collapse(2) schedule(dynamic)
  for (Index b = 0; b < B; ++b) {
    for (Index h = 0; h < nh; ++h) {
      const Index kvh = h / rep;
      CSMap<T> Q(q + b * S * nh * d + h * d, S, d, Eigen::OuterStride<>(nh * d));
      CSMap<T> K(k + b * S * nkv * d + kvh * d, S, d, Eigen::OuterStride<>(nkv * d));
      CSMap<T> Vm(v + b * S * nkv * d + kvh * d, S, d, Eigen::OuterStride<>(nkv * d));
      SMap<T> O(out + b * S * nh * d + h * d, S, d, Eigen::OuterStride<>(nh * d));
      T* p = P + (b * nh + h) * S * S;
      Map<T> Pm(p, S, S);
      // Causal: row block [i0, i0+len) attends to columns [0, i0+len) only, so the scores
      // above the diagonal's blocks are never computed (about half the GEMM work at large S).
      constexpr Index kRows = planner::kExecAttentionRows;  // the planner counts this work
      for (Index i0 = 0; i0 < S; i0 += kRows) {
        const Index len = std::min(kRows, S - i0), cols = i0 + len;
        Pm.block(i0, 0, len, cols).noalias() = Q.middleRows(i0, len) * K.topRows(cols).transpose();
      }
      for (Index i = 0; i < S; ++i) {
        T* row = p + i * S;
        // softmax over j <= i of row[j]·scale; the masked j > i get probability 0 (Eigen's
        // vectorised exp: the softmax, not the GEMMs, bounds small-head_dim attention)
        ArrMap<T> r(row, i + 1);
        r *= scale;
        r = (r - r.maxCoeff()).exp();
        r *= T(1) / r.sum();
        std::fill(row + i + 1, row + S, T(0));
      }
      for (Index i0 = 0; i0 < S; i0 += kRows) {
        const Index len = std::min(kRows, S - i0), cols = i0 + len;
        O.middleRows(i0, len).noalias() = Pm.block(i0, 0, len, cols) * Vm.topRows(cols);
      }
    }
  }
}

Index attention_backward_scratch_elems(Index S, Index workers) {
  return S * S * std::max<Index>(1, workers);
}

template <typename T>
void attention_backward(const T* dout, const T* q, const T* k, const T* v, const T* P, T* dq,
                        T* dk, T* dv, T* scratch, Index scratch_elems, Index B, Index S, Index nh,
                        Index nkv, Index d) {
  PEFTPLAN_CHECK_MSG(nkv > 0 && nh % nkv == 0, "heads {} not a multiple of kv heads {}", nh, nkv);
  const Index workers = scratch_elems / (S * S);
  PEFTPLAN_CHECK_MSG(workers >= 1, "attention backward scratch {} < S*S = {}", scratch_elems,
                     S * S);
  const Index rep = nh / nkv;
  const T scale = T(1) / std::sqrt(static_cast<T>(d));
  const int threads = static_cast<int>(std::min<Index>(workers, omp_get_max_threads()));
  // Tasks are (batch, kv head): the rep query heads sharing a kv head run in one task, so dk and
  // dv are summed without races or reduction buffers.
#pragma omp parallel for num_threads(threads) schedule(dynamic)
  for (Index task = 0; task < B * nkv; ++task) {
    const Index b = task / nkv, kvh = task % nkv;
    Map<T> dP(scratch + omp_get_thread_num() * S * S, S, S);
    CSMap<T> K(k + b * S * nkv * d + kvh * d, S, d, Eigen::OuterStride<>(nkv * d));
    CSMap<T> Vm(v + b * S * nkv * d + kvh * d, S, d, Eigen::OuterStride<>(nkv * d));
    SMap<T> dK(dk + b * S * nkv * d + kvh * d, S, d, Eigen::OuterStride<>(nkv * d));
    SMap<T> dV(dv + b * S * nkv * d + kvh * d, S, d, Eigen::OuterStride<>(nkv * d));
    dK.setZero();
    dV.setZero();
    for (Index h = kvh * rep; h < (kvh + 1) * rep; ++h) {
      CSMap<T> Q(q + b * S * nh * d + h * d, S, d, Eigen::OuterStride<>(nh * d));
      CSMap<T> dO(dout + b * S * nh * d + h * d, S, d, Eigen::OuterStride<>(nh * d));
      SMap<T> dQ(dq + b * S * nh * d + h * d, S, d, Eigen::OuterStride<>(nh * d));
      const T* p = P + (b * nh + h) * S * S;
      CMap<T> Pm(p, S, S);
      // Causal row blocks as in the forward: row block [i0, i0+len) touches columns [0, i0+len).
      constexpr Index kRows = planner::kExecAttentionRows;  // the planner counts this work
      for (Index i0 = 0; i0 < S; i0 += kRows) {
        const Index len = std::min(kRows, S - i0), cols = i0 + len;
        dV.topRows(cols).noalias() += Pm.block(i0, 0, len, cols).transpose() * dO.middleRows(i0, len);  // out = P v
        dP.block(i0, 0, len, cols).noalias() = dO.middleRows(i0, len) * Vm.topRows(cols).transpose();
      }
      // softmax backward: dS = P ⊙ (dP − rowsum(P ⊙ dP)); then the 1/√d of the scores
      for (Index i = 0; i < S; ++i) {
        const T* pr = p + i * S;
        T* g = dP.data() + i * S;
        CArrMap<T> pa(pr, i + 1);
        ArrMap<T> ga(g, i + 1);
        const T dot = (pa * ga).sum();
        ga = pa * (ga - dot) * scale;
        std::fill(g + i + 1, g + S, T(0));
      }
      for (Index i0 = 0; i0 < S; i0 += kRows) {
        const Index len = std::min(kRows, S - i0), cols = i0 + len;
        dQ.middleRows(i0, len).noalias() = dP.block(i0, 0, len, cols) * K.topRows(cols);
        dK.topRows(cols).noalias() += dP.block(i0, 0, len, cols).transpose() * Q.middleRows(i0, len);
      }
    }
  }
}

template void attention_forward<float>(const float*, const float*, const float*, float*, float*,
                                       Index, Index, Index, Index, Index);
template void attention_forward<double>(const double*, const double*, const double*, double*,
                                        double*, Index, Index, Index, Index, Index);
template void attention_backward<float>(const float*, const float*, const float*, const float*,
                                        const float*, float*, float*, float*, float*, Index, Index,
                                        Index, Index, Index, Index);
template void attention_backward<double>(const double*, const double*, const double*,
                                         const double*, const double*, double*, double*, double*,
                                         double*, Index, Index, Index, Index, Index, Index);

}  // namespace peftplan::executor::cpu
