// Cost of one compute op or copy on a cluster's GPU and host: a roofline per op,
//   time = max(flops / (peak × efficiency(shape)), bytes_moved / (hbm × hbm_efficiency))
//          + kernel launch,
// with the GEMM efficiency a smooth saturating function of the GEMM's dimensions so that LoRA's
// skinny rank-r GEMMs come out memory-bound, elementwise ops on the memory roof, and an optimizer
// step on the host costed per parameter at the CPU-Adam rate.
// A calibrated CPU host (Cluster::host_calibration) multiplies each kernel's roofline time by
// its measured factor, and copies by theirs (see cluster.h).
// Not modelled: wave/tile quantisation, L2 reuse, clock throttling, kernel fusion beyond what the
// planner's bytes_moved already says.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "peftplan/common/dtype.h"
#include "peftplan/sim/cluster.h"
#include "peftplan/sim/program.h"

namespace peftplan::sim {

struct ComputeCost {
  double time_s = 0.0;       // max(math_s, memory_s) + launch_s
  double math_s = 0.0;       // flops / (peak × efficiency)
  double memory_s = 0.0;     // bytes_moved / achieved memory bandwidth
  double launch_s = 0.0;     // fixed per-launch overhead
  double efficiency = 0.0;   // fraction of the peak the math runs at
  bool memory_bound = false; // memory_s > math_s
};

// Kernels that run on tensor cores as GEMMs: linear_*, lora_*, attention_*.
bool is_gemm_kernel(Kernel k);

// Fraction of the dtype's peak a GEMM of this shape reaches:
//   gemm_max × f(m × count) × f(n) × f(k),  f(x) = x / (x + gemm_half_dim).
// `count` identical GEMMs (batched) fill the GPU like a larger m. With the defaults (gemm_max
// from the MAMF table, half_dim 32) a 4096^3 GEMM reaches 97.7% of gemm_max and a dimension of
// 16 (LoRA r = 16) a third of it. Shapes of 0 (unknown) give gemm_max.
double gemm_efficiency(std::int64_t m, std::int64_t n, std::int64_t k, std::int32_t count,
                       const Efficiency& e);

// A compute op on the device. GEMM kernels use the tensor-core peak of `compute` (tf32 for fp32
// when allow_tf32); other kernels' flops run at the non-tensor fp32 rate. `program` is the
// compute dtype of the op's program (Program::compute_dtype): a calibrated profile's bf16 kernel
// factors apply to the ops of bf16 programs (HostCalibration::bf16_kernel_scale).
ComputeCost device_compute_cost(const ComputeWork& work, Kernel kernel, const Cluster& cluster,
                                DType compute, bool allow_tf32 = false, DType program = DType::fp32);

// A compute op on the host CPU: optimizer_step with work.params > 0 at the CPU-Adam rate;
// anything else streams work.bytes_moved through host memory.
ComputeCost host_compute_cost(const ComputeWork& work, Kernel kernel, const Cluster& cluster);

// A pinned host<->device copy over PCIe (either direction; PCIe is full duplex).
double copy_time_s(std::uint64_t bytes, const Cluster& cluster);

// The kernels of `program`'s device compute ops that a calibrated profile (some kernel scale
// set) has no scale for, each once: the profile was written by a calibrate that did not know the
// kernel (calibrate gives every kernel it knows a scale), and would time it on the uncalibrated
// roofline. Empty for an uncalibrated cluster (a GPU catalog entry).
std::vector<Kernel> uncalibrated_kernels(const Program& program, const Cluster& cluster);
// A bf16 program (Program::compute_dtype) on a calibrated profile that has no bf16 kernel
// calibration (written before calibrate ran a bf16 program): its kernels would be timed with the
// fp32 programs' factors, which miss the CPU backend's conversions (bf16 steps 11-24% over).
bool lacks_bf16_calibration(const Program& program, const Cluster& cluster);

}  // namespace peftplan::sim
