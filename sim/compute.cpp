// Roofline compute costs (see compute.h).
// The roofline: Williams, Waterman, Patterson, "Roofline: an insightful visual performance model
// for multicore architectures", CACM 52(4), 2009: attainable FLOP/s = min(peak, intensity × BW),
// i.e. time = max(flops / peak, bytes / BW).
// Efficiencies come from Cluster::efficiency (defaults and their sources in cluster.h/.cpp).
#include "peftplan/sim/compute.h"

#include <algorithm>
#include <array>

namespace peftplan::sim {
namespace {

double saturate(double x, double half) { return x / (x + half); }

// A bf16 program's kernel with a bf16 calibration of its own (HostCalibration::bf16_kernel_scale).
bool bf16_calibrated(const Cluster& cluster, Kernel k, DType program) {
  const auto i = static_cast<std::size_t>(k);
  return program == DType::bf16 && i < kKernelSlots && cluster.host_calibration.bf16_kernel_scale[i] > 0.0;
}

// The calibrated factor of a kernel (1 when not calibrated).
double kernel_scale(const Cluster& cluster, Kernel k, DType program) {
  const auto i = static_cast<std::size_t>(k);
  if (bf16_calibrated(cluster, k, program)) return cluster.host_calibration.bf16_kernel_scale[i];
  const double x = i < kKernelSlots ? cluster.host_calibration.kernel_scale[i] : 0.0;
  return x > 0.0 ? x : 1.0;
}

// The calibrated per-call overhead of a kernel (0 when not calibrated).
double kernel_overhead_s(const Cluster& cluster, Kernel k, DType program) {
  const auto i = static_cast<std::size_t>(k);
  if (bf16_calibrated(cluster, k, program)) return cluster.host_calibration.bf16_kernel_overhead_s[i];
  return i < kKernelSlots ? cluster.host_calibration.kernel_overhead_s[i] : 0.0;
}

}  // namespace

bool is_gemm_kernel(Kernel k) {
  switch (k) {
    case Kernel::linear_fwd:
    case Kernel::linear_bwd_data:
    case Kernel::linear_bwd_weight:
    case Kernel::lora_fwd:
    case Kernel::lora_bwd:
    case Kernel::attention_fwd:
    case Kernel::attention_bwd:
    case Kernel::flash_attention_fwd:
    case Kernel::flash_attention_bwd: return true;
    default: return false;
  }
}

double gemm_efficiency(std::int64_t m, std::int64_t n, std::int64_t k, std::int32_t count,
                       const Efficiency& e) {
  if (m <= 0 || n <= 0 || k <= 0) return e.gemm_max;
  const double h = e.gemm_half_dim;
  const double rows = static_cast<double>(m) * std::max<std::int32_t>(count, 1);
  return e.gemm_max * saturate(rows, h) * saturate(static_cast<double>(n), h) *
         saturate(static_cast<double>(k), h);
}

ComputeCost device_compute_cost(const ComputeWork& work, Kernel kernel, const Cluster& cluster,
                                DType compute, bool allow_tf32, DType program) {
  const Efficiency& e = cluster.efficiency;
  ComputeCost c;
  double peak;
  if (is_gemm_kernel(kernel)) {
    peak = peak_flops_per_s(cluster.gpu, work.fp32_math ? DType::fp32 : compute, allow_tf32);
    c.efficiency = gemm_efficiency(work.gemm_m, work.gemm_n, work.gemm_k, work.gemm_count, e);
  } else {
    peak = cluster.gpu.fp32_flops_per_s;
    c.efficiency = 1.0;
  }
  c.math_s = work.flops > 0 ? work.flops / (peak * c.efficiency) : 0.0;
  c.memory_s = static_cast<double>(work.bytes_moved) / (cluster.gpu.hbm_bytes_per_s * e.hbm);
  c.launch_s = e.kernel_launch_s;
  c.memory_bound = c.memory_s > c.math_s;
  c.time_s = std::max(c.math_s, c.memory_s) * kernel_scale(cluster, kernel, program) + kernel_overhead_s(cluster, kernel, program) +
             c.launch_s;
  return c;
}

ComputeCost host_compute_cost(const ComputeWork& work, Kernel kernel, const Cluster& cluster) {
  ComputeCost c;
  c.efficiency = 1.0;
  if (kernel == Kernel::optimizer_step && work.params > 0) {
    // The host optimizer's rate is itself the measurement (calibrate times the executor's host
    // AdamW per parameter into cpu_adam_params_per_s): no kernel factor on top.
    c.math_s = static_cast<double>(work.params) / cluster.cpu_adam_params_per_s;
    c.time_s = c.math_s;
    return c;
  }
  c.memory_s = static_cast<double>(work.bytes_moved) / cluster.host_memory_bytes_per_s;
  c.memory_bound = true;
  c.time_s = c.memory_s * kernel_scale(cluster, kernel, DType::fp32) + kernel_overhead_s(cluster, kernel, DType::fp32);
  return c;
}

double copy_time_s(std::uint64_t bytes, const Cluster& cluster) {
  if (bytes == 0) return 0.0;
  const double s = cluster.host_calibration.copy_scale > 0.0 ? cluster.host_calibration.copy_scale : 1.0;
  return static_cast<double>(bytes) /
             (cluster.host_device_bytes_per_s * cluster.efficiency.host_device) * s +
         cluster.efficiency.kernel_launch_s;
}

bool lacks_bf16_calibration(const Program& program, const Cluster& cluster) {
  return program.compute_dtype == DType::bf16 && !cluster.host_calibration.empty() && !cluster.host_calibration.has_bf16_kernels();
}

std::vector<Kernel> uncalibrated_kernels(const Program& program, const Cluster& cluster) {
  const auto& scale = cluster.host_calibration.kernel_scale;
  if (std::none_of(scale.begin(), scale.end(), [](double x) { return x > 0.0; })) return {};
  std::array<bool, kKernelSlots> seen{};
  std::vector<Kernel> out;
  for (const Op& op : program.ops) {
    if (op.kind != OpKind::compute || op.stream == Stream::host || op.kernel == Kernel::none) continue;
    const auto i = static_cast<std::size_t>(op.kernel);
    if (i >= kKernelSlots || seen[i]) continue;
    seen[i] = true;
    if (!(scale[i] > 0.0)) out.push_back(op.kernel);
  }
  return out;
}

}  // namespace peftplan::sim
