// Closed-form model-states memory: the ZeRO paper's per-GPU formulas (and their PEFT-aware
// generalisation), and exact reproductions of DeepSpeed's model-states estimators.
// These are the fast path for sweeps and the explanation next to the step-program walk; they do
// not model activations, temporary buffers, communication buckets or fragmentation (neither do
// the sources they reproduce).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "peftplan/common/dtype.h"
#include "peftplan/models/model_spec.h"
#include "peftplan/models/peft.h"
#include "peftplan/planner/specs.h"

namespace peftplan::planner {

// ---------------------------------------------------------------------------------------------
// (a) ZeRO paper: Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
// Parameter Models", SC'20, arXiv 1910.02054.
//
// §3.1: mixed-precision Adam keeps fp16 parameters (2Ψ bytes) and gradients (2Ψ) plus K·Ψ bytes
// of optimizer states (fp32 parameters, momentum, variance: K = 12). §5 / Figure 1, per GPU with
// N data-parallel ranks:
//   baseline (DDP)     (2 + 2 + K)·Ψ
//   P_os   (ZeRO-1)    4Ψ + K·Ψ/N
//   P_os+g (ZeRO-2)    2Ψ + (2 + K)·Ψ/N
//   P_os+g+p (ZeRO-3)  (2 + 2 + K)·Ψ/N
// A partitioned term is computed per element shard: each rank holds ceil(Ψ/N) elements (DeepSpeed
// pads flat partitions to a multiple of N), so bytes = bytes_per_element · ceil(Ψ/N).
// ---------------------------------------------------------------------------------------------

inline constexpr std::int64_t kAdamMixedK = 12;  // K for mixed-precision Adam (ZeRO §3.1)

// Per-GPU model-states bytes by the ZeRO paper's §5 formulas. psi = Ψ (parameters, all
// trainable), ranks = N >= 1, k = K (optimizer-state bytes per parameter).
std::uint64_t zero_paper_model_states_bytes(std::int64_t psi, std::int32_t ranks, Stage stage,
                                            std::int64_t k = kAdamMixedK);

// PEFT-aware generalisation (our derivation from ZeRO §3.1/§5; not in the paper). A frozen base of
// Ψ_b parameters is stored in `base_dtype` (w bytes: 2 for bf16, 1 for int8, 1/2 for nf4) and has
// no gradients or optimizer states; Ψ_t trainable (adapter) parameters have weights and gradients
// in `trainable_dtype` (a bytes) and K bytes of optimizer state each. Per GPU:
//   DDP     w·Ψ_b + a·Ψ_t + a·Ψ_t + K·Ψ_t
//   ZeRO-1  optimizer term / N
//   ZeRO-2  gradient and optimizer terms / N
//   ZeRO-3  every term / N (the frozen base too)
// With Ψ_b = 0, a = 2 and K = 12 it is exactly the paper's formula above. Quantisation constants
// of nf4/int8 bases (absmax blocks) are not included: models/ counts them separately. ZeRO-3's
// gathered-layer working set is not a model state and is not included either.
// Optimizer offload (ZeRO-Offload, arXiv 2101.06840 §4: the GPU keeps 16-bit parameters; gradients
// and the fp32 optimizer states live on the host) moves the gradient and optimizer terms to the
// host; parameter offload (ZeRO-3 only) moves the weight terms too.
struct PeftModelStatesInput {
  std::int64_t base_params = 0;              // Ψ_b: frozen parameters
  DType base_dtype = DType::bf16;            // w: storage dtype of the frozen base
  std::int64_t trainable_params = 0;         // Ψ_t: trainable parameters (adapters)
  DType trainable_dtype = DType::bf16;       // a: dtype of trainable weights and their gradients
  std::int64_t optimizer_bytes_per_param = kAdamMixedK;  // K
};

struct ModelStatesBytes {
  std::uint64_t base_weights_bytes = 0;       // frozen base on each GPU (full or ZeRO-3 shard)
  std::uint64_t trainable_weights_bytes = 0;  // trainable weights on each GPU
  std::uint64_t gradients_bytes = 0;          // trainable gradients on each GPU
  std::uint64_t optimizer_states_bytes = 0;   // optimizer states on each GPU
  std::uint64_t host_bytes = 0;               // what offload moved to each rank's host share

