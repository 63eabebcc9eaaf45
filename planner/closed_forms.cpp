// Closed-form model-states memory (ZeRO paper §5 and its PEFT generalisation) and DeepSpeed's
// estimators. The DeepSpeed functions follow the Python source line by line: integer products
// stay exact (Python ints), a product with additional_buffer_factor or gpus_factor becomes a
// double in the same evaluation order, and int() truncates toward zero where Python calls it.
#include "peftplan/planner/closed_forms.h"

#include <algorithm>
#include <map>
#include <string>

#include <fmt/format.h>

#include "peftplan/common/error.h"
#include "peftplan/models/parameters.h"

namespace peftplan::planner {

namespace {

std::uint64_t u64(std::int64_t v) { return static_cast<std::uint64_t>(v); }

// ceil(n / ranks): elements in one rank's padded partition.
std::int64_t shard(std::int64_t n, std::int32_t ranks) { return (n + ranks - 1) / ranks; }

// Python's int(x) for a non-negative float.
std::uint64_t py_int(double x) { return static_cast<std::uint64_t>(x); }

// Python's int(a / b) for non-negative ints: true division (a double), then truncation.
std::uint64_t py_int_div(std::int64_t a, std::int64_t b) {
  return py_int(static_cast<double>(a) / static_cast<double>(b));
}

void check_ds_args(std::int64_t total_params, std::int32_t gpus_per_node, std::int32_t nodes, double abf) {
  PEFTPLAN_CHECK(total_params >= 0);
  PEFTPLAN_CHECK(gpus_per_node >= 1);
  PEFTPLAN_CHECK(nodes >= 1);
  PEFTPLAN_CHECK(abf >= 0.0);
}

// f'{OffloadDeviceEnum.cpu:4}' as Python <= 3.10 prints it (the str value padded to 4).
constexpr const char* kPaddedCpu = "cpu ";

std::string header(std::int32_t gpus_per_node, std::int32_t nodes) {
  // stage_1_and_2.py / stage3.py *_all_cold: the print() before the table, with nodes_str, gpus_str.
  return fmt::format(
      "Estimated memory needed for params, optim states and gradients for a:\n"
      "HW: Setup with {} {}, {} {} per node.\n",
      nodes, nodes > 1 ? "nodes" : "node", gpus_per_node, gpus_per_node > 1 ? "GPUs" : "GPU");
}

std::string millions(std::int64_t n) {
  return fmt::format("{}", static_cast<std::int64_t>(static_cast<double>(n) / 1e6));  // int(n/1e6)
}

std::string row(const DsEstimate& e, const std::string& options) {
  // print(f" {cpu_mem/2**30:7.2f}GB | {gpu_mem/2**30:6.2f}GB | {options_str}")
  constexpr double k2pow30 = 1073741824.0;
  return fmt::format(" {:7.2f}GB | {:6.2f}GB | {}\n", static_cast<double>(e.cpu_bytes) / k2pow30,
                     static_cast<double>(e.gpu_bytes) / k2pow30, options);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// ZeRO paper §5 (arXiv 1910.02054), Figure 1.

std::uint64_t zero_paper_model_states_bytes(std::int64_t psi, std::int32_t ranks, Stage stage, std::int64_t k) {
  PeftModelStatesInput in;
  in.trainable_params = psi;
  in.trainable_dtype = DType::fp16;  // 2Ψ parameters and 2Ψ gradients (§3.1)
  in.optimizer_bytes_per_param = k;
  return peft_model_states_bytes(in, ranks, stage).gpu_total_bytes();
}

std::int64_t adam_optimizer_bytes_per_param(DType trainable_dtype) {
  // fp32 master (4) + momentum (4) + variance (4) for 16-bit weights; no master copy for fp32.
  return bits_of(trainable_dtype) >= 32 ? 8 : kAdamMixedK;
}

ModelStatesBytes peft_model_states_bytes(const PeftModelStatesInput& in, std::int32_t ranks, Stage stage,
                                         OffloadDevice offload_optimizer, OffloadDevice offload_param) {
  PEFTPLAN_CHECK(ranks >= 1);
  PEFTPLAN_CHECK(in.base_params >= 0 && in.trainable_params >= 0 && in.optimizer_bytes_per_param >= 0);
  PEFTPLAN_CHECK(offload_param == OffloadDevice::none || can_offload_params(stage));
  const bool shard_optimizer = stage != Stage::ddp;                        // P_os
  const bool shard_gradients = stage == Stage::zero2 || stage == Stage::zero3;  // P_g
  const bool shard_weights = stage == Stage::zero3;                        // P_p

  const std::int64_t base_n = shard_weights ? shard(in.base_params, ranks) : in.base_params;
  const std::int64_t train_w_n = shard_weights ? shard(in.trainable_params, ranks) : in.trainable_params;
  const std::int64_t grad_n = shard_gradients ? shard(in.trainable_params, ranks) : in.trainable_params;
  const std::int64_t opt_n = shard_optimizer ? shard(in.trainable_params, ranks) : in.trainable_params;

  ModelStatesBytes b;
  b.base_weights_bytes = storage_bytes(in.base_dtype, base_n);            // w·Ψ_b (/N)
  b.trainable_weights_bytes = storage_bytes(in.trainable_dtype, train_w_n);  // a·Ψ_t (/N)
  b.gradients_bytes = storage_bytes(in.trainable_dtype, grad_n);          // a·Ψ_t (/N)
  b.optimizer_states_bytes = u64(in.optimizer_bytes_per_param) * u64(opt_n);  // K·Ψ_t (/N)

  if (offload_optimizer == OffloadDevice::cpu && stage != Stage::ddp) {
    b.host_bytes += b.gradients_bytes + b.optimizer_states_bytes;
    b.gradients_bytes = 0;
    b.optimizer_states_bytes = 0;
  }
  if (offload_param == OffloadDevice::cpu) {
    b.host_bytes += b.base_weights_bytes + b.trainable_weights_bytes;
    b.base_weights_bytes = 0;
    b.trainable_weights_bytes = 0;
  }
  return b;
}

// ---------------------------------------------------------------------------------------------
// DeepSpeed: deepspeed/runtime/zero/stage_1_and_2.py estimate_zero2_model_states_mem_needs.

DsEstimate ds_estimate_zero2(std::int64_t total_params, std::int32_t gpus_per_node, std::int32_t nodes,
                             bool cpu_offload, double additional_buffer_factor, Zero2Formula formula) {
  check_ds_args(total_params, gpus_per_node, nodes, additional_buffer_factor);
  const std::int64_t P = total_params;
  const std::int64_t total_gpus = std::int64_t{nodes} * gpus_per_node;
  DsEstimate e;
  if (cpu_offload) {
    // gpu_mem = 2 * total_params
    // cpu_mem = total_params * max(4 * total_gpus, 16) * additional_buffer_factor
    e.gpu_bytes = u64(2 * P);
    e.cpu_bytes = py_int(static_cast<double>(P * std::max<std::int64_t>(4 * total_gpus, 16)) *
                         additional_buffer_factor);
  } else {
    if (formula == Zero2Formula::current) {
      // gpu_mem = 2 * total_params + int(18 * total_params / total_gpus)   (PR #5099)
      e.gpu_bytes = u64(2 * P) + py_int_div(18 * P, total_gpus);
    } else {
      // gpu_mem = 4 * total_params + int(16 * total_params / total_gpus)   (before PR #5099)
      e.gpu_bytes = u64(4 * P) + py_int_div(16 * P, total_gpus);
    }
    // cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    e.cpu_bytes = py_int(static_cast<double>(P * 4 * gpus_per_node) * additional_buffer_factor);
  }
  return e;
}

// DeepSpeed: deepspeed/runtime/zero/stage3.py estimate_zero3_model_states_mem_needs.
DsEstimate3 ds_estimate_zero3(std::int64_t total_params, std::int64_t largest_layer_params,
                              std::int32_t gpus_per_node, std::int32_t nodes, bool cpu_offload,
                              bool cpu_offload_params, bool zero_init, double additional_buffer_factor) {
  check_ds_args(total_params, gpus_per_node, nodes, additional_buffer_factor);
  PEFTPLAN_CHECK(largest_layer_params >= 0);
  const std::int64_t P = total_params;
  const std::int64_t L = largest_layer_params;
  const std::int64_t g = gpus_per_node;
  const std::int64_t total_gpus = std::int64_t{nodes} * gpus_per_node;
  const double gpus_factor = 1.0 / static_cast<double>(nodes);  // gpus_factor = 1 / num_nodes
  const std::int64_t largest_layer_memory = 4 * L;                // (4 * largest_layer_params)
  const double abf = additional_buffer_factor;

  // total_params * max(4 * num_gpus_per_node, m * gpus_factor) * additional_buffer_factor:
  // Python's max keeps the int 4*g unless the float is strictly larger; int * int stays exact.
  auto max_term = [&](double m) {
    const double f = m * gpus_factor;
    if (f > static_cast<double>(4 * g)) return py_int(static_cast<double>(P) * f * abf);
    return py_int(static_cast<double>(P * 4 * g) * abf);
  };

  DsEstimate3 e;
  e.largest_layer_bytes = u64(largest_layer_memory);
  if (cpu_offload) {
    if (cpu_offload_params) {
      e.gpu_bytes = u64(largest_layer_memory);
      // total_params * 18 * gpus_factor * additional_buffer_factor
      e.cpu_bytes = zero_init ? py_int(static_cast<double>(P * 18) * gpus_factor * abf) : max_term(18.0);
    } else {
      e.gpu_bytes = u64(largest_layer_memory) + py_int_div(2 * P, total_gpus);
      e.cpu_bytes = zero_init ? py_int(static_cast<double>(P * 16) * gpus_factor * abf) : max_term(16.0);
    }
  } else {
    e.gpu_bytes = u64(largest_layer_memory) + py_int_div(18 * P, total_gpus);
    e.cpu_bytes = zero_init ? py_int(static_cast<double>(L * 4 * g) * abf)    // largest_layer_params * 4 * g * abf
                            : py_int(static_cast<double>(P * 4 * g) * abf);   // total_params * 4 * g * abf
  }
  return e;
}

std::vector<DsTableRow> ds_zero2_all_cold(std::int64_t total_params, std::int32_t gpus_per_node,
                                          std::int32_t nodes, double additional_buffer_factor,
                                          Zero2Formula formula) {
  std::vector<DsTableRow> rows;
  for (bool cpu_offload : {true, false}) {  // for cpu_offload in [True, False]
    DsTableRow r;
    r.offload_optimizer = cpu_offload;
    r.estimate = ds_estimate_zero2(total_params, gpus_per_node, nodes, cpu_offload, additional_buffer_factor,
                                   formula);
    rows.push_back(r);
  }
  return rows;
}

std::vector<DsTableRow> ds_zero3_all_cold(std::int64_t total_params, std::int64_t largest_layer_params,
                                          std::int32_t gpus_per_node, std::int32_t nodes,
                                          double additional_buffer_factor) {
  std::vector<DsTableRow> rows;
  for (bool cpu_offload : {true, false}) {
    for (bool cpu_offload_params : {true, false}) {
      if (!cpu_offload && cpu_offload_params) continue;
      for (bool zero_init : {true, false}) {
        const DsEstimate3 e = ds_estimate_zero3(total_params, largest_layer_params, gpus_per_node, nodes,
                                                cpu_offload, cpu_offload_params, zero_init,
                                                additional_buffer_factor);
        rows.push_back({cpu_offload_params, cpu_offload, zero_init, {e.cpu_bytes, e.gpu_bytes}});
      }
    }
  }
  return rows;
}

std::string ds_zero2_all_cold_text(std::int64_t total_params, std::int32_t gpus_per_node, std::int32_t nodes,
                                   double additional_buffer_factor, Zero2Formula formula) {
  std::string out = header(gpus_per_node, nodes);
  out += fmt::format("SW: Model with {}M total params.\n", millions(total_params));
  out += "  per CPU  |  per GPU |   Options\n";
  for (const DsTableRow& r : ds_zero2_all_cold(total_params, gpus_per_node, nodes, additional_buffer_factor,
                                               formula))
    out += row(r.estimate, fmt::format("offload_optimizer={}", r.offload_optimizer ? kPaddedCpu : "none"));
  return out;
}

std::string ds_zero3_all_cold_text(std::int64_t total_params, std::int64_t largest_layer_params,
                                   std::int32_t gpus_per_node, std::int32_t nodes,
                                   double additional_buffer_factor) {
  std::string out = header(gpus_per_node, nodes);
  out += fmt::format("SW: Model with {}M total params, {}M largest layer params.\n", millions(total_params),
                     millions(largest_layer_params));
  out += "  per CPU  |  per GPU |   Options\n";
  for (const DsTableRow& r :
       ds_zero3_all_cold(total_params, largest_layer_params, gpus_per_node, nodes, additional_buffer_factor))
    out += row(r.estimate, fmt::format("offload_param={}, offload_optimizer={}, zero_init={}",
                                       r.offload_param ? kPaddedCpu : "none",
                                       r.offload_optimizer ? kPaddedCpu : "none", r.zero_init ? 1 : 0));
  return out;
}

DsModelParams ds_model_to_params(const models::ModelSpec& model, const models::PeftSpec& peft) {
  std::map<std::string, std::int64_t> per_module;  // a module's own parameters (recurse=False)
  DsModelParams out;
  for (const auto& t : models::parameter_tensors(model)) {  // unique tensors: a tied head is the embedding's
    per_module[t.module] += t.numel();
    out.total_params += t.numel();
  }
  if (!peft.adapters.empty())
    for (const auto& t : models::trainable_tensors(model, peft)) {
      if (t.is_base_param) continue;  // a base tensor made trainable, counted above
      // "….q_proj.lora_A.default.weight" lives in the module "….q_proj.lora_A.default".
      const auto dot = t.name.rfind('.');
      per_module[dot == std::string::npos ? t.name : t.name.substr(0, dot)] += t.numel();
      out.total_params += t.numel();
    }
  for (const auto& [module, n] : per_module) out.largest_layer_params = std::max(out.largest_layer_params, n);
  return out;
}

}  // namespace peftplan::planner
