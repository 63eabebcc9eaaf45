// fp32 <-> bf16 / fp16 conversions used for bf16 base weights and for reading safetensors.
// Bit-level and exact: rounding is round-to-nearest-even, NaN stays NaN, overflow goes to inf.
// Not here: fp8 or 4-bit formats (QLoRA storage is modelled by the planner, not run here).
#include <bit>
#include <cstdint>

#include <Eigen/Core>

#include "peftplan/executor/kernels.h"

namespace peftplan::executor::cpu {

namespace {
constexpr Index kParallelMin = 1 << 15;  // below this, threads cost more than they save
}

std::uint16_t fp32_to_bf16(float x) {
  const std::uint32_t b = std::bit_cast<std::uint32_t>(x);
  if ((b & 0x7fffffffu) > 0x7f800000u)  // NaN: keep sign and top payload, force the quiet bit
    return static_cast<std::uint16_t>((b >> 16) | 0x0040u);
  // Round to nearest even on the 16 dropped bits (c10/util/BFloat16.h round_to_nearest_even).
  const std::uint32_t rounded = b + 0x7fffu + ((b >> 16) & 1u);
  return static_cast<std::uint16_t>(rounded >> 16);
}

float bf16_to_fp32(std::uint16_t bits) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16);
}

std::uint16_t fp32_to_fp16(float x) {
  const std::uint32_t b = std::bit_cast<std::uint32_t>(x);
  const std::uint32_t sign = (b >> 16) & 0x8000u;
  std::uint32_t ax = b & 0x7fffffffu;
  if (ax > 0x7f800000u)  // NaN: quiet, keep the top of the payload
    return static_cast<std::uint16_t>(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));
  if (ax >= 0x477ff000u)  // >= 65520 = max half (65504) + half an ulp: rounds to inf (inf too)
    return static_cast<std::uint16_t>(sign | 0x7c00u);
  if (ax < 0x38800000u) {  // below 2^-14: a half subnormal or zero
    // Adding 0.5f aligns the binary point so the FPU rounds to a multiple of 2^-24 (RNE).
    const float a = std::bit_cast<float>(ax) + 0.5f;
    return static_cast<std::uint16_t>(sign | (std::bit_cast<std::uint32_t>(a) - 0x3f000000u));
  }
  // Normal: rebias the exponent (127 -> 15) and round 23 -> 10 mantissa bits to nearest even;
  // a carry out of the mantissa correctly bumps the exponent.
  const std::uint32_t odd = (ax >> 13) & 1u;
  ax += 0xc8000fffu + odd;  // -(112 << 23) + 0xfff (+1 when odd) modulo 2^32
  return static_cast<std::uint16_t>(sign | (ax >> 13));
}

float fp16_to_fp32(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1fu;
  const std::uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    if (mant == 0) return std::bit_cast<float>(sign);
    const float v = static_cast<float>(mant) * 0x1p-24f;  // exact: subnormal = mant · 2^-24
    return std::bit_cast<float>(sign | std::bit_cast<std::uint32_t>(v));
  }
  if (exp == 31) return std::bit_cast<float>(sign | 0x7f800000u | (mant << 13));
  return std::bit_cast<float>(sign | ((exp + 112u) << 23) | (mant << 13));
}

void bf16_to_fp32(const std::uint16_t* src, float* dst, Index n) {
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (Index i = 0; i < n; ++i) dst[i] = bf16_to_fp32(src[i]);
}

void fp32_to_bf16(const float* src, std::uint16_t* dst, Index n) {
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (Index i = 0; i < n; ++i) dst[i] = fp32_to_bf16(src[i]);
}

void fp16_to_fp32(const std::uint16_t* src, float* dst, Index n) {
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (Index i = 0; i < n; ++i) dst[i] = fp16_to_fp32(src[i]);
}

void fp32_to_fp16(const float* src, std::uint16_t* dst, Index n) {
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (Index i = 0; i < n; ++i) dst[i] = fp32_to_fp16(src[i]);
}

std::uint64_t gemm_packing_bytes(Index M, Index N, Index K, int threads) {
  // Eigen's gemm_blocking_space packs an mc×kc block of the left operand and a kc×nc panel of
  // the right one; computeProductBlockingSizes shrinks k, m, n to fit the L1/L2/L3 caches.
  Index kc = K, mc = M, nc = N;
  const Index t = threads > 0 ? threads : 1;
  Eigen::internal::computeProductBlockingSizes<float, float>(kc, mc, nc, t);
  return static_cast<std::uint64_t>(t) * static_cast<std::uint64_t>(kc) *
         static_cast<std::uint64_t>(mc + nc) * sizeof(float);
}

}  // namespace peftplan::executor::cpu
