// Unit conversions at the edge: bytes are shown in binary GiB (labelled GiB), rates in decimal
// GB/s and TFLOP/s, counts with thousands separators as PEFT prints them.
#pragma once

#include <cstdint>
#include <string>

#include <fmt/format.h>

namespace peftplan {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
constexpr double kMiB = 1024.0 * 1024.0;
constexpr double kGB = 1e9;

inline double to_gib(std::uint64_t bytes) { return static_cast<double>(bytes) / kGiB; }

// 6738415616 -> "6,738,415,616" (PEFT's print_trainable_parameters uses Python's "{:,}").
inline std::string with_commas(std::int64_t n) {
  // The magnitude as unsigned: -INT64_MIN does not fit in 64 signed bits.
  const std::uint64_t magnitude = n < 0 ? 0 - static_cast<std::uint64_t>(n) : static_cast<std::uint64_t>(n);
  const std::string digits = fmt::format("{}", magnitude);
  std::string out;
  for (std::size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return n < 0 ? "-" + out : out;
}

// 6738415616 -> "6.74B", 124439808 -> "124.4M": the short form the Hugging Face Hub shows.
inline std::string short_count(std::int64_t n) {
  double v = static_cast<double>(n);
  if (v >= 1e9) return fmt::format("{:.2f}B", v / 1e9);
  if (v >= 1e6) return fmt::format("{:.1f}M", v / 1e6);
  if (v >= 1e3) return fmt::format("{:.1f}K", v / 1e3);
  return fmt::format("{}", n);
}

// Bytes for people: "12.55 GiB", "310.0 MiB", "4.0 KiB", "17 B".
inline std::string human_bytes(std::uint64_t bytes) {
  double b = static_cast<double>(bytes);
  if (b >= kGiB) return fmt::format("{:.2f} GiB", b / kGiB);
  if (b >= kMiB) return fmt::format("{:.1f} MiB", b / kMiB);
  if (b >= 1024.0) return fmt::format("{:.1f} KiB", b / 1024.0);
  return fmt::format("{} B", bytes);
}

}  // namespace peftplan
