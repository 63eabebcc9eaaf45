// The step program's layout (private to planner/): what a build derives from the model, the
// adapters, the dtypes, the runtime profile and the strategy's partitioning before it emits a
// single op — the linear modules and their adapters, the units of partitioning (with each rank's
// shard sizes), the gradient buckets, the flat trainable layout's offsets, and the dtypes and
// sizes of ProgramFacts. It is a value: a search that plans one configuration at many
// micro-batches, sequence lengths, checkpointing choices or offload settings builds it once per
// LayoutKey and every build copies it (layout_of). Builder's layout layer (builder_layout.cpp)
// computes it.
// Deliberately not here: buffers (the program's ids live in these structs but a layout holds
// none: every id is -1 until the build that copies it emits the buffers), anything that depends
// on the micro-batch, the sequence, checkpointing, accumulation or offload (the build's), and the
// saved-for-backward tables (saved.h: their shapes depend on the micro-batch).
#pragma once

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "peftplan/models/parameters.h"
#include "peftplan/planner/program.h"

namespace peftplan::planner::builder {

// Linear-module roles inside a decoder layer, by leaf name (transformers' module names).
enum class Role { attn_in, attn_out, mlp_in, mlp_out, router, other };
inline Role role_of(const models::LinearModule& l) {
  // Plain arrays, not sets: a cold build classifies every linear module of the model.
  static constexpr std::string_view attn_in[] = {"q_proj", "k_proj", "v_proj", "qkv_proj", "c_attn", "query_key_value"};
  static constexpr std::string_view mlp_in[] = {"gate_proj", "up_proj", "gate_up_proj", "c_fc", "dense_h_to_4h", "fc1", "w1", "w3"};
  static constexpr std::string_view mlp_out[] = {"down_proj", "dense_4h_to_h", "fc2", "w2"};
  const std::string_view leaf = l.leaf;
  auto in = [&](const auto& names) { return std::find(std::begin(names), std::end(names), leaf) != std::end(names); };
  if (in(attn_in)) return Role::attn_in;
  if (in(mlp_in)) return Role::mlp_in;
  if (in(mlp_out)) return Role::mlp_out;
  if (leaf == "c_proj") return l.path.find(".mlp.") != std::string::npos ? Role::mlp_out : Role::attn_out;
  if (leaf == "o_proj" || leaf == "dense" || leaf == "out_proj") return Role::attn_out;
  if (leaf == "gate") return Role::router;
  return Role::other;
}

struct Adapter {       // a LoRA (or IA3) branch on one linear module
  std::int64_t r = 0;  // 0 for IA3 (a scaling vector)
  double dropout = 0.0;
  double scale = 0.0;  // alpha / r (rsLoRA: alpha / sqrt(r))
  std::int32_t index = -1;  // the module's place among the inventory's LoRA modules, in the order
                            // their first lora_A tensor comes (the key of its dropout masks)
  std::int32_t a_buf = -1, b_buf = -1;  // views of lora_A / lora_B in trainable.flat (-1 under
                                        // ZeRO-3, where they live in the gathered unit)
  std::int32_t ga_buf = -1, gb_buf = -1;  // views of their gradients in grad.flat, or (ZeRO-2/3
                                          // with several ranks) in the micro-batch's bucket
  std::int64_t params = 0;
  std::int64_t a_off = -1, b_off = -1;    // element offsets of lora_A / lora_B in the flat
  std::int64_t a_numel = 0, b_numel = 0;  //   trainable layout (inventory order), and sizes
  std::int32_t a_tensor = -1, b_tensor = -1;  // their index in the trainable inventory
};

struct LinearPlan {
  const models::LinearModule* mod = nullptr;  // into the ModelInventory
  Role role = Role::other;
  std::int32_t weight_buf = -1;   // base weight buffer (replicated strategies)
  std::int32_t bias_buf = -1;
  bool trainable_weight = false;  // full fine-tuning or modules_to_save
  std::optional<Adapter> adapter;
  double token_share = 1.0;       // MoE expert: fraction of the tokens it sees (k / E)
  std::int32_t xin_buf = -1;      // the latest forward's dropped adapter input (-1: no dropout)
  std::int32_t u_buf = -1;        // the latest forward's adapter intermediate u [M, r]
  bool adapter_owns_input = false;  // the adapter saves its own copy of the input (runtime rule)
  DType input_dtype = DType::bf16;  // the module's input dtype
  bool needs_input() const { return trainable_weight || (adapter.has_value() && !adapter_owns_input); }
};

// A unit of ZeRO-3 partitioning and gathering: one decoder layer, or the embedding / the head.
struct Unit {
  std::string name;
  std::int64_t frozen_numel = 0;          // non-persistent frozen elements (gathered)
  std::uint64_t frozen_bytes = 0;         // their storage bytes
  std::int64_t persistent_numel = 0;      // tensors below the persistence threshold: kept whole
  std::uint64_t persistent_bytes = 0;
  std::int64_t trainable_numel = 0;       // adapter (or all, in full fine-tuning) elements
  // FSDP2 (fully_shard): this rank's padded shard of the unit, parameter by parameter: each
  // parameter's ceil(d0 / N) dim-0 rows (torch/distributed/fsdp/_fully_shard/_fsdp_param.py
  // _init_sharded_param: _chunk_with_empty on dim 0, every rank's buffer padded to chunk 0).
  std::uint64_t fsdp2_frozen_shard_bytes = 0;
  std::int64_t fsdp2_trainable_shard_numel = 0;
  std::int32_t frozen_shard = -1, trainable_shard = -1;  // ZeRO-3 shard buffers
  std::int64_t flat_offset = -1;          // first element of its adapters in the flat trainable
                                          // layout (-1: unknown or not contiguous)
  // ZeRO-3 in the executor profile: where each frozen tensor lies (bytes from the start of the
  // unit's flattened frozen region, or of its persistent buffer), this unit's block of the
  // adapter partition (trainable.shard and grad.shard, elements) and its views.
  struct Tensor {
    const models::TensorInfo* info = nullptr;
    std::uint64_t offset = 0, bytes = 0;
  };
  std::vector<Tensor> gathered_tensors, persistent_tensors;
  std::int64_t part_offset = 0;
  std::int32_t grad_shard_view = -1;
};

// ZeRO-2/3 gradient bucket: consecutive units (in backward order) whose gradients are one
// contiguous buffer, padded to a multiple of N, from the bucket's first unit until its
// reduce_scatter (DeepSpeed's ipg bucket of reduce_bucket_size elements).
struct GradBucket {
  std::vector<std::size_t> units;   // units with trainable elements, backward order
  std::int64_t numel = 0;           // their trainable elements
  std::size_t flush_unit = 0;       // the unit whose gradients_done issues the reduce_scatter
  std::int64_t flat_lo = -1;        // first flat element covered (-1: not contiguous)
  // ZeRO-2 in the executor profile (bucket-partitioned layout, see plan_buckets): the bucket's
  // block in every rank's partition (elements), its region of trainable.flat, and its views.
  std::int64_t part_offset = 0, region = 0;
  std::int32_t grad_view = -1, param_view = -1, state_view = -1, host_view = -1, master_view = -1;
};

// What a layout is keyed by: every input field the layout layer reads. The model and the adapters
// enter through the shared inventory (PlanInput::inventory, made by make_inventory from them: the
// same pointer, the same model and adapters) and the model's layer and expert counts; the runtime
// profile and precision through the dtypes and the runtime rules the layout reads (runtime_rules
// depends on the profile, the stage, FSDP's version and the precision); the quantisation through
// the frozen bytes; the strategy through the partitioning and the buckets.
struct LayoutKey {
  const ModelInventory* inventory = nullptr;
  std::int64_t layers = 0, experts = 0, experts_per_token = 0;
  bool full_finetune = false;  // no adapters
  RuntimeProfile profile = RuntimeProfile::deepspeed;
  Precision precision = Precision::bf16_mixed;
  std::optional<DType> base_storage;
  std::optional<models::Quantization> quantization;
  Stage stage = Stage::ddp;
  std::int32_t ranks = 1, shard_group = 0, fsdp_version = 1;
  std::int64_t persistence_threshold = 0, reduce_bucket_size = 0;
  bool operator==(const LayoutKey&) const = default;
};
LayoutKey layout_key(const PlanInput& in);

// Where a linear module's plan sits: layer_linears[layer][index], or head_linears[index] when
// layer is -1.
struct LinearRef {
  std::int32_t layer = -1, index = 0;
};

struct Layout {
  std::shared_ptr<const ModelInventory> inventory;  // the input's, or made for this layout; the
                                                    // plans' module and tensor pointers point into it
  ProgramFacts facts;  // every field but fsdp_unit_passes (it depends on checkpointing)
  bool fp32_norms = false;                 // see RuntimeRules::fp32_norms_on_kbit
  DType adapter_act_dtype = DType::bf16;   // the adapter branch's activations
  std::vector<std::vector<LinearPlan>> layer_linears;  // per layer, model order
  std::vector<LinearPlan> head_linears;                // lm_head (and OPT projections)
  // Module path (the inventory's) -> its plan; shared, not copied, by the builds that copy the rest.
  std::shared_ptr<const std::unordered_map<std::string_view, LinearRef>> by_path;
  std::vector<Unit> units;                 // 0 = embedding, 1..L = layers, L+1 = head
  std::int64_t trainable_numel = 0;        // all trainable elements
  std::int64_t extra_trainable_numel = 0;  // prompt/prefix embeddings, DoRA, biases
  std::vector<GradBucket> buckets;         // ZeRO-2/3 and FSDP with several ranks
  std::vector<std::int32_t> bucket_of, flush_of;  // per unit: its bucket, the bucket it flushes
  std::int64_t part_numel = 0;             // executor ZeRO-2 with N > 1: Σ bucket shards (ZeRO-3's
                                           //   partition is summed by the build's setup)
};

// The layout of `in`, made once per LayoutKey and shared by every later build with that key, when
// the input brings an inventory (PlanInput::inventory; without one there is nothing to key the
// model by, and a fresh layout is made). A small cache of the most recent keys, safe to call
// from several threads.
std::shared_ptr<const Layout> layout_of(const PlanInput& in);

}  // namespace peftplan::planner::builder
