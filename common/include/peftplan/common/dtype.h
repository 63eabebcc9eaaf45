// Element types of stored tensors and their sizes. Sub-byte types (nf4, fp4) are counted in bits
// so that a tensor's bytes are exact: storage_bytes(nf4, n) = ceil(n / 2).
// Quantisation constants (absmax per block) are not part of a dtype; models/ adds them.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

namespace peftplan {

enum class DType { fp32, fp16, bf16, int8, nf4, fp4 };

constexpr int bits_of(DType t) {
  switch (t) {
    case DType::fp32: return 32;
    case DType::fp16: return 16;
    case DType::bf16: return 16;
    case DType::int8: return 8;
    case DType::nf4: return 4;
    case DType::fp4: return 4;
  }
  return 0;
}

// Bytes for one element; only meaningful for whole-byte types.
constexpr std::uint64_t bytes_of(DType t) { return static_cast<std::uint64_t>(bits_of(t) / 8); }

// Bytes to store n elements, rounded up to whole bytes.
constexpr std::uint64_t storage_bytes(DType t, std::int64_t n) {
  return (static_cast<std::uint64_t>(n) * static_cast<std::uint64_t>(bits_of(t)) + 7) / 8;
}

constexpr std::string_view name_of(DType t) {
  switch (t) {
    case DType::fp32: return "fp32";
    case DType::fp16: return "fp16";
    case DType::bf16: return "bf16";
    case DType::int8: return "int8";
    case DType::nf4: return "nf4";
    case DType::fp4: return "fp4";
  }
  return "?";
}
// Every enumerator has its name and its width (a new one without either fails to compile).
static_assert(name_of(DType::fp4) == "fp4" && bits_of(DType::fp4) == 4);

// Accepts our names and PyTorch/HF spellings ("float32", "bfloat16", "torch.float16").
inline std::optional<DType> parse_dtype(std::string_view s) {
  if (s.starts_with("torch.")) s.remove_prefix(6);
  if (s == "fp32" || s == "float32" || s == "float" || s == "F32") return DType::fp32;
  if (s == "fp16" || s == "float16" || s == "half" || s == "F16") return DType::fp16;
  if (s == "bf16" || s == "bfloat16" || s == "BF16") return DType::bf16;
  if (s == "int8" || s == "I8") return DType::int8;
  if (s == "nf4") return DType::nf4;
  if (s == "fp4") return DType::fp4;
  return std::nullopt;
}

}  // namespace peftplan
