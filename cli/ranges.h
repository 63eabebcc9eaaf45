// The one syntax for lists and ranges of integers in search flags (`recommend --gpus`, `sweep`):
// a comma list "8,16,32", a range "1..8" (every integer), "8..64:8" (steps of 8) or "8..64:x2"
// (doubling), and lists of those ("1,2,8..64:x2"). Values come back sorted and unique.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

namespace peftplan::cli {

// Throws InputError naming `flag`, the text and the valid forms; refuses more than `max_values`
// values (a typo like 1..100000000 should not plan for an hour).
std::vector<std::int64_t> parse_int_list(std::string_view flag, std::string_view text, std::size_t max_values = 4096);

// Comma-separated words ("ddp,zero3"), empty words refused.
std::vector<std::string_view> split_commas(std::string_view flag, std::string_view text);

}  // namespace peftplan::cli