  std::uint64_t gpu_total_bytes() const {
    return base_weights_bytes + trainable_weights_bytes + gradients_bytes + optimizer_states_bytes;
  }
};

// K for Adam-family optimizers: 12 (fp32 master + m + v) when trainable weights are 16-bit,
// 8 (m + v) when they are already fp32 (no separate master copy).
std::int64_t adam_optimizer_bytes_per_param(DType trainable_dtype);

// Requires ranks >= 1, non-negative counts, and offload_param only with ZeRO-3 (PEFTPLAN_CHECK).
ModelStatesBytes peft_model_states_bytes(const PeftModelStatesInput& in, std::int32_t ranks, Stage stage,
                                         OffloadDevice offload_optimizer = OffloadDevice::none,
                                         OffloadDevice offload_param = OffloadDevice::none);

// ---------------------------------------------------------------------------------------------
// (b) DeepSpeed's model-states estimators, reproduced formula for formula, including Python's
// int() truncation and float evaluation order, from deepspeedai/DeepSpeed:
//   deepspeed/runtime/zero/stage_1_and_2.py  estimate_zero2_model_states_mem_needs(_all_cold)
//   deepspeed/runtime/zero/stage3.py         estimate_zero3_model_states_mem_needs(_all_cold)
// They count every parameter alike (frozen or trainable: DeepSpeed issue #5304), so they are not
// PEFT-aware. DeepSpeed prints 2**30-byte units labelled "GB"; ds_*_all_cold_text keeps that
// exact text for --deepspeed-compat, everything else in peftplan prints GiB.
// ---------------------------------------------------------------------------------------------

struct DsEstimate {
  std::uint64_t cpu_bytes = 0;  // per node (DeepSpeed's "per CPU")
  std::uint64_t gpu_bytes = 0;  // per GPU
};

enum class Zero2Formula {
  current,  // gpu = 2P + int(18P/N), since DeepSpeed PR #5099 (2024-04)
  legacy,   // gpu = 4P + int(16P/N), before PR #5099 (still in docs/code-docs/source/memory.rst)
};

// estimate_zero2_model_states_mem_needs(total_params, num_gpus_per_node, num_nodes, cpu_offload,
// additional_buffer_factor) -> (cpu, gpu). The only DeepSpeed estimator for stages 1 and 2.
DsEstimate ds_estimate_zero2(std::int64_t total_params, std::int32_t gpus_per_node, std::int32_t nodes,
                             bool cpu_offload, double additional_buffer_factor = 1.5,
                             Zero2Formula formula = Zero2Formula::current);

struct DsEstimate3 {
  std::uint64_t cpu_bytes = 0;            // per node
  std::uint64_t gpu_bytes = 0;            // per GPU
  std::uint64_t largest_layer_bytes = 0;  // 4 * largest_layer_params (fp16 params + fp16 grads)
};

// estimate_zero3_model_states_mem_needs(total_params, largest_layer_params, num_gpus_per_node,
// num_nodes, cpu_offload, cpu_offload_params, zero_init, additional_buffer_factor)
// -> (cpu, gpu, largest_layer_memory).
DsEstimate3 ds_estimate_zero3(std::int64_t total_params, std::int64_t largest_layer_params,
                              std::int32_t gpus_per_node, std::int32_t nodes, bool cpu_offload,
                              bool cpu_offload_params, bool zero_init, double additional_buffer_factor = 1.5);

// What DeepSpeed's estimators take from a model (deepspeed/runtime/zero/stage3.py
// model_to_params): every parameter once (shared ones counted once, by data_ptr), and the largest
// sum of one module's own parameters (m.parameters(recurse=False)) over model.modules(). With
// PEFT the model is the PeftModel: the adapters' lora_A / lora_B modules count as modules of
// their own, and a wrapped Linear keeps its frozen weight in its base_layer.
struct DsModelParams {
  std::int64_t total_params = 0;
  std::int64_t largest_layer_params = 0;
};
DsModelParams ds_model_to_params(const models::ModelSpec& model, const models::PeftSpec& peft);

// One row of an _all_cold table, in DeepSpeed's order.
struct DsTableRow {
  bool offload_param = false;      // ZeRO-3 rows only
  bool offload_optimizer = false;
  bool zero_init = false;          // ZeRO-3 rows only
  DsEstimate estimate;
};

// The rows estimate_zero2_model_states_mem_needs_all_cold prints: offload_optimizer cpu, none.
std::vector<DsTableRow> ds_zero2_all_cold(std::int64_t total_params, std::int32_t gpus_per_node,
                                          std::int32_t nodes, double additional_buffer_factor = 1.5,
                                          Zero2Formula formula = Zero2Formula::current);

// The rows estimate_zero3_model_states_mem_needs_all_cold prints: (param, optimizer, zero_init) =
// (cpu, cpu, 1), (cpu, cpu, 0), (none, cpu, 1), (none, cpu, 0), (none, none, 1), (none, none, 0).
std::vector<DsTableRow> ds_zero3_all_cold(std::int64_t total_params, std::int64_t largest_layer_params,
                                          std::int32_t gpus_per_node, std::int32_t nodes,
                                          double additional_buffer_factor = 1.5);

// DeepSpeed's printed text, byte for byte, including the "Estimated memory needed ..." and
// "HW:"/"SW:" header lines and the "  per CPU  |  per GPU |   Options" table. The options column
// is printed as Python <= 3.10 formats f'{OffloadDeviceEnum.cpu:4}' ("cpu "), which is what the
// DeepSpeed docs show; Python >= 3.11 formats a str-mixin Enum as "OffloadDeviceEnum.cpu".
std::string ds_zero2_all_cold_text(std::int64_t total_params, std::int32_t gpus_per_node, std::int32_t nodes,
                                   double additional_buffer_factor = 1.5,
                                   Zero2Formula formula = Zero2Formula::current);
std::string ds_zero3_all_cold_text(std::int64_t total_params, std::int64_t largest_layer_params,
                                   std::int32_t gpus_per_node, std::int32_t nodes,
                                   double additional_buffer_factor = 1.5);

}  // namespace peftplan::planner
