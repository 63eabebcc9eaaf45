// What a decoder layer's forward allocates, and what of it is saved for backward: one table per
// layer and runtime profile, one row per tensor (its name, shape, dtype, and the rule that keeps
// it), the way llm.c lists its activation tensors (train_gpt2.c fill_in_activation_sizes). The
// builder emits a layer's allocations from this table (builder_graph.cpp), so the table is what
// the program allocates, not a second account of it.
//
// A row that is not kept is produced and freed inside the forward (a workspace tensor). Under
// activation checkpointing a checkpointed layer keeps none of them in its forward and rebuilds
// the kept rows in its recompute.
// Deliberately not here: the embedding, the final norm, the head and the loss (the graph's own),
// gradients, and when a tensor is freed in the backward.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "peftplan/planner/specs.h"

namespace peftplan::planner {

struct SavedTensor {
  std::string_view name;    // within the layer ("norm1.stats") or its module ("lora_u")
  std::string_view module;  // the linear module's path ("model.layers.0.self_attn.q_proj"), or ""
  std::array<std::int64_t, 4> shape{};  // elements per dimension; `rank` of them used
  std::uint8_t rank = 0;
  DType dtype = DType::bf16;
  bool kept = false;        // saved for backward (not checkpointed)
  std::string_view rule;    // why it is kept or not, with the code that decides it
  std::int64_t elements() const {
    std::int64_t n = 1;
    for (std::uint8_t i = 0; i < rank; ++i) n *= shape[i];
    return n;
  }
  std::uint64_t bytes() const { return storage_bytes(dtype, elements()); }
};

struct SavedTable {
  std::int64_t layer = 0;
  std::vector<SavedTensor> rows;  // forward order
  std::shared_ptr<const void> owner;  // keeps the module paths the rows view alive (the inventory)
  std::uint64_t kept_bytes() const;
  // The row of `name` (and `module`), or nullptr.
  const SavedTensor* find(std::string_view name, std::string_view module = {}) const;
};

// Layer `layer`'s table for `input` (its model, adapters, training settings and runtime profile).
SavedTable saved_for_backward(const PlanInput& input, std::int64_t layer);

// "[4096, 4096]", "[2, 32, 512, 512]".
std::string shape_text(const SavedTensor& t);

}  // namespace peftplan::planner
