// parse_int_list: "8,16,32", "1..8", "8..64:8", "8..64:x2".
#include "ranges.h"

#include <algorithm>
#include <charconv>
#include <string>

#include <fmt/format.h>

#include "peftplan/common/error.h"

namespace peftplan::cli {
namespace {

constexpr std::string_view kForms = "must be a comma list of positive integers or ranges A..B, A..B:S (steps of S) or A..B:xF (times F), e.g. 8,16,32 or 8..64:x2";

std::int64_t number(std::string_view flag, std::string_view whole, std::string_view s) {
  std::int64_t v = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (s.empty() || ec != std::errc() || end != s.data() + s.size() || v <= 0)
    throw input_error(flag, "", kForms, fmt::format("\"{}\"", whole));
  return v;
}

}  // namespace

std::vector<std::string_view> split_commas(std::string_view flag, std::string_view text) {
  std::vector<std::string_view> out;
  std::size_t at = 0;
  while (true) {
    const std::size_t comma = text.find(',', at);
    const std::string_view word = text.substr(at, comma == std::string_view::npos ? std::string_view::npos : comma - at);
    if (word.empty()) throw input_error(flag, "", "must be a comma list with no empty entries", fmt::format("\"{}\"", text));
    out.push_back(word);
    if (comma == std::string_view::npos) break;
    at = comma + 1;
  }
  return out;
}

std::vector<std::int64_t> parse_int_list(std::string_view flag, std::string_view text, std::size_t max_values) {
  std::vector<std::int64_t> out;
  auto add = [&](std::int64_t v) {
    out.push_back(v);
    if (out.size() > max_values)
      throw input_error(flag, "", fmt::format("lists more than {} values", max_values), fmt::format("\"{}\"", text));
  };
  if (text.empty()) throw input_error(flag, "", kForms, "\"\"");
  for (std::string_view part : split_commas(flag, text)) {
    const std::size_t dots = part.find("..");
    if (dots == std::string_view::npos) {
      add(number(flag, text, part));
      continue;
    }
    const std::int64_t a = number(flag, text, part.substr(0, dots));
    std::string_view rest = part.substr(dots + 2);
    const std::size_t colon = rest.find(':');
    const std::int64_t b = number(flag, text, rest.substr(0, colon));
    if (b < a) throw input_error(flag, "", fmt::format("range {}..{} runs backwards", a, b), fmt::format("\"{}\"", text));
    if (colon == std::string_view::npos) {
      for (std::int64_t v = a; v <= b; ++v) add(v);
      continue;
    }
    std::string_view step = rest.substr(colon + 1);
    if (!step.empty() && (step[0] == 'x' || step[0] == 'X')) {
      const std::int64_t f = number(flag, text, step.substr(1));
      if (f < 2) throw input_error(flag, "", "a range's factor xF must be at least 2", fmt::format("\"{}\"", text));
      for (std::int64_t v = a; v <= b; v *= f) add(v);
    } else {
      const std::int64_t s = number(flag, text, step);
      for (std::int64_t v = a; v <= b; v += s) add(v);
    }
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

}  // namespace peftplan::cli
