// Cost of one collective on a cluster: a latency + bandwidth (alpha-beta) model in NCCL's terms.
// Sizes follow nccl-tests (NVIDIA/nccl-tests doc/PERFORMANCE.md): S is the buffer of an
// all_reduce or broadcast, and the TOTAL array (shard × n) of a reduce_scatter or all_gather;
// algbw = S / t and busbw = algbw × factor(kind, n).
// Groups are packed onto nodes (ranks 0..g-1 on node 0, ...). On several nodes the ring is
// hierarchical: intra-node reduce_scatter, inter-node collective on each GPU's shard through its
// share of the node's NICs, intra-node all_gather, pipelined, so the slower link sets the rate.
// Not modelled: NVLink SHARP (NVLS), CollNet, PAT, LL/LL128 protocol selection, contention
// between concurrent collectives, stragglers.
#pragma once

#include <cstdint>

#include "peftplan/sim/cluster.h"
#include "peftplan/sim/program.h"

namespace peftplan::sim {

enum class CollectiveAlgorithm : std::uint8_t {
  automatic,  // the faster of ring and tree, as NCCL's tuner picks by predicted time
  ring,       // ring (hierarchical across nodes); every collective kind
  tree,       // NCCL's (double binary) tree; all_reduce only, others fall back to ring
};

struct CollectiveCost {
  double time_s = 0.0;             // latency_s + bandwidth term
  double latency_s = 0.0;          // the alpha part
  double algbw_bytes_per_s = 0.0;  // S / time_s (nccl-tests algbw); 0 for a 1-rank group
  double busbw_bytes_per_s = 0.0;  // algbw × busbw_factor (nccl-tests busbw)
  std::uint64_t intra_node_bytes = 0;  // bytes this rank sends over intra-node links
  std::uint64_t inter_node_bytes = 0;  // bytes this rank sends over the network
  CollectiveAlgorithm algorithm = CollectiveAlgorithm::ring;  // the one costed
};

// nccl-tests' bus-bandwidth factor: all_reduce 2(n-1)/n, reduce_scatter and all_gather (n-1)/n,
// broadcast 1 (NVIDIA/nccl-tests doc/PERFORMANCE.md).
double busbw_factor(Collective kind, std::int32_t n);

// Seconds of one operation of `bytes` from a calibrated table: linear interpolation between
// measured sizes, the first size's time below it, the last segment's slope above it.
double table_time_s(const CollectiveTable& t, double bytes);

// One collective of nccl-tests size `bytes` over `group_size` ranks (1 <= group_size <=
// total_gpus(cluster)). A group of one costs nothing. `stride`: the rank distance between
// members; a stride of at least a node's GPUs puts one member on each node.
CollectiveCost collective_cost(Collective kind, std::uint64_t bytes, std::int32_t group_size,
                               const Cluster& cluster,
                               CollectiveAlgorithm algorithm = CollectiveAlgorithm::automatic, std::int32_t stride = 1);

}  // namespace peftplan::sim
