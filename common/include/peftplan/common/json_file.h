// Reading a user's JSON file: the one place a file's bytes become a document, for every reader
// that takes a path (model config.json, adapter_config.json, plan.json, cluster files,
// ds_config.json, measurements, validation.json, GUI scenarios).
// A file that cannot be opened, is not JSON (truncated, empty, binary, not UTF-8, nested past the
// depth below), or holds a number no double can hold (1e999) is an InputError naming the file;
// the parser's own words come through printable() (error.h), so no raw byte is echoed.
// Deliberately not here: what the document must hold (json_fields.h and each parser).
#pragma once

#include <cstddef>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "peftplan/common/error.h"

namespace peftplan {

// Deeper nesting than any file of ours has (a plan.json's ds_config is 4 deep) is refused before
// the parser recurses into it: nlohmann's parser recurses once per level.
inline constexpr std::size_t kMaxJsonDepth = 256;

inline nlohmann::json parse_json_text(const std::string& text, const std::string& path) {
  std::size_t depth = 0, deepest = 0;
  bool in_string = false, escaped = false;
  for (const char ch : text) {  // brackets outside strings
    if (in_string) {
      if (escaped) escaped = false;
      else if (ch == '\\') escaped = true;
      else if (ch == '"') in_string = false;
    } else if (ch == '"') {
      in_string = true;
    } else if (ch == '[' || ch == '{') {
      if (++depth > deepest) deepest = depth;
    } else if ((ch == ']' || ch == '}') && depth > 0) {
      --depth;
    }
  }
  if (deepest > kMaxJsonDepth)
    throw input_error(path, "", fmt::format("is nested {} levels deep; at most {} are read", deepest, kMaxJsonDepth));
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::out_of_range& e) {  // 406: a number past a double's range
    throw input_error(path, "", fmt::format("holds a number no double can hold: {}", e.what()));
  } catch (const nlohmann::json::exception& e) {
    throw input_error(path, "", fmt::format("is not valid JSON: {}", e.what()));
  }
}

// The most of a user's file read: far beyond any config, plan or measurement file, and a bound
// on a path that never ends (/dev/zero, a FIFO left open).
inline constexpr std::size_t kMaxInputFileBytes = std::size_t{256} << 20;

// A user's file's bytes (a JSON file, a sweep's CSV, a launcher's YAML); a file that cannot be
// opened, or that runs past kMaxInputFileBytes, is an InputError naming it.
inline std::string read_text_file(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) throw input_error(path, "", "is a folder, not a file");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw input_error(path, "", "cannot be opened (does the file exist?)");
  std::string text;
  char chunk[1 << 16];
  while (in.read(chunk, sizeof chunk) || in.gcount() > 0) {
    text.append(chunk, static_cast<std::size_t>(in.gcount()));
    if (text.size() > kMaxInputFileBytes)
      throw input_error(path, "", fmt::format("is larger than {} MiB, the most read of an input file", kMaxInputFileBytes >> 20));
  }
  return text;
}

inline nlohmann::json read_json_file(const std::string& path) { return parse_json_text(read_text_file(path), path); }

}  // namespace peftplan
