// The parameter inventory: one row per tensor with its Hugging Face name, shape and dtype, tied
// weights once. Counts, memory and FLOPs all derive from these rows, and so do the executor's
// allocations. Read it like llm.c's fill_in_parameter_sizes: one line per tensor.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "peftplan/common/dtype.h"
#include "peftplan/models/model_spec.h"

namespace peftplan::models {

enum class ParamRole : std::uint8_t {
  embedding,           // token embedding [V, H]
  position_embedding,  // learned positions [P, H]
  linear_weight,       // nn.Linear [out, in] or GPT-2 Conv1D [in, out]
  linear_bias,         // [out]
  norm_weight,         // [H]
  norm_bias,           // [H]
  lm_head,             // untied output projection [V, H]
};

struct TensorInfo {
  std::string name;                 // "model.layers.0.self_attn.q_proj.weight"
  std::vector<std::int64_t> shape;  // PyTorch shape
  DType dtype = DType::fp32;
  ParamRole role = ParamRole::linear_weight;
  std::int32_t layer = -1;          // decoder layer, -1 outside the layer stack
  std::string module;               // owning module path: "model.layers.0.self_attn.q_proj"

  std::int64_t numel() const {
    std::int64_t n = 1;
    for (std::int64_t d : shape) n *= d;
    return n;
  }
};

// A Linear (or Conv1D) module: what LoRA and IA3 attach to.
struct LinearModule {
  std::string path;           // "model.layers.0.self_attn.q_proj"
  std::string leaf;           // "q_proj"
  std::int32_t layer = -1;    // -1 for lm_head / OPT projections
  std::int64_t in = 0;        // in_features
  std::int64_t out = 0;       // out_features
  bool has_bias = false;
  bool conv1d = false;        // GPT-2 Conv1D: weight stored [in, out]
  bool is_output = false;     // the LM head (excluded from "all-linear")
  std::int32_t expert = -1;   // MoE expert index, -1 when not an expert
};

std::vector<TensorInfo> parameter_tensors(const ModelSpec& model);

// Every Linear module, including a tied lm_head (which owns no tensor of its own).
std::vector<LinearModule> linear_modules(const ModelSpec& model);
// The same from an inventory already computed (planner hot path).
std::vector<LinearModule> linear_modules(const ModelSpec& model, const std::vector<TensorInfo>& tensors);

// Every module path with parameters (for modules_to_save matching): linears, embeddings, norms.
std::vector<std::string> module_paths(const ModelSpec& model);

struct BaseCounts {
  std::int64_t total = 0;    // unique parameters (model.num_parameters())
  std::int64_t active = 0;   // per token: MoE counts top-k experts; otherwise = total
  std::int64_t embedding = 0;  // token and position embeddings (+ untied head)
  std::int64_t largest_layer = 0;  // largest module's own parameters (DeepSpeed's L_max)
};
BaseCounts count_base(const ModelSpec& model);

}  // namespace peftplan::models
