// Reading one field of a JSON object from a user's file: the one reader every file parser uses
// (model config.json, adapter_config.json, plan.json, cluster files, DeepSpeed configs,
// measurements, validation.json, GUI scenarios).
// An optional field that is absent, or set to null (as transformers writes unset config fields),
// takes the caller's fallback; a required one that is absent "is missing"; a present one must
// have the type (and sign or range) asked for, or the InputError names the
// file (`where`), the field with its object path (`prefix`, e.g. "training."), what would be
// valid and the value given (input_error's shape).
// Deliberately not here: which fields a file has, their defaults and cross-field rules (each
// parser's own), and schema validation of whole documents.
#pragma once

#include <cmath>
#include <cstdint>
#include <optional>
#include <limits>
#include <string>
#include <string_view>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "peftplan/common/error.h"
#include "peftplan/common/units.h"

namespace peftplan::json_fields {

using Json = nlohmann::json;

// obj[key], or nullptr when obj is not an object or the key is absent or null.
inline const Json* find(const Json& obj, std::string_view key) {
  if (!obj.is_object()) return nullptr;
  auto it = obj.find(key);
  return it == obj.end() || it->is_null() ? nullptr : &*it;
}

inline std::string field_name(std::string_view prefix, std::string_view key) { return fmt::format("{}{}", prefix, key); }

// --- values: the checks every reader below (and readers that walk a document by path, as the
// DeepSpeed config reader does) applies to one value; `field` is the name the message gives.

// Which numbers a field takes, and how its message says so.
enum class Sign { any, positive, non_negative };
inline std::string_view valid_number(Sign s) {
  switch (s) {
    case Sign::positive: return "must be a positive number";
    case Sign::non_negative: return "must be a non-negative number";
    case Sign::any: break;
  }
  return "must be a number";
}

inline bool as_boolean(const Json& v, std::string_view where, std::string_view field) {
  if (!v.is_boolean()) throw input_error(where, field, "must be true or false", v.dump());
  return v.get<bool>();
}

inline std::string as_string(const Json& v, std::string_view where, std::string_view field) {
  if (!v.is_string()) throw input_error(where, field, "must be a string", v.dump());
  return v.get<std::string>();
}

inline double as_number(const Json& v, std::string_view where, std::string_view field, Sign sign = Sign::any) {
  if (!v.is_number()) throw input_error(where, field, valid_number(sign), v.dump());
  const double x = v.get<double>();
  if ((sign == Sign::positive && !(x > 0.0)) || (sign == Sign::non_negative && !(x >= 0.0)))
    throw input_error(where, field, valid_number(sign), v.dump());
  return x;
}

// What an integer field in [lo, hi] says it must be ("must be an integer in [1, 1,048,576]", the
// bounds with thousands separators as units.h writes counts, or "must be a positive integer" /
// "must be a non-negative integer" for the open ranges).
inline std::string valid_integer(std::int64_t lo, std::int64_t hi) {
  constexpr std::int64_t kMin = std::numeric_limits<std::int64_t>::min(), kMax = std::numeric_limits<std::int64_t>::max();
  if (hi == kMax && lo == 1) return "must be a positive integer";
  if (hi == kMax && lo == 0) return "must be a non-negative integer";
  if (lo != kMin || hi != kMax) return fmt::format("must be an integer in [{}, {}]", with_commas(lo), with_commas(hi));
  return "must be an integer";
}

// An integer in [lo, hi]. A float where an integer belongs (4.0) is refused unless
// `integral_floats` (DeepSpeed's configs write sizes as 5e8), as are values past 64 bits.
// `valid` overrides the message's "must be ..." (say, "must hold non-negative layer indices").
inline std::int64_t as_integer(const Json& v, std::string_view where, std::string_view field,
                               std::int64_t lo = std::numeric_limits<std::int64_t>::min(),
                               std::int64_t hi = std::numeric_limits<std::int64_t>::max(), bool integral_floats = false,
                               std::string_view valid = {}) {
  const std::string message = valid.empty() ? valid_integer(lo, hi) : std::string(valid);
  std::int64_t n = 0;
  if (v.is_number_integer()) {
    if (v.is_number_unsigned() && v.get<std::uint64_t>() > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
      throw input_error(where, field, message, v.dump());
    n = v.get<std::int64_t>();
  } else if (integral_floats && v.is_number_float() && std::isfinite(v.get<double>()) &&
             std::floor(v.get<double>()) == v.get<double>() && std::fabs(v.get<double>()) < 9.2e18) {
    n = static_cast<std::int64_t>(v.get<double>());
  } else {
    throw input_error(where, field, message, v.dump());
  }
  if (n < lo || n > hi) throw input_error(where, field, message, v.dump());
  return n;
}

// --- fields of an object, optional: an absent or null field takes the caller's fallback.

inline bool boolean(const Json& obj, std::string_view key, std::string_view where, bool fallback, std::string_view prefix = {}) {
  const Json* v = find(obj, key);
  return v ? as_boolean(*v, where, field_name(prefix, key)) : fallback;
}

inline double number(const Json& obj, std::string_view key, std::string_view where, double fallback, std::string_view prefix = {},
                     Sign sign = Sign::any) {
  const Json* v = find(obj, key);
  return v ? as_number(*v, where, field_name(prefix, key), sign) : fallback;
}

inline std::string string(const Json& obj, std::string_view key, std::string_view where, std::string fallback,
                          std::string_view prefix = {}) {
  const Json* v = find(obj, key);
  return v ? as_string(*v, where, field_name(prefix, key)) : fallback;
}

inline std::int64_t integer(const Json& obj, std::string_view key, std::string_view where, std::int64_t fallback,
                            std::string_view prefix = {}, std::int64_t lo = std::numeric_limits<std::int64_t>::min(),
                            std::int64_t hi = std::numeric_limits<std::int64_t>::max()) {
  const Json* v = find(obj, key);
  return v ? as_integer(*v, where, field_name(prefix, key), lo, hi) : fallback;
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

// An optional number or integer that may be absent or null (nullopt), as a measurement writes a
// figure it could not take.
inline std::optional<double> nullable_number(const Json& obj, std::string_view key, std::string_view where,
                                             std::string_view prefix = {}, Sign sign = Sign::any) {
  const Json* v = find(obj, key);
  if (!v) return std::nullopt;
  return as_number(*v, where, field_name(prefix, key), sign);
}
inline std::optional<std::int64_t> nullable_integer(const Json& obj, std::string_view key, std::string_view where,
                                                    std::string_view prefix = {},
                                                    std::int64_t lo = std::numeric_limits<std::int64_t>::min(),
                                                    std::int64_t hi = std::numeric_limits<std::int64_t>::max()) {
  const Json* v = find(obj, key);
  if (!v) return std::nullopt;
  return as_integer(*v, where, field_name(prefix, key), lo, hi);
}

// --- fields of an object, required: absent is an error ("... is missing").

inline const Json& required(const Json& obj, std::string_view key, std::string_view where, std::string_view prefix = {}) {
  if (!obj.is_object() || !obj.contains(key)) throw input_error(where, field_name(prefix, key), "is missing");
  return obj.at(std::string(key));
}
inline const Json& required_object(const Json& obj, std::string_view key, std::string_view where, std::string_view prefix = {}) {
  const Json& v = required(obj, key, where, prefix);
  if (!v.is_object()) throw input_error(where, field_name(prefix, key), "must be an object", v.dump());
  return v;
}
inline double required_number(const Json& obj, std::string_view key, std::string_view where, std::string_view prefix = {},
                              Sign sign = Sign::any) {
  return as_number(required(obj, key, where, prefix), where, field_name(prefix, key), sign);
}
inline std::int64_t required_integer(const Json& obj, std::string_view key, std::string_view where, std::string_view prefix = {},
                                     std::int64_t lo = std::numeric_limits<std::int64_t>::min(),
                                     std::int64_t hi = std::numeric_limits<std::int64_t>::max()) {
  return as_integer(required(obj, key, where, prefix), where, field_name(prefix, key), lo, hi);
}

}  // namespace peftplan::json_fields
