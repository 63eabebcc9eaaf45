// Eager grouped-query causal attention on the CPU, forward and backward, as one GEMM pair per
// (batch, head) over strided views of the [B,S,heads,d] activations (no transposed copies).
// Mirrors transformers' eager_attention_forward with repeat_kv: query head h reads kv head
// h / (nh/nkv); scores = q·kᵀ · (1/√d) + causal mask; softmax in the compute type; out = P·v.
// Flash attention (kernels.h §5b) computes the same attention kExecAttentionRows queries at a
// time against tiles of keys with an online softmax, and keeps only each row's log-sum-exp.
// Deliberately not here: attention masks other than causal, dropout on P.
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

// Head h of batch b in a [B, S, heads, d] tensor: an [S, d] view whose rows are heads·d apart.
template <typename T>
CSMap<T> head(const T* t, Index b, Index h, Index S, Index heads, Index d) {
  return CSMap<T>(t + (b * S * heads + h) * d, S, d, Eigen::OuterStride<>(heads * d));
}
template <typename T>
SMap<T> head(T* t, Index b, Index h, Index S, Index heads, Index d) {
  return SMap<T>(t + (b * S * heads + h) * d, S, d, Eigen::OuterStride<>(heads * d));
}

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
      const auto Q = head(q, b, h, S, nh, d);
      const auto K = head(k, b, kvh, S, nkv, d);
      const auto Vm = head(v, b, kvh, S, nkv, d);
      auto O = head(out, b, h, S, nh, d);
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
    const auto K = head(k, b, kvh, S, nkv, d);
    const auto Vm = head(v, b, kvh, S, nkv, d);
    auto dK = head(dk, b, kvh, S, nkv, d);
    auto dV = head(dv, b, kvh, S, nkv, d);
    dK.setZero();
    dV.setZero();
    for (Index h = kvh * rep; h < (kvh + 1) * rep; ++h) {
      const auto Q = head(q, b, h, S, nh, d);
      const auto dO = head(dout, b, h, S, nh, d);
      auto dQ = head(dq, b, h, S, nh, d);
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

namespace {

constexpr Index kTile = planner::kExecAttentionRows;  // queries per tile (the planner counts this work)
// Keys per tile: wider than the query tile so that each product is a GEMM Eigen runs near its
// rate (64 x 64 x d products ran at two thirds of eager's); the work is the same, since a query
// tile's last key tile still ends at its last row.
constexpr Index kKeyTile = 4 * kTile;
// A tile of scores or probabilities: at most kTile × kKeyTile, held inline (on the stack), so a
// kernel allocates nothing the tracked allocator does not see.
template <typename T>
using Tile = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor, kTile, kKeyTile>;
template <typename T>
using Col = Eigen::Array<T, Eigen::Dynamic, 1, 0, kTile, 1>;

// The scaled scores of query rows [i0, i0+rows) against key rows [j0, j0+cols), with the keys
// after each query masked to −∞ (only the diagonal tile has any).
template <typename T>
void score_tile(const CSMap<T>& Q, const CSMap<T>& K, Index i0, Index rows, Index j0, Index cols, T scale,
                Tile<T>& sc) {
  sc.resize(rows, cols);
  sc.noalias() = Q.middleRows(i0, rows) * K.middleRows(j0, cols).transpose();
  sc *= scale;
  if (j0 + cols > i0 + 1)
    for (Index r = 0; r < rows; ++r)
      for (Index c = std::max<Index>(0, i0 + r + 1 - j0); c < cols; ++c) sc(r, c) = -std::numeric_limits<T>::infinity();
}

}  // namespace

template <typename T>
void flash_attention_forward(const T* q, const T* k, const T* v, T* lse, T* out, Index B, Index S, Index nh,
                             Index nkv, Index d) {
  PEFTPLAN_CHECK_MSG(nkv > 0 && nh % nkv == 0, "heads {} not a multiple of kv heads {}", nh, nkv);
  const Index rep = nh / nkv, tiles = (S + kTile - 1) / kTile;
  const T scale = T(1) / std::sqrt(static_cast<T>(d));
  // One (batch, head, query tile) per task: each owns its rows of out and lse.
#pragma omp parallel for collapse(3) schedule(dynamic)
  for (Index b = 0; b < B; ++b) {
    for (Index h = 0; h < nh; ++h) {
      for (Index t = 0; t < tiles; ++t) {
        const Index kvh = h / rep, i0 = t * kTile, rows = std::min(kTile, S - i0);
        const auto Q = head(q, b, h, S, nh, d);
        const auto K = head(k, b, kvh, S, nkv, d);
        const auto Vm = head(v, b, kvh, S, nkv, d);
        auto O = head(out, b, h, S, nh, d);
        auto Oi = O.middleRows(i0, rows);  // the unnormalised accumulator until the last tile
        Oi.setZero();
        Col<T> m = Col<T>::Constant(rows, -std::numeric_limits<T>::infinity()), l = Col<T>::Zero(rows);
        Tile<T> sc;
        for (Index j0 = 0; j0 < i0 + rows; j0 += kKeyTile) {
          const Index cols = std::min(kKeyTile, i0 + rows - j0);
          score_tile(Q, K, i0, rows, j0, cols, scale, sc);
          // online softmax: m' = max(m, rowmax), l' = l·e^(m−m') + Σ e^(s−m'), O' = e^(m−m')·O + P·V
          const Col<T> m_new = m.max(sc.rowwise().maxCoeff().array());
          const Col<T> alpha = (m - m_new).exp();
          sc = (sc.array().colwise() - m_new).exp().matrix();
          l = l * alpha + sc.rowwise().sum().array();
          Oi = alpha.matrix().asDiagonal() * Oi;
          Oi.noalias() += sc * Vm.middleRows(j0, cols);
          m = m_new;
        }
        Oi = l.inverse().matrix().asDiagonal() * Oi;
        Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>>(lse + (b * nh + h) * S + i0, rows) = m + l.log();
      }
    }
  }
}

template <typename T>
void flash_attention_backward(const T* dout, const T* q, const T* k, const T* v, const T* out, const T* lse, T* dq,
                              T* dk, T* dv, Index B, Index S, Index nh, Index nkv, Index d) {
  PEFTPLAN_CHECK_MSG(nkv > 0 && nh % nkv == 0, "heads {} not a multiple of kv heads {}", nh, nkv);
  const Index rep = nh / nkv;
  const T scale = T(1) / std::sqrt(static_cast<T>(d));
  // Tasks are (batch, kv head), as in attention_backward: the rep query heads sharing a kv head
  // run in one task, which owns their dq rows and the kv head's dk and dv.
#pragma omp parallel for collapse(2) schedule(dynamic)
  for (Index b = 0; b < B; ++b) {
    for (Index kvh = 0; kvh < nkv; ++kvh) {
      const auto K = head(k, b, kvh, S, nkv, d);
      const auto Vm = head(v, b, kvh, S, nkv, d);
      auto dK = head(dk, b, kvh, S, nkv, d);
      auto dV = head(dv, b, kvh, S, nkv, d);
      dK.setZero();
      dV.setZero();
      Tile<T> p, dp;
      for (Index h = kvh * rep; h < (kvh + 1) * rep; ++h) {
        const auto Q = head(q, b, h, S, nh, d);
        const auto O = head(out, b, h, S, nh, d);
        const auto dO = head(dout, b, h, S, nh, d);
        auto dQ = head(dq, b, h, S, nh, d);
        for (Index i0 = 0; i0 < S; i0 += kTile) {
          const Index rows = std::min(kTile, S - i0);
          const Col<T> D = (dO.middleRows(i0, rows).array() * O.middleRows(i0, rows).array()).rowwise().sum();
          const Eigen::Map<const Eigen::Array<T, Eigen::Dynamic, 1>> L(lse + (b * nh + h) * S + i0, rows);
          auto dQi = dQ.middleRows(i0, rows);
          dQi.setZero();
          for (Index j0 = 0; j0 < i0 + rows; j0 += kKeyTile) {
            const Index cols = std::min(kKeyTile, i0 + rows - j0);
            score_tile(Q, K, i0, rows, j0, cols, scale, p);
            p = (p.array().colwise() - L).exp().matrix();  // P = e^(s − lse); masked: e^−∞ = 0
            dV.middleRows(j0, cols).noalias() += p.transpose() * dO.middleRows(i0, rows);
            dp.resize(rows, cols);
            dp.noalias() = dO.middleRows(i0, rows) * Vm.middleRows(j0, cols).transpose();
            dp = (p.array() * (dp.array().colwise() - D)).matrix() * scale;  // dS · 1/√d
            dQi.noalias() += dp * K.middleRows(j0, cols);
            dK.middleRows(j0, cols).noalias() += dp.transpose() * Q.middleRows(i0, rows);
          }
        }
      }
    }
  }
}

template void flash_attention_forward<float>(const float*, const float*, const float*, float*, float*, Index, Index,
                                             Index, Index, Index);
template void flash_attention_forward<double>(const double*, const double*, const double*, double*, double*, Index,
                                              Index, Index, Index, Index);
template void flash_attention_backward<float>(const float*, const float*, const float*, const float*, const float*,
                                              const float*, float*, float*, float*, Index, Index, Index, Index, Index);
template void flash_attention_backward<double>(const double*, const double*, const double*, const double*,
                                               const double*, const double*, double*, double*, double*, Index, Index,
                                               Index, Index, Index);

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
