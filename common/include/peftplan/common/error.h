// Errors and invariants shared by every peftplan library.
// InputError is what bad user input becomes (a file, a field, a value and what would be valid);
// PEFTPLAN_CHECK guards invariants of our own code and stays on in release builds.
// Nothing here exits the process: only main() decides exit codes.
#pragma once

#include <cstddef>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

#include <fmt/format.h>

namespace peftplan {

// The length of the printable character that starts at text[i]: 1 for printable ASCII (and the
// newline and tab), 2-4 for a well-formed UTF-8 sequence (RFC 3629: no overlongs, no surrogates,
// at most U+10FFFF), 0 for a byte that would not print as itself (a control byte, DEL, or a
// byte of no well-formed sequence, as a binary or Latin-1 file has).
inline std::size_t printable_length(std::string_view text, std::size_t i) {
  const auto c = static_cast<unsigned char>(text[i]);
  if (c < 0x80) return (c < 0x20 && c != '\n' && c != '\t') || c == 0x7f ? 0 : 1;
  const std::size_t n = c >= 0xc2 && c <= 0xdf ? 2 : c >= 0xe0 && c <= 0xef ? 3 : c >= 0xf0 && c <= 0xf4 ? 4 : 0;
  if (n == 0 || i + n > text.size()) return 0;
  for (std::size_t k = 1; k < n; ++k)
    if ((static_cast<unsigned char>(text[i + k]) & 0xc0) != 0x80) return 0;
  const auto c1 = static_cast<unsigned char>(text[i + 1]);
  if ((c == 0xe0 && c1 < 0xa0) || (c == 0xed && c1 >= 0xa0) || (c == 0xf0 && c1 < 0x90) || (c == 0xf4 && c1 >= 0x90)) return 0;
  return n;
}

// The offset of the first byte of `text` that would not print (printable_length 0), or npos.
// `allow_cr`: a carriage return counts as printable (text files written on Windows).
inline std::size_t first_unprintable(std::string_view text, bool allow_cr = false) {
  for (std::size_t i = 0; i < text.size();) {
    const std::size_t n = printable_length(text, i);
    if (n == 0 && !(allow_cr && text[i] == '\r')) return i;
    i += n == 0 ? 1 : n;
  }
  return std::string_view::npos;
}

// `text` with every byte that would not print as itself escaped as \xNN; valid UTF-8 passes
// unchanged.
inline std::string printable(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (std::size_t i = 0; i < text.size();) {
    const std::size_t n = printable_length(text, i);
    if (n == 0) {
      out += fmt::format("\\x{:02x}", static_cast<unsigned char>(text[i]));
      ++i;
    } else {
      out.append(text.substr(i, n));
      i += n;
    }
  }
  return out;
}

// `text` on one line: each newline shown as the two characters \n (a value quoted from a user's
// file may hold one: a YAML block string, found by fuzz/fuzz_accelerate_config.cpp).
inline std::string one_line(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (const char c : text) {
    if (c == '\n') out += "\\n";
    else out += c;
  }
  return out;
}

// A message for the terminal, one line of bytes that print: what errors and warnings are shown as.
inline std::string printable_line(std::string_view text) { return one_line(printable(text)); }

// Bad input from a user: main() prints what() on one line and exits with code 2. Its message is
// printable and one line: bytes from a user's file that would not print are escaped
// (printable()), newlines shown as \n (one_line()).
class InputError : public std::runtime_error {
 public:
  explicit InputError(const std::string& message) : std::runtime_error(printable_line(message)) {}
};

// "<where>: <field> <problem>, got <value>" — the shape of every input error we print.
// `where` is a file name or a flag spelling ("--lora-r"); `field` a JSON key or "" for flags.
inline InputError input_error(std::string_view where, std::string_view field, std::string_view problem,
                              std::string_view got = {}) {
  std::string msg = fmt::format("{}: ", where);
  if (!field.empty()) msg += fmt::format("{} ", field);
  msg += problem;
  if (!got.empty()) msg += fmt::format(", got {}", got);
  return InputError(msg);
}

// A broken invariant in our own code (a bug, not bad input).
class InternalError : public std::logic_error {
 public:
  explicit InternalError(const std::string& message) : std::logic_error(message) {}
};

}  // namespace peftplan

#define PEFTPLAN_CHECK(cond)                                                                  \
  do {                                                                                        \
    if (!(cond))                                                                              \
      throw ::peftplan::InternalError(fmt::format("{}:{}: check failed: {}", __FILE__, __LINE__, \
                                                  #cond));                                    \
  } while (0)

#define PEFTPLAN_CHECK_MSG(cond, ...)                                                         \
  do {                                                                                        \
    if (!(cond))                                                                              \
      throw ::peftplan::InternalError(fmt::format("{}:{}: check failed: {}: {}", __FILE__,     \
                                                  __LINE__, #cond, fmt::format(__VA_ARGS__))); \
  } while (0)
