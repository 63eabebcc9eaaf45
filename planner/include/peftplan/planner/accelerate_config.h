// accelerate's launch config YAML (`accelerate config`, `accelerate launch --config_file`) in and
// out, for FSDP and plain multi-GPU (DDP) jobs. Semantics follow accelerate 1.0.1:
// commands/config/cluster.py (the keys `accelerate config` writes), utils/dataclasses.py
// FullyShardedDataParallelPlugin (defaults; a sharding strategy given by name or by torch's
// ShardingStrategy number, 1 = FULL_SHARD ... 4 = HYBRID_SHARD), utils/constants.py
// (FSDP_SHARDING_STRATEGY, FSDP_BACKWARD_PREFETCH, FSDP_AUTO_WRAP_POLICY, FSDP_STATE_DICT_TYPE).
// Keys that do not change memory or time (machine_rank, main_process_ip, ...) are accepted
// silently, keys peftplan does not model are warnings naming the key, and wrong types or values
// are InputErrors naming the file, the key and what would be valid.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "peftplan/planner/specs.h"

namespace peftplan::planner {

struct AccelerateConfig {
  Strategy strategy;                 // stage (DDP or an FSDP strategy), offload_param, fsdp knobs;
                                     // ranks = num_processes (0 when the file does not say)
  std::int32_t num_machines = 1;
  std::optional<Precision> precision;  // mixed_precision bf16 / fp16 (autocast and FSDP's
                                       // MixedPrecision); nullopt when the file does not say
  bool no_mixed_precision = false;     // mixed_precision: 'no' (the model runs in its torch_dtype)
  std::vector<std::string> warnings;
};

// Parses YAML text; `source` names the file in messages.
AccelerateConfig read_accelerate_config(std::string_view yaml, std::string_view source);
AccelerateConfig read_accelerate_config_file(const std::string& path);

// The YAML `accelerate launch --config_file` runs this strategy with (DDP or FSDP; ZeRO is
// refused: DeepSpeed's own config is --write-ds-config).
std::string write_accelerate_config(const Strategy& strategy, const TrainingSpec& training, std::int32_t num_machines);

}  // namespace peftplan::planner
