// Token files and the step order (see data.h).
#include "peftplan/executor/data.h"

#include <filesystem>
#include <fstream>

#include <fmt/format.h>

#include "peftplan/common/error.h"

namespace peftplan::executor {

DataFormat parse_data_format(std::string_view s, std::string_view where) {
  if (s == "u32") return DataFormat::u32;
  if (s == "u16") return DataFormat::u16;
  if (s == "bytes") return DataFormat::bytes;
  throw input_error(where, "", "must be one of u32, u16, bytes", std::string(s));
}

std::string_view name_of(DataFormat f) {
  switch (f) {
    case DataFormat::u32: return "u32";
    case DataFormat::u16: return "u16";
    case DataFormat::bytes: return "bytes";
  }
  return "?";
}

TokenData TokenData::from_tokens(std::vector<std::int32_t> tokens, std::int64_t vocab,
                                 std::int64_t seq_len, std::string source) {
  if (seq_len <= 0) throw input_error(source, "", "sequence length must be positive", std::to_string(seq_len));
  if (static_cast<std::int64_t>(tokens.size()) < seq_len + 1)
    throw InputError(fmt::format("{}: {} tokens is shorter than one sequence of seq_len + 1 = {} tokens",
                                 source, tokens.size(), seq_len + 1));
  for (std::size_t i = 0; i < tokens.size(); ++i)
    if (tokens[i] < 0 || tokens[i] >= vocab)
      throw InputError(fmt::format("{}: token {} at position {} is outside the vocabulary [0, {})",
                                   source, tokens[i], i, vocab));
  TokenData d;
  d.tokens_ = std::move(tokens);
  d.S_ = seq_len;
  d.source_ = std::move(source);
  return d;
}

TokenData TokenData::load(const std::filesystem::path& path, DataFormat format, std::int64_t vocab,
                          std::int64_t seq_len) {
  const std::string src = path.string();
  std::error_code ec;
  // Read whole: a folder, a device (/dev/zero never ends) or a pipe is no token file.
  if (std::filesystem::is_directory(path, ec)) throw InputError(fmt::format("{}: is a folder, not a data file", src));
  if (std::filesystem::exists(path, ec) && !std::filesystem::is_regular_file(path, ec))
    throw InputError(fmt::format("{}: is not a regular file (a device or a pipe), not a data file", src));
  std::ifstream f(path, std::ios::binary);
  if (!f) throw InputError(fmt::format("{}: cannot open the data file", src));
  std::vector<unsigned char> raw((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const std::size_t width = format == DataFormat::u32 ? 4 : format == DataFormat::u16 ? 2 : 1;
  if (raw.size() % width != 0)
    throw InputError(fmt::format("{}: {} bytes is not a whole number of {} tokens ({} bytes each)", src,
                                 raw.size(), name_of(format), width));
  std::vector<std::int32_t> tokens(raw.size() / width);
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    const unsigned char* p = raw.data() + i * width;
    std::uint32_t v = 0;
    for (std::size_t b = 0; b < width; ++b) v |= static_cast<std::uint32_t>(p[b]) << (8 * b);
    if (v >= static_cast<std::uint32_t>(vocab))
      throw InputError(fmt::format("{}: token {} at position {} is outside the vocabulary [0, {})", src, v, i, vocab));
    tokens[i] = static_cast<std::int32_t>(v);
  }
  return from_tokens(std::move(tokens), vocab, seq_len, src);
}

std::int32_t TokenData::token(std::int64_t sequence, std::int64_t j) const {
  const auto n = static_cast<std::uint64_t>(tokens_.size());
  const std::uint64_t i = (static_cast<std::uint64_t>(sequence) * static_cast<std::uint64_t>(S_) +
                           static_cast<std::uint64_t>(j)) % n;
  return tokens_[i];
}

void TokenData::micro_batch(std::int64_t step, std::int32_t rank, std::int32_t ranks,
                            std::int64_t micro_batch, std::int64_t micro_batches, std::int64_t B,
                            std::span<std::int32_t> inputs, std::span<std::int32_t> targets) const {
  PEFTPLAN_CHECK(static_cast<std::int64_t>(inputs.size()) == B * S_ && inputs.size() == targets.size());
  const std::int64_t G = B * micro_batches * ranks;
  const std::int64_t first = step * G + static_cast<std::int64_t>(rank) * B * micro_batches + micro_batch * B;
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t t = 0; t < S_; ++t) {
      inputs[static_cast<std::size_t>(b * S_ + t)] = token(first + b, t);
      targets[static_cast<std::size_t>(b * S_ + t)] = token(first + b, t + 1);
    }
}

}  // namespace peftplan::executor
