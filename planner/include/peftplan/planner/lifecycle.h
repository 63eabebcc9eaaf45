// Peaks outside the training step, where users really run out: loading the model (host RAM per
// rank and per node, QLoRA's quantisation on the device) and saving it (a FULL_STATE_DICT
// gathered on rank 0's host). Closed forms over the model's parameter inventory, for the `hf`
// profile's stack (transformers 4.48.1 from_pretrained / save_pretrained, accelerate 1.0.1's FSDP
// plugin, bitsandbytes 0.43.3); each rule is cited where lifecycle.cpp computes it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "peftplan/planner/program.h"
#include "peftplan/sim/cluster.h"

namespace peftplan::planner {

struct LifecyclePeaks {
  std::uint64_t load_host_per_rank_bytes = 0;   // the loading rank's host RAM (rank 0)
  std::uint64_t load_host_per_node_bytes = 0;   // all ranks of a node that load a copy
  std::uint64_t load_device_bytes = 0;          // device memory while weights arrive
  std::uint64_t save_host_bytes = 0;            // rank 0's host RAM while it saves
  std::uint64_t save_device_bytes = 0;          // device memory saving adds on top of the states
  std::uint64_t eval_device_bytes = 0;          // allocated peak of the evaluation loop's forward
                                                //   (0: no evaluation, TrainingSpec::eval_batch)
  std::string load_how, save_how, eval_how;     // one line each: what the rule was
};

// The peaks for `in` on `cluster`; `weights_device_bytes` is the model's weights on the device as
// the step holds them (its optimizer states do not exist yet while loading).
LifecyclePeaks lifecycle_peaks(const PlanInput& in, const sim::Cluster& cluster, std::uint64_t weights_device_bytes);

}  // namespace peftplan::planner
