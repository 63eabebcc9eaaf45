// What every fuzz target (fuzz/fuzz_*.cpp) holds to: its bytes go to one of peftplan's input
// parsers, as a user's file would. Refusing them with an InputError is the expected outcome of
// bad input — and its message must be printable (common/error.h), since it reaches the user's
// terminal. Anything else ends the process: another exception escapes (libFuzzer reports it as a
// crash; the replay test fails), a sanitizer finding aborts, a parse that runs away trips the
// fuzzer's -timeout. The same file builds two ways (fuzz/CMakeLists.txt): linked with libFuzzer
// under clang (`make fuzz`, long runs) and with replay_main.cpp everywhere else, where ctest
// replays the corpus through it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstdio>
#include <string>
#include <string_view>

#include "peftplan/common/error.h"
#include "peftplan/common/json_file.h"

namespace peftplan::fuzz {

inline std::string text_of(const std::uint8_t* data, std::size_t size) { return {reinterpret_cast<const char*>(data), size}; }

// Runs `parse`; an InputError is a refusal, and holds to what main() prints it as: one line
// (InputError escapes unprintable bytes itself, common/error.h) that names `source`, the file the
// parser was told it reads. Any other exception propagates.
template <class F>
void parse_or_refuse(std::string_view source, F&& parse) {
  try {
    parse();
  } catch (const InputError& e) {
    const std::string_view what = e.what();
    if (what.empty() || what.find('\n') != std::string_view::npos || what.find(source) == std::string_view::npos) {
      std::fprintf(stderr, "fuzz: an InputError that is empty, more than one line, or does not name %.*s: %s\n",
                   static_cast<int>(source.size()), source.data(), e.what());
      std::abort();
    }
  }
}

}  // namespace peftplan::fuzz
