// Errors and invariants shared by every peftplan library.
// InputError is what bad user input becomes (a file, a field, a value and what would be valid);
// PEFTPLAN_CHECK guards invariants of our own code and stays on in release builds.
// Nothing here exits the process: only main() decides exit codes.
#pragma once

#include <stdexcept>
#include <string>
#include <utility>

#include <fmt/format.h>

namespace peftplan {

// Bad input from a user: main() prints what() on one line and exits with code 2.
class InputError : public std::runtime_error {
 public:
  explicit InputError(const std::string& message) : std::runtime_error(message) {}
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
