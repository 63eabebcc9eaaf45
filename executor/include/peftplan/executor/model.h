// The Llama-family model's tensors as the executor holds them: filling the base weights (seeded
// random initialisation as transformers' LlamaPreTrainedModel._init_weights does, or a
// safetensors checkpoint with Hugging Face names), filling the LoRA adapter (PEFT's
// initialisation, or a safetensors file with PEFT names) and saving the trained adapter in
// PEFT's format (adapter_model.safetensors + adapter_config.json).
// The layer wiring is not here: it is the step program (planner/program.cpp), which the runner
// interprets. Tensors are written into buffers the tracked allocator gave out.
#pragma once

#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include "peftplan/common/dtype.h"
#include "peftplan/executor/safetensors.h"
#include "peftplan/models/parameters.h"
#include "peftplan/models/peft.h"

namespace peftplan::executor {

// Seeded random numbers, counter-based (SplitMix64), so that a tensor's values depend only on
// (seed, tensor name, element index), not on thread count or fill order.
std::uint64_t tensor_key(std::uint64_t seed, std::string_view name);
void fill_normal(std::span<float> out, double mean, double stddev, std::uint64_t key);
void fill_uniform(std::span<float> out, double lo, double hi, std::uint64_t key);

// Initialises one frozen base tensor into `dst`, stored as `storage` (fp32, or bf16 rounded to
// nearest even): from `checkpoint` when given (the tensor must exist with the inventory's shape;
// F32, F16 and BF16 are accepted), else random: Linear weights, embeddings and the LM head
// ~ normal(0, initializer_range = 0.02), biases 0, norm weights 1. Throws InputError naming the
// checkpoint and the tensor.
void init_base_tensor(const models::TensorInfo& t, DType storage, std::span<std::byte> dst,
                      std::uint64_t seed, const SafetensorsFile* checkpoint);

// Initialises one adapter tensor: from `adapter` when given (PEFT names, shape checked), else
// PEFT's init_lora_weights=True: lora_A ~ kaiming_uniform_(a=√5) = U(−1/√in, 1/√in)
// (peft/tuners/lora/layer.py reset_lora_parameters), lora_B = 0.
void init_adapter_tensor(const models::TrainableTensor& t, std::span<float> dst,
                         std::uint64_t seed, const SafetensorsFile* adapter);

// One adapter tensor to save: PEFT name, shape, fp32 values.
struct AdapterTensor {
  const models::TrainableTensor* info = nullptr;
  std::span<const float> values;
};
// Writes <dir>/adapter_model.safetensors (F32, metadata {"format": "pt"} as PEFT's
// save_pretrained does) and <dir>/adapter_config.json (models::lora_adapter_config, indent 2,
// sorted keys as PEFT writes it). Creates dir.
void save_adapter(const std::filesystem::path& dir, const models::AdapterSpec& adapter,
                  const std::string& base_model, std::span<const AdapterTensor> tensors);

}  // namespace peftplan::executor
