// Reading one field of a JSON object from a user's file: the one reader every file parser uses
// (model config.json, adapter_config.json, plan.json, cluster files, GUI scenarios).
// An absent field, or one set to null (as transformers writes unset config fields), takes the
// caller's fallback; a present one must have the type asked for, or the InputError names the
// file (`where`), the field with its object path (`prefix`, e.g. "training."), what would be
// valid and the value given (input_error's shape).
// Deliberately not here: which fields a file has, their defaults and cross-field rules (each
// parser's own), and schema validation of whole documents.
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <string_view>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "peftplan/common/error.h"

namespace peftplan::json_fields {

using Json = nlohmann::json;

// obj[key], or nullptr when obj is not an object or the key is absent or null.
inline const Json* find(const Json& obj, std::string_view key) {
  if (!obj.is_object()) return nullptr;
  auto it = obj.find(key);
  return it == obj.end() || it->is_null() ? nullptr : &*it;
}

inline std::string field_name(std::string_view prefix, std::string_view key) { return fmt::format("{}{}", prefix, key); }

inline bool boolean(const Json& obj, std::string_view key, std::string_view where, bool fallback, std::string_view prefix = {}) {
  const Json* v = find(obj, key);
  if (!v) return fallback;
  if (!v->is_boolean()) throw input_error(where, field_name(prefix, key), "must be true or false", v->dump());
  return v->get<bool>();
}

inline double number(const Json& obj, std::string_view key, std::string_view where, double fallback, std::string_view prefix = {}) {
  const Json* v = find(obj, key);
  if (!v) return fallback;
  if (!v->is_number()) throw input_error(where, field_name(prefix, key), "must be a number", v->dump());
  return v->get<double>();
}

inline std::string string(const Json& obj, std::string_view key, std::string_view where, std::string fallback,
                          std::string_view prefix = {}) {
  const Json* v = find(obj, key);
  if (!v) return fallback;
  if (!v->is_string()) throw input_error(where, field_name(prefix, key), "must be a string", v->dump());
  return v->get<std::string>();
}

// An integer in [lo, hi]; the message gives the range ("must be an integer in [1, 64]", or
// "must be a positive integer" / "must be a non-negative integer" for the open ranges). A float
// where an integer belongs (4.0) is refused, as are values past 64 bits.
inline std::int64_t integer(const Json& obj, std::string_view key, std::string_view where, std::int64_t fallback,
                            std::string_view prefix = {}, std::int64_t lo = std::numeric_limits<std::int64_t>::min(),
                            std::int64_t hi = std::numeric_limits<std::int64_t>::max()) {
  const Json* v = find(obj, key);
  if (!v) return fallback;
  std::string valid = "must be an integer";
  if (hi == std::numeric_limits<std::int64_t>::max() && lo == 1) valid = "must be a positive integer";
  else if (hi == std::numeric_limits<std::int64_t>::max() && lo == 0) valid = "must be a non-negative integer";
  else if (lo != std::numeric_limits<std::int64_t>::min() || hi != std::numeric_limits<std::int64_t>::max())
    valid = fmt::format("must be an integer in [{}, {}]", lo, hi);
  const bool too_big = v->is_number_unsigned() && v->get<std::uint64_t>() > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max());
  if (!v->is_number_integer() || too_big) throw input_error(where, field_name(prefix, key), valid, v->dump());
  const auto n = v->get<std::int64_t>();
  if (n < lo || n > hi) throw input_error(where, field_name(prefix, key), valid, v->dump());
  return n;
}

inline std::int64_t positive_integer(const Json& obj, std::string_view key, std::string_view where, std::int64_t fallback,
                                     std::string_view prefix = {}) {
  return integer(obj, key, where, fallback, prefix, 1);
}

// A non-negative integer of the full 64 bits (a seed).
inline std::uint64_t unsigned_integer(const Json& obj, std::string_view key, std::string_view where, std::uint64_t fallback,
                                      std::string_view prefix = {}) {
  const Json* v = find(obj, key);
  if (!v) return fallback;
  if (!v->is_number_unsigned()) throw input_error(where, field_name(prefix, key), "must be a non-negative integer", v->dump());
  return v->get<std::uint64_t>();
}

}  // namespace peftplan::json_fields
