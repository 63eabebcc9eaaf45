// Training data: a token file and the exact, documented order in which steps read it.
//
// Formats (little-endian): u32 (4 bytes a token), u16 (2 bytes), bytes (every byte of any file
// is a token, so any text trains a byte-level model with vocab >= 256).
//
// Order (no shuffling): the token stream is cut into sequences of S+1 tokens, sequence i being
// tokens[i·S … i·S+S] with indices taken modulo the stream length (wrapping around); position t
// of a sequence predicts token t+1. Optimizer step k (0-based) uses the global sequences
// k·G … k·G+G−1 with G = B·A·N (micro-batch B, accumulation A, ranks N); rank r takes the r-th
// contiguous block of B·A of them, micro-batch a of that block being its sequences a·B … a·B+B−1.
// The step loss is the mean over all G·S target tokens.
// Deliberately not here: shuffling, packing documents, padding or attention masks.
#pragma once

#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace peftplan::executor {

enum class DataFormat { u32, u16, bytes };
// "u32" | "u16" | "bytes"; anything else is an InputError naming `where`.
DataFormat parse_data_format(std::string_view s, std::string_view where);
std::string_view name_of(DataFormat f);

class TokenData {
 public:
  // Reads the whole file. Throws InputError naming the file for: a missing file, a length that
  // is not a whole number of tokens, fewer than seq_len + 1 tokens ("shorter than one sequence"),
  // or a token id >= vocab (with its position).
  static TokenData load(const std::filesystem::path& path, DataFormat format, std::int64_t vocab,
                        std::int64_t seq_len);
  // A stream already in memory (tests); the same checks, `source` names it in errors.
  static TokenData from_tokens(std::vector<std::int32_t> tokens, std::int64_t vocab,
                               std::int64_t seq_len, std::string source);

  std::int64_t size() const { return static_cast<std::int64_t>(tokens_.size()); }
  std::int64_t seq_len() const { return S_; }
  const std::string& source() const { return source_; }

  // Fills inputs[B·S] and targets[B·S] for `rank`'s micro-batch `micro_batch` of optimizer step
  // `step` (the order above).
  void micro_batch(std::int64_t step, std::int32_t rank, std::int32_t ranks,
                   std::int64_t micro_batch, std::int64_t micro_batches, std::int64_t B,
                   std::span<std::int32_t> inputs, std::span<std::int32_t> targets) const;
  // Sequence i: tokens[(i·S + j) mod size()] for j in [0, S].
  std::int32_t token(std::int64_t sequence, std::int64_t j) const;

 private:
  std::vector<std::int32_t> tokens_;
  std::int64_t S_ = 0;
  std::string source_;
};

}  // namespace peftplan::executor
