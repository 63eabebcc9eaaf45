// Parsing Hugging Face config.json files into ModelSpec, and the bundled zoo of real configs.
// Errors are InputError naming the file, the field, the value and what would be valid.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "peftplan/models/model_spec.h"

namespace peftplan::models {

// `source` names the file in error messages; `name` becomes ModelSpec::name.
ModelSpec model_from_config(const nlohmann::json& config, std::string_view source,
                            std::string name);

// Reads and parses a JSON file; a malformed file is an InputError naming the file and position.
nlohmann::json read_json_file(const std::string& path);

struct ZooEntry {
  std::string name;         // short name: "llama-2-7b"
  std::string hf_id;        // "meta-llama/Llama-2-7b-hf"; empty for our tiny configs
  std::string description;  // one line
};

// The bundled zoo (models/zoo/*.json, compiled into the binary).
const std::vector<ZooEntry>& zoo();
// The config.json text of a zoo model, or nullptr.
const char* zoo_config_text(std::string_view name);

// `name_or_path`: a zoo name, a config.json path, or a directory holding config.json.
ModelSpec load_model(const std::string& name_or_path);

// The identity of a config.json: SHA-256 (hex) of its canonical JSON text — keys sorted, no
// whitespace, UTF-8 unescaped — which is Python's json.dumps(obj, sort_keys=True,
// separators=(",", ":"), ensure_ascii=False), so tools/peftplan_callback.py computes the same.
std::string config_sha256(const nlohmann::json& config);
// SHA-256 of bytes, lower-case hex (checkpoint files' checksums).
std::string sha256_hex(std::string_view bytes);

}  // namespace peftplan::models
