// plan.json: everything `peftplan run` hands to the executor, as versioned JSON
// ("schema": "peftplan.plan/1"): the model (a zoo name, or the config.json object itself), the
// adapters (adapter_config.json objects), QLoRA's quantisation of the base, the training fields
// ds_config does not carry, the strategy as its launcher's file (a DeepSpeed ds_config,
// write_ds_config/read_ds_config; for FSDP accelerate's launch YAML, accelerate_config.h), the
// runtime profile, and a "run" object with what only the executor needs (steps, data, seeds,
// weights, learning-rate overrides, the scheduler, where to save the adapter).
// "program" identifies the step program the writer built from it (a contract version and
// sim::program_hash), so that the executor and `compare` can check they build the same one.
// Parsing happens here, at the edge: errors name the file and the field. Reading a file from
// disk and writing it atomically are the only I/O.
// Deliberately not here: the prediction (build_program/make_plan do that from PlanInput). The
// cluster the plan was made for rides along ("cluster", optional) so that `peftplan compare`
// can remake the prediction; the executor ignores it (it measures the machine it runs on).
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "peftplan/common/schemas.h"
#include "peftplan/planner/ds_config.h"
#include "peftplan/planner/program.h"
#include "peftplan/sim/cluster.h"

namespace peftplan::planner {

// What the executor needs beyond the plan itself.
struct RunOptions {
  std::int64_t steps = 10;            // optimizer steps to run
  std::string data;                   // token file; empty: none given (the executor refuses)
  std::string data_format = "bytes";  // "u32" | "u16" | "bytes" (every byte is a token)
  std::uint64_t seed = 0;             // base-weight init, adapter init, dropout masks
  std::string weights;                // safetensors checkpoint with HF names; empty: seeded
                                      //   random init (normal(0, 0.02), norms 1)
  std::string adapter_init = "peft";  // "peft" (A ~ U(±1/√in), B = 0) or a safetensors file
                                      //   with PEFT names
  std::string save_adapter;           // directory for adapter_model.safetensors +
                                      //   adapter_config.json; empty: not saved
  std::int64_t checkpoint_every = 0;  // write a training checkpoint every K steps (0: never)
  std::string checkpoint_dir;         // where checkpoints go (step-<k>/ folders and "latest")
  std::string resume;                 // a checkpoint folder (or a checkpoint_dir with "latest")
                                      //   to continue from; empty: start at step 0
  std::string on_nonfinite = "stop";  // a step whose gradient norm is not finite: "stop" the run
                                      //   (naming the first non-finite gradient), or "skip" the
                                      //   update (weights and optimizer states untouched, counted)
};

struct PlanFile {
  PlanInput input;                    // model, adapters, training (lr, weight decay, clip),
                                      //   strategy, profile
  DsExtras extras;                    // the scheduler (and loss scaling, unused by fp32)
  nlohmann::json model_source;        // as written: a zoo name (string) or a config.json object
  RunOptions run;
  std::optional<sim::Cluster> cluster;  // the cluster the plan was predicted on, when known
  std::string program_hash;           // as read: "program.hash", the hash (sim/program_hash.h) of
                                      //   the program the writer built from this plan; empty
                                      //   when the file has none. Writing recomputes it.
};

inline constexpr std::string_view kPlanSchema = schemas::kPlanFile;

// A zoo name stays a name; a path (config.json, or a folder holding one) becomes the parsed
// config.json object, so that a plan file is self-contained.
nlohmann::json model_source_for(const std::string& name_or_path);

nlohmann::json plan_file_to_json(const PlanFile& plan);
// Throws InputError "<source>: <field> <problem>, got <value>".
PlanFile plan_file_from_json(const nlohmann::json& j, std::string_view source);

PlanFile read_plan_file(const std::filesystem::path& path);

// The program this build makes from plan.input, against the hash the writer recorded: throws
// InputError "<source>: program.hash ..." when they differ (the binary that wrote the plan and
// this one would not run the same program). A plan without a hash passes.
void check_program_hash(const PlanFile& plan, std::string_view source);
// Written to "<path>.tmp.<pid>" and renamed over path.
void write_plan_file(const std::filesystem::path& path, const PlanFile& plan);

}  // namespace peftplan::planner
