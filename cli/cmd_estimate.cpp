// `peftplan estimate`: model-states memory only, from parameter counts, as closed forms.
// By default the ZeRO paper's per-GPU formulas (PEFT-aware with --trainable-params), printed in
// GiB and GB; with --deepspeed-compat, DeepSpeed's own estimators and their exact printed table.
// It does not model activations, buffers or fragmentation: `peftplan plan` does.
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "peft_flags.h"
#include "peftplan/models/config.h"
#include "peftplan/models/peft.h"
#include "peftplan/common/error.h"
#include "peftplan/common/units.h"
#include "peftplan/planner/closed_forms.h"

namespace peftplan::cli {

namespace {

struct EstimateOptions {
  std::int64_t params = -1;                  // P: all parameters (frozen + trainable)
  std::optional<std::int64_t> trainable;     // T: trainable parameters (PEFT); absent = all train
  std::optional<std::int64_t> largest_layer; // L_max: DeepSpeed's largest-layer parameters
  std::string model;                         // or P, T and L_max from a model and its adapters
  PeftFlags peft;
  std::string model_label;                   // "llama-2-7b, LoRA r 16" once resolved
  std::optional<std::int32_t> gpus;          // all GPUs: gpus_per_node = gpus / nodes
  std::int32_t gpus_per_node = 0;
  std::int32_t nodes = 1;
  int stage = -1;                            // -1: every stage the offload flags allow
  bool offload_optimizer = false, offload_param = false, zero_init = false;
  bool deepspeed_compat = false, deepspeed_legacy = false, json = false;
};

planner::Stage to_stage(int s) {
  switch (s) {
    case 0: return planner::Stage::ddp;
    case 1: return planner::Stage::zero1;
    case 2: return planner::Stage::zero2;
    default: return planner::Stage::zero3;
  }
}

// --model (with the PEFT flags) instead of --params: P, T and DeepSpeed's largest layer counted
// from the model as PEFT and DeepSpeed count them; --gpus instead of --gpus-per-node.
void resolve(EstimateOptions& o, bool params_given, bool gpus_per_node_given) {
  auto num = [](auto v) { return fmt::format("{}", v); };
  if (!o.model.empty()) {
    if (params_given) throw input_error("--params", "", "and --model are two sources of the parameter count: give one", num(o.params));
    if (o.trainable) throw input_error("--trainable-params", "", "comes from --model and its adapter flags: give one", num(*o.trainable));
    if (o.largest_layer)
      throw input_error("--largest-layer-params", "", "comes from --model (DeepSpeed's model_to_params): give one", num(*o.largest_layer));
    if (o.peft.quantised())
      throw input_error("--quant", "", "is not in estimate's closed forms, which count a bf16 base (2 B per parameter); `peftplan plan --quant` models a quantised base",
                        o.peft.quant);
    const models::ModelSpec m = models::load_model(o.model);
    if (m.checkpoint_quantization)
      throw input_error("--model", "",
                        fmt::format("names a checkpoint saved quantised ({}, its config.json's quantization_config), which estimate's closed forms do not "
                                    "count (they take a bf16 base, 2 B per parameter); `peftplan plan` models a quantised base",
                                    models::describe(*m.checkpoint_quantization)),
                        "\"" + o.model + "\"");
    const models::PeftSpec spec = peft_from_flags(o.peft);
    const models::ParamCounts c = models::count_params(m, spec);
    const planner::DsModelParams ds = planner::ds_model_to_params(m, spec);
    o.params = c.all_params;
    o.largest_layer = ds.largest_layer_params;
    if (!o.deepspeed_compat) o.trainable = c.trainable_params;  // DeepSpeed's estimators count every parameter
    o.model_label = spec.adapters.empty() ? fmt::format("{}, full fine-tuning", m.name)
                                          : fmt::format("{}, {} trainable", m.name, with_commas(c.trainable_params));
  } else if (!params_given) {
    throw input_error("--params", "", "or --model is required (the parameter count, or a model to count it from)");
  } else if (any_peft_flag(o.peft)) {
    throw input_error("--model", "", "is needed by the adapter flags (--peft, --lora-*, --quant, --full-finetune): with --params, give --trainable-params");
  }
  if (o.gpus) {
    if (gpus_per_node_given) throw input_error("--gpus", "", "and --gpus-per-node both set the GPU count: give one", num(*o.gpus));
    if (*o.gpus < 1) throw input_error("--gpus", "", "must be a positive integer", num(*o.gpus));
    if (o.nodes < 1) throw input_error("--nodes", "", "must be a positive integer", num(o.nodes));
    if (*o.gpus % o.nodes != 0)
      throw input_error("--gpus", "", fmt::format("must be a multiple of --nodes ({}): the GPUs are spread evenly over the nodes", o.nodes), num(*o.gpus));
    o.gpus_per_node = *o.gpus / o.nodes;
  } else if (!gpus_per_node_given) {
    throw input_error("--gpus", "", "or --gpus-per-node is required");
  }
}

void validate(const EstimateOptions& o) {
  auto num = [](auto v) { return fmt::format("{}", v); };
  if (o.params < 0) throw input_error("--params", "", "must be a non-negative integer", num(o.params));
  // 10^15, 2,500 times the largest zoo model (405B): 16 B per parameter (the ZeRO paper's K = 12
  // plus the fp16 weight and gradient) stays far inside 64 bits. Beyond it the byte counts wrapped
  // (2^60 parameters printed 0 GiB of trainable states).
  constexpr std::int64_t kMaxParams = 1'000'000'000'000'000;
  if (o.params > kMaxParams) throw input_error("--params", "", "must be at most 1,000,000,000,000,000 (10^15)", num(o.params));
  if (o.trainable && (*o.trainable < 0 || *o.trainable > o.params))
    throw input_error("--trainable-params", "", fmt::format("must be between 0 and --params ({})", o.params),
                      num(*o.trainable));
  if (o.largest_layer && (*o.largest_layer < 0 || *o.largest_layer > o.params))
    throw input_error("--largest-layer-params", "", fmt::format("must be between 0 and --params ({})", o.params),
                      num(*o.largest_layer));
  if (o.gpus_per_node < 1) throw input_error("--gpus-per-node", "", "must be a positive integer", num(o.gpus_per_node));
  if (o.nodes < 1) throw input_error("--nodes", "", "must be a positive integer", num(o.nodes));
  if (o.stage == -1) {  // every stage the flags allow
    if (o.deepspeed_compat) throw input_error("--stage", "", "is required with --deepspeed-compat (its estimators are per stage)");
    if (o.zero_init) throw input_error("--zero-init", "", "needs --stage 3");
    return;
  }
  if (o.stage < 0 || o.stage > 3) throw input_error("--stage", "", "must be 0, 1, 2 or 3", num(o.stage));
  if (o.offload_param && !planner::can_offload_params(to_stage(o.stage)))
    throw input_error("--offload-param", "", "needs --stage 3 (parameter offload is ZeRO-3 only)",
                      fmt::format("--stage {}", o.stage));
  if (o.offload_optimizer && !planner::can_offload_optimizer(to_stage(o.stage)))
    throw input_error("--offload-optimizer", "", "needs --stage 1, 2 or 3", "--stage 0");
  if (o.zero_init && o.stage != 3) throw input_error("--zero-init", "", "needs --stage 3",
                                         fmt::format("--stage {}", o.stage));
  if (o.deepspeed_compat && o.stage == 0)
    throw input_error("--deepspeed-compat", "",
                      "has no DeepSpeed estimator for stage 0 (estimate_zero2_* covers stages 1-2, "
                      "estimate_zero3_* stage 3)");
  if (o.deepspeed_compat && o.stage == 3 && !o.largest_layer)
    throw input_error("--largest-layer-params", "", "is required with --deepspeed-compat --stage 3");
  if (o.deepspeed_compat && o.trainable)
    throw input_error("--trainable-params", "",
                      "has no meaning with --deepspeed-compat: DeepSpeed's estimators count every parameter");
}

void run_deepspeed_compat(const EstimateOptions& o) {
  const auto formula = o.deepspeed_legacy ? planner::Zero2Formula::legacy : planner::Zero2Formula::current;
  planner::DsEstimate e;
  std::string text;
  if (o.stage == 3) {
    const planner::DsEstimate3 e3 = planner::ds_estimate_zero3(o.params, *o.largest_layer, o.gpus_per_node, o.nodes,
                                                               o.offload_optimizer, o.offload_param, o.zero_init);
    e = {e3.cpu_bytes, e3.gpu_bytes};
    text = planner::ds_zero3_all_cold_text(o.params, *o.largest_layer, o.gpus_per_node, o.nodes);
  } else {
    e = planner::ds_estimate_zero2(o.params, o.gpus_per_node, o.nodes, o.offload_optimizer, 1.5, formula);
    text = planner::ds_zero2_all_cold_text(o.params, o.gpus_per_node, o.nodes, 1.5, formula);
  }
  if (o.json) {
    nlohmann::json j{{"source", o.stage == 3 ? "deepspeed/runtime/zero/stage3.py estimate_zero3_model_states_mem_needs"
                                             : "deepspeed/runtime/zero/stage_1_and_2.py "
                                               "estimate_zero2_model_states_mem_needs"},
                     {"stage", o.stage},
                     {"total_params", o.params},
                     {"gpus_per_node", o.gpus_per_node},
                     {"nodes", o.nodes},
                     {"offload_optimizer", o.offload_optimizer},
                     {"offload_param", o.offload_param},
                     {"zero_init", o.zero_init},
                     {"additional_buffer_factor", 1.5},
                     {"cpu_bytes", e.cpu_bytes},
                     {"gpu_bytes", e.gpu_bytes}};
    if (o.stage == 3) j["largest_layer_params"] = *o.largest_layer;
    if (o.stage != 3) j["zero2_formula"] = o.deepspeed_legacy ? "legacy" : "current";
    fmt::print("{}\n", j.dump(2));
  } else {
    fmt::print("{}", text);  // DeepSpeed's text, its 2**30-byte units labelled "GB" included
  }
}

void run_zero_paper(const EstimateOptions& o) {
  const std::int32_t ranks = o.gpus_per_node * o.nodes;
  const std::int64_t trainable = o.trainable.value_or(o.params);
  planner::PeftModelStatesInput in;
  in.base_params = o.params - trainable;  // frozen
  in.base_dtype = DType::bf16;
  in.trainable_params = trainable;
  in.trainable_dtype = DType::bf16;
  in.optimizer_bytes_per_param = planner::kAdamMixedK;
  // The stages: the one asked for, or each the offload flags allow.
  std::vector<int> stages;
  for (int st = 0; st <= 3; ++st)
    if (o.stage == st || (o.stage == -1 && (!o.offload_optimizer || planner::can_offload_optimizer(to_stage(st))) &&
                          (!o.offload_param || planner::can_offload_params(to_stage(st)))))
      stages.push_back(st);
  auto bytes_of = [&](int st) {
    return planner::peft_model_states_bytes(in, ranks, to_stage(st), o.offload_optimizer ? planner::OffloadDevice::cpu : planner::OffloadDevice::none,
                                            o.offload_param ? planner::OffloadDevice::cpu : planner::OffloadDevice::none);
  };
  if (o.json) {
    auto one = [&](int st) {
      const planner::ModelStatesBytes b = bytes_of(st);
      nlohmann::json j{{"source", "ZeRO (arXiv 1910.02054) section 5; PEFT generalisation with frozen base"},
                       {"stage", st},
                       {"ranks", ranks},
                       {"total_params", o.params},
                       {"trainable_params", trainable},
                       {"frozen_params", in.base_params},
                       {"optimizer_bytes_per_param", in.optimizer_bytes_per_param},
                       {"offload_optimizer", o.offload_optimizer},
                       {"offload_param", o.offload_param},
                       {"model_states_bytes", b.gpu_total_bytes()},
                       {"base_weights_bytes", b.base_weights_bytes},
                       {"trainable_weights_bytes", b.trainable_weights_bytes},
                       {"gradients_bytes", b.gradients_bytes},
                       {"optimizer_states_bytes", b.optimizer_states_bytes},
                       {"host_bytes", b.host_bytes}};
      if (!o.model.empty()) j["model"] = o.model;
      return j;
    };
    if (o.stage >= 0) {
      fmt::print("{}\n", one(o.stage).dump(2));
    } else {  // every stage: one object each, in stage order
      nlohmann::json rows = nlohmann::json::array();
      for (int st : stages) rows.push_back(one(st));
      fmt::print("{}\n", rows.dump(2));
    }
    return;
  }
  const std::string what = o.model_label.empty() ? std::string() : fmt::format(": {}", o.model_label);
  if (o.stage >= 0) {
    const planner::ModelStatesBytes b = bytes_of(o.stage);
    auto both = [](std::uint64_t bytes) {
      return fmt::format("{:9.2f} GiB {:9.2f} GB", to_gib(bytes), static_cast<double>(bytes) / kGB);
    };
    fmt::print("model states per GPU, ZeRO stage {} on {} GPU{} (ZeRO paper section 5, K = {}){}:\n", o.stage, ranks, ranks > 1 ? "s" : "",
               in.optimizer_bytes_per_param, what);
    fmt::print("  params: {} total, {} trainable, {} frozen (bf16)\n", with_commas(o.params), with_commas(trainable),
               with_commas(in.base_params));
    fmt::print("  frozen weights      {}\n", both(b.base_weights_bytes));
    fmt::print("  trainable weights   {}\n", both(b.trainable_weights_bytes));
    fmt::print("  gradients           {}\n", both(b.gradients_bytes));
    fmt::print("  optimizer states    {}\n", both(b.optimizer_states_bytes));
    fmt::print("  total per GPU       {}\n", both(b.gpu_total_bytes()));
    if (b.host_bytes > 0) fmt::print("  offloaded per rank  {} (host)\n", both(b.host_bytes));
    return;
  }
  fmt::print("model states per GPU on {} GPU{} (ZeRO paper section 5, K = {}){}, GiB:\n", ranks, ranks > 1 ? "s" : "",
             in.optimizer_bytes_per_param, what);
  fmt::print("  params: {} total, {} trainable, {} frozen (bf16)\n", with_commas(o.params), with_commas(trainable), with_commas(in.base_params));
  const bool host = o.offload_optimizer || o.offload_param;
  fmt::print("  {:<6} {:>10} {:>10} {:>10} {:>10} {:>10}{}\n", "stage", "frozen", "trainable", "gradients", "optimizer", "total", host ? "   offloaded (host)" : "");
  for (int st : stages) {
    const planner::ModelStatesBytes b = bytes_of(st);
    fmt::print("  {:<6} {:>10.2f} {:>10.2f} {:>10.2f} {:>10.2f} {:>10.2f}{}\n", st == 0 ? "0 ddp" : std::to_string(st), to_gib(b.base_weights_bytes),
               to_gib(b.trainable_weights_bytes), to_gib(b.gradients_bytes), to_gib(b.optimizer_states_bytes), to_gib(b.gpu_total_bytes()),
               host ? fmt::format(" {:>18.2f}", to_gib(b.host_bytes)) : "");
  }
}

}  // namespace

void add_estimate_command(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand("estimate", "model-states memory per GPU (ZeRO paper, or DeepSpeed's estimators)");
  cmd->footer("example: peftplan estimate --model llama-2-7b --lora-r 16 --gpus 8");
  auto o = std::make_shared<EstimateOptions>();
  auto* params = cmd->add_option("--params", o->params, "all parameters P (frozen + trainable); or --model");
  cmd->add_option("--trainable-params", o->trainable, "trainable parameters T (PEFT adapters); default: all of P");
  cmd->add_option("--largest-layer-params", o->largest_layer, "parameters of the largest module (DeepSpeed ZeRO-3)");
  cmd->add_option("--model", o->model, "zoo name, config.json, or a folder holding one: P, T and the largest module counted from it "
                                       "and the adapter flags (LoRA with PEFT's defaults unless --full-finetune)");
  add_peft_flags(cmd, o->peft);
  cmd->add_flag("--full-finetune", o->peft.full_finetune, "with --model: every weight trains (no adapter)");
  cmd->add_option("--gpus", o->gpus, "all GPUs, spread evenly over --nodes; or --gpus-per-node");
  auto* per_node = cmd->add_option("--gpus-per-node", o->gpus_per_node, "GPUs per node");
  cmd->add_option("--nodes", o->nodes, "nodes (default 1)");
  cmd->add_option("--stage", o->stage, "0 (DDP), 1, 2 or 3 (ZeRO stage); default: a row for every stage");
  cmd->add_flag("--offload-optimizer", o->offload_optimizer, "optimizer states (and gradients) on the CPU");
  cmd->add_flag("--offload-param", o->offload_param, "parameters on the CPU (ZeRO-3 only)");
  cmd->add_flag("--zero-init", o->zero_init, "deepspeed.zero.Init (DeepSpeed ZeRO-3 CPU estimate)");
  cmd->add_flag("--deepspeed-compat", o->deepspeed_compat, "DeepSpeed's estimators and their exact printed table");
  cmd->add_flag("--deepspeed-legacy", o->deepspeed_legacy,
                "with --deepspeed-compat: ZeRO-2 formula before DeepSpeed PR #5099 (4P + 16P/N)");
  cmd->add_flag("--json", o->json, "machine-readable output (raw bytes)");
  cmd->callback([&exit_code, o, params, per_node] {
    resolve(*o, params->count() > 0, per_node->count() > 0);
    validate(*o);
    if (o->deepspeed_compat) run_deepspeed_compat(*o);
    else run_zero_paper(*o);
    exit_code = 0;
  });
}

}  // namespace peftplan::cli
