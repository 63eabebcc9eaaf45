// Alpha-beta collective costs (see collectives.h).
//
// Bandwidth term. With per-rank link bandwidth B, nccl-tests gives the ideal ring times
// t_all_reduce = (S/B)·2(n-1)/n and t_reduce_scatter = t_all_gather = (S/B)·(n-1)/n
// (NVIDIA/nccl-tests doc/PERFORMANCE.md): each rank sends S·factor bytes. We count the bytes each
// rank sends on each link and divide by the achieved rate efficiency × B; on one node this is
// exactly the formula above, so busbw = efficiency × B for every kind and size (minus latency).
// On k nodes of g GPUs the hierarchical decomposition sends, per rank,
//   all_reduce:      intra 2(g-1)/g·S (reduce_scatter + all_gather), inter 2(k-1)/k·S/g,
//   reduce_scatter / all_gather: intra (g-1)/g·S, inter (k-1)/k·S/g,
//   broadcast:       intra S, inter S/g,
// and the phases are pipelined in chunks, so the time is set by the slower link (busbw "is
// meant to be compared with the bottleneck hardware bandwidth", same document). For an
// inter-node-bound all_reduce this gives busbw = (n-1)/(k-1) × per-GPU wire rate, the relation
// stas00/ml-engineering network/README.md ("Real network throughput") uses to recover the wire
// rate from measured multi-node busbw.
//
// Latency term, after NVIDIA/nccl src/graph/tuning.cc (ncclTopoTuneModel, NCCL 2.30), Simple
// protocol: ring = base + (nsteps - nInterSteps)·intraLat + nInterSteps·interLat with nsteps
// 2(n-1) for all_reduce, n-1 for reduce_scatter/all_gather, n for broadcast, and nInterSteps
// 2(k-1) for all_reduce, k-1 otherwise; tree all_reduce = base + 2((g-1)·intraLat +
// log2(k)·interLat). base = 8.4 us for both (baseLat, Simple). Tree bandwidth: NCCL scales the
// tree all_reduce bus bandwidth by 0.92 and converts to algbw with a factor 1/2 (each rank
// sends S up the tree and S down it).
#include "peftplan/sim/collectives.h"

#include <algorithm>
#include <cmath>

#include "peftplan/common/error.h"

