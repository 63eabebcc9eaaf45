// Peaks outside the step (see lifecycle.h).
#include "peftplan/planner/lifecycle.h"

#include <algorithm>

#include <fmt/format.h>

#include "peftplan/common/units.h"
#include "peftplan/models/parameters.h"
#include "peftplan/models/peft.h"

#include "builder.h"

namespace peftplan::planner {

// transformers save_pretrained's default max_shard_size ("5GB", modeling_utils.py): the largest
// piece a checkpoint is written in, and what a loader holds of one at a time.
constexpr std::uint64_t kShardBytes = 5'000'000'000ull;

LifecyclePeaks lifecycle_peaks(const PlanInput& in, const sim::Cluster& cluster, std::uint64_t weights_device_bytes) {
  LifecyclePeaks r;
  const auto& t = in.training;
  const DType load = load_dtype(t);  // from_pretrained(torch_dtype=...) builds the model in it
  const auto tensors = models::parameter_tensors(in.model);
  std::uint64_t model_bytes = 0, largest_linear = 0, largest_unit = 0;
  std::vector<std::uint64_t> unit(static_cast<std::size_t>(in.model.layers) + 1, 0);
  for (const auto& x : tensors) {
    const std::uint64_t b = storage_bytes(load, x.numel());
    model_bytes += b;
    if (x.role == models::ParamRole::linear_weight) largest_linear = std::max<std::uint64_t>(largest_linear, static_cast<std::uint64_t>(x.numel()));
    unit[x.layer >= 0 ? static_cast<std::size_t>(x.layer) : unit.size() - 1] += b;  // decoder layers, then the root
  }
  for (std::uint64_t u : unit) largest_unit = std::max(largest_unit, u);
  const std::int32_t per_node = std::max(1, std::min(in.strategy.ranks, cluster.gpus_per_node));
  const bool fsdp = is_fsdp(in.strategy.stage);
  const bool kbit = in.peft.quantization && bits_of(in.peft.quantization->dtype) <= 8;
  const bool peft = !in.peft.adapters.empty();

  // --- load ---
  if (kbit && in.model.checkpoint_quantization) {
    // Saved quantised: the shards hold the packed weights and their constants, which
    // from_pretrained places on the device as they are (the bitsandbytes quantizer's
    // create_quantized_param rebuilds Params4bit / Int8Params from the saved pieces, no
    // quantisation step): host RAM holds one shard of the quantised checkpoint.
    std::uint64_t checkpoint_bytes = 0;
    for (const auto& x : tensors) checkpoint_bytes += builder::frozen_bytes(x, load, load, in.peft.quantization);
    r.load_host_per_rank_bytes = std::min(checkpoint_bytes, kShardBytes);
    r.load_host_per_node_bytes = r.load_host_per_rank_bytes * static_cast<std::uint64_t>(per_node);
    r.load_device_bytes = weights_device_bytes;
    r.load_how = fmt::format("saved quantised ({}): one shard of the {} checkpoint in host RAM per rank, the packed weights placed on the "
                             "device as they are", models::describe(*in.model.checkpoint_quantization), human_bytes(checkpoint_bytes));
  } else if (kbit) {
    // A quantization_config makes from_pretrained load with low_cpu_mem_usage: checkpoint shards
    // are read one at a time and each Linear weight is quantised as it reaches the GPU
    // (bitsandbytes 0.43.3 Params4bit.cuda -> functional.quantize_4bit: the bf16 weight, the packed
    // output and one fp32 absmax per 64-element block are live together).
    r.load_host_per_rank_bytes = std::min(model_bytes, kShardBytes);
    r.load_host_per_node_bytes = r.load_host_per_rank_bytes * static_cast<std::uint64_t>(per_node);
    r.load_device_bytes = weights_device_bytes + storage_bytes(load, static_cast<std::int64_t>(largest_linear)) + largest_linear / 2 + 4 * (largest_linear / 64);
    r.load_how = fmt::format("quantised at load: one checkpoint shard in host RAM per rank, on the device the largest Linear "
                             "({} elements) in {} while bitsandbytes packs it", with_commas(static_cast<std::int64_t>(largest_linear)), name_of(load));
  } else if (fsdp && in.strategy.fsdp.cpu_ram_efficient_loading) {
    // accelerate 1.0.1 FullyShardedDataParallelPlugin.cpu_ram_efficient_loading: "only the first
    // process loads the pretrained model checkpoint while all other processes have empty
    // weights"; sync_module_states broadcasts them while each unit is wrapped and sharded.
    r.load_host_per_rank_bytes = model_bytes;
    r.load_host_per_node_bytes = model_bytes;
    r.load_device_bytes = weights_device_bytes + largest_unit;
    r.load_how = fmt::format("FSDP cpu_ram_efficient_loading: rank 0 alone holds the {} model in host RAM; each unit is whole on "
                             "the device while it is wrapped and sharded", name_of(load));
  } else {
    // Without it every rank's from_pretrained builds the whole model on the CPU in torch_dtype
    // and copies the checkpoint into it, then the Trainer moves it to its GPU.
    r.load_host_per_rank_bytes = model_bytes;
    r.load_host_per_node_bytes = model_bytes * static_cast<std::uint64_t>(per_node);
    r.load_device_bytes = fsdp ? weights_device_bytes + largest_unit : weights_device_bytes;
    r.load_how = fmt::format("every rank builds the whole {} model in host RAM ({} per node)", name_of(load),
                             per_node > 1 ? fmt::format("{} copies", per_node) : std::string("one copy"));
  }

  // --- save ---
  std::uint64_t adapter_bytes = 0;
  if (peft) {
    const auto linears = models::linear_modules(in.model, tensors);
    for (const auto& x : models::trainable_tensors(in.model, in.peft, tensors, linears)) adapter_bytes += 4ull * static_cast<std::uint64_t>(x.numel());
  }
  if (fsdp && in.strategy.fsdp.state_dict_type == "FULL_STATE_DICT") {
    // Trainer.save_model under FSDP with FULL_STATE_DICT: accelerator.get_state_dict gathers the
    // whole model (FullStateDictConfig(offload_to_cpu=True, rank0_only=True)), unit by unit on
    // the device, into rank 0's host RAM; PEFT then keeps only the adapter's keys.
    r.save_host_bytes = model_bytes + adapter_bytes;
    r.save_device_bytes = largest_unit;
    r.save_how = "FSDP FULL_STATE_DICT: the whole model gathered into rank 0's host RAM, a unit at a time through the device";
  } else if (fsdp) {
    r.save_host_bytes = (model_bytes + adapter_bytes) / static_cast<std::uint64_t>(std::max(1, in.strategy.ranks));
    r.save_how = fmt::format("FSDP {}: each rank writes its own shard", in.strategy.fsdp.state_dict_type);
  } else if (peft) {
    r.save_host_bytes = adapter_bytes;  // PEFT's save_pretrained writes the adapter only
    r.save_how = "the adapter only (PEFT save_pretrained)";
  } else {
    r.save_host_bytes = std::min(model_bytes, kShardBytes);
    r.save_how = "one 5 GB safetensors shard at a time (save_pretrained's max_shard_size)";
  }
  return r;
}

}  // namespace peftplan::planner