namespace peftplan::sim {
namespace {

constexpr double kTreeBandwidthFactor = 0.92;  // tuning.cc, tree all_reduce

// How a group of n ranks sits on the cluster: packed onto ceil(n / gpus_per_node) nodes.
struct Layout {
  double n = 1;  // ranks
  double g = 1;  // ranks per node
  double k = 1;  // nodes
};

Layout layout_of(std::int32_t group_size, const Cluster& c, std::int32_t stride) {
  Layout l;
  l.n = group_size;
  l.k = stride >= c.gpus_per_node ? static_cast<double>(group_size) : std::ceil(static_cast<double>(group_size) / c.gpus_per_node);
  l.g = l.n / l.k;
  return l;
}

struct Rates {
  double intra = 0.0;  // achieved bytes/s per rank on the intra-node link
  double inter = 0.0;  // achieved bytes/s per rank on the network
};

Rates rates_of(const Cluster& c) {
  return {c.efficiency.collective_intra * c.intra_node_link.bandwidth_bytes_per_s,
          c.efficiency.collective_inter * inter_node_bytes_per_s_per_gpu(c)};
}

double inter_latency(const Cluster& c) {
  return c.inter_node_link ? c.inter_node_link->latency_s : 0.0;
}

CollectiveCost finish(Collective kind, double S, const Layout& l, double latency, double intra,
                      double inter, const Rates& r, double rate_scale, CollectiveAlgorithm algo) {
  double t_intra = intra > 0 ? intra / (rate_scale * r.intra) : 0.0;
  double t_inter = inter > 0 ? inter / (rate_scale * r.inter) : 0.0;
  CollectiveCost cost;
  cost.algorithm = algo;
  cost.latency_s = latency;
  cost.time_s = latency + std::max(t_intra, t_inter);
  cost.intra_node_bytes = static_cast<std::uint64_t>(std::llround(intra));
  cost.inter_node_bytes = static_cast<std::uint64_t>(std::llround(inter));
  cost.algbw_bytes_per_s = cost.time_s > 0 ? S / cost.time_s : 0.0;
  cost.busbw_bytes_per_s = cost.algbw_bytes_per_s * busbw_factor(kind, static_cast<std::int32_t>(l.n));
  return cost;
}

CollectiveCost ring_cost(Collective kind, double S, const Layout& l, const Cluster& c) {
  const double g = l.g, k = l.k, n = l.n;
  double intra = 0.0, inter = 0.0, nsteps = 0.0, inter_steps = 0.0;
  switch (kind) {
    case Collective::all_reduce:
      intra = 2.0 * (g - 1.0) / g * S;
      inter = 2.0 * (k - 1.0) / k * S / g;
      nsteps = 2.0 * (n - 1.0);
      inter_steps = 2.0 * (k - 1.0);
      break;
    case Collective::reduce_scatter:
    case Collective::all_gather:
      intra = (g - 1.0) / g * S;
      inter = (k - 1.0) / k * S / g;
      nsteps = n - 1.0;
      inter_steps = k - 1.0;
      break;
    case Collective::broadcast:
      intra = g > 1.0 ? S : 0.0;
      inter = k > 1.0 ? S / g : 0.0;
      nsteps = n;
      inter_steps = k - 1.0;
      break;
  }
  double latency = c.efficiency.collective_base_latency_s + (nsteps - inter_steps) * c.intra_node_link.latency_s +
                   inter_steps * inter_latency(c);
  return finish(kind, S, l, latency, intra, inter, rates_of(c), 1.0, CollectiveAlgorithm::ring);
}

CollectiveCost tree_all_reduce_cost(double S, const Layout& l, const Cluster& c) {
  double intra = l.g > 1.0 ? 2.0 * S : 0.0;
  double inter = l.k > 1.0 ? 2.0 * S / l.g : 0.0;
  double latency = c.efficiency.collective_base_latency_s + 2.0 * ((l.g - 1.0) * c.intra_node_link.latency_s +
                                          std::log2(l.k) * inter_latency(c));
  return finish(Collective::all_reduce, S, l, latency, intra, inter, rates_of(c),
                kTreeBandwidthFactor, CollectiveAlgorithm::tree);
}

}  // namespace

double busbw_factor(Collective kind, std::int32_t n) {
  PEFTPLAN_CHECK(n >= 1);
  const double nn = n;
  switch (kind) {
    case Collective::all_reduce: return 2.0 * (nn - 1.0) / nn;
    case Collective::reduce_scatter:
    case Collective::all_gather: return (nn - 1.0) / nn;
    case Collective::broadcast: return 1.0;
  }
  return 1.0;
}

double table_time_s(const CollectiveTable& t, double bytes) {
  const auto& x = t.bytes;
  const auto& y = t.seconds;
  const std::size_t n = std::min(x.size(), y.size());
  if (n == 0) return 0.0;
  if (n == 1 || bytes <= x[0]) return y[0];
  std::size_t hi = static_cast<std::size_t>(std::upper_bound(x.begin(), x.begin() + static_cast<std::ptrdiff_t>(n), bytes) - x.begin());
  if (hi >= n) hi = n - 1;  // beyond the table: the last segment's slope
  const std::size_t lo = hi - 1;
  const double dx = x[hi] - x[lo];
  const double slope = dx > 0.0 ? (y[hi] - y[lo]) / dx : 0.0;
  return std::max(y[lo] + slope * (bytes - x[lo]), 0.0);
}

CollectiveCost collective_cost(Collective kind, std::uint64_t bytes, std::int32_t group_size,
                               const Cluster& cluster, CollectiveAlgorithm algorithm, std::int32_t stride) {
  PEFTPLAN_CHECK_MSG(group_size >= 1 && group_size <= total_gpus(cluster),
                     "group of {} ranks on a cluster of {} GPUs", group_size, total_gpus(cluster));
  if (group_size == 1 || bytes == 0) return CollectiveCost{};
  const Layout l = layout_of(group_size, cluster, stride);
  // A calibrated host: the measured table of this kind and group size, when there is one (see
  // CollectiveTable in cluster.h). Bytes on the links are still the ring's.
  for (const CollectiveTable& t : cluster.host_calibration.collectives) {
    if (t.kind != static_cast<std::int32_t>(kind) || t.ranks != group_size || t.bytes.empty()) continue;
    CollectiveCost c = ring_cost(kind, static_cast<double>(bytes), l, cluster);
    c.time_s = table_time_s(t, static_cast<double>(bytes));
    return c;
  }
  PEFTPLAN_CHECK_MSG(l.k <= 1.0 || inter_node_bytes_per_s_per_gpu(cluster) > 0.0,
                     "cluster {} spans nodes without a network", cluster.name);
  const double S = static_cast<double>(bytes);
  const bool tree_ok = kind == Collective::all_reduce;
  switch (algorithm) {
    case CollectiveAlgorithm::ring: return ring_cost(kind, S, l, cluster);
    case CollectiveAlgorithm::tree:
      return tree_ok ? tree_all_reduce_cost(S, l, cluster) : ring_cost(kind, S, l, cluster);
    case CollectiveAlgorithm::automatic: {
      CollectiveCost ring = ring_cost(kind, S, l, cluster);
      if (!tree_ok) return ring;
      CollectiveCost tree = tree_all_reduce_cost(S, l, cluster);
      return tree.time_s < ring.time_s ? tree : ring;
    }
  }
  return ring_cost(kind, S, l, cluster);
}

}  // namespace peftplan::sim
