// `peftplan plan`: one configuration -> memory by category (device and host), the simultaneous
// peak and where it happens, the simulated step time and its split, communication per step,
// the verdict with reasons, and what the strategy changed. Exit code 1 when it does not fit.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>

#include <fmt/format.h>

#include "commands.h"
#include "peftplan/common/atomic_file.h"
#include "plan_flags.h"
#include "peftplan/common/error.h"
#include "peftplan/common/units.h"
#include "peftplan/planner/accelerate_config.h"
#include "peftplan/planner/ds_config.h"
#include "peftplan/planner/plan.h"
#include "peftplan/planner/plan_file.h"
#include "peftplan/planner/saved.h"
#include "peftplan/sim/trace.h"

namespace peftplan::cli {
namespace {

std::string adapter_summary(const planner::Plan& p) {
  if (p.input.peft.adapters.empty()) return "full fine-tuning";
  std::string s;
  for (const auto& a : p.input.peft.adapters) {
    if (!s.empty()) s += " + ";
    if (a.type == models::PeftType::lora) {
      std::string targets;
      switch (a.lora.targets.kind) {
        case models::ModuleSelector::Kind::none: targets = "default targets"; break;
        case models::ModuleSelector::Kind::list: targets = fmt::format("{}", fmt::join(a.lora.targets.names, ",")); break;
        case models::ModuleSelector::Kind::regex: targets = a.lora.targets.regex; break;
        case models::ModuleSelector::Kind::all_linear: targets = "all-linear"; break;
      }
      s += fmt::format("LoRA r={} alpha={:g} on {}", a.lora.r, a.lora.alpha, targets);
    } else {
      s += std::string(models::name_of(a.type));
    }
  }
  if (p.input.peft.quantization) s += fmt::format(" (base {})", name_of(p.input.peft.quantization->dtype));
  return s;
}

void print_text(const planner::Plan& p) {
  const auto& in = p.input;
  const auto& t = in.training;
  fmt::print("peftplan plan: {} · {} · {} trainable of {} parameters\n", in.model.name, adapter_summary(p),
             with_commas(p.facts.trainable_params), with_commas(p.facts.base_params + p.facts.trainable_params));
  fmt::print("strategy {}{}{} on {} ({} ranks) · micro-batch {} × seq {} × accum {} · {} · attention {} · checkpointing {}{} · profile {}\n",
             name_of(in.strategy.stage), in.strategy.offload_optimizer == planner::OffloadDevice::cpu ? " + offload optimizer" : "",
             in.strategy.offload_param == planner::OffloadDevice::cpu ? " + offload param" : "", p.cluster.name, in.strategy.ranks,
             t.micro_batch, t.seq_len, t.grad_accum, name_of(t.precision), name_of(t.attention), name_of(t.checkpointing),
             t.checkpointing == planner::Checkpointing::every_k ? fmt::format("-{}", t.checkpoint_every) : "", name_of(in.profile));
  if (!p.runtime_versions.empty()) fmt::print("profile {} models {}\n", name_of(in.profile), p.runtime_versions);
  fmt::print("\n");
  fmt::print("{:<28} {:>14} {:>14}\n", "memory per GPU (device)", "category peak", "at the peak");
  for (int c = 0; c < sim::kNumDeviceCategories; ++c)
    fmt::print("  {:<26} {:>14} {:>14}\n", sim::name_of(static_cast<sim::MemCategory>(c)),
               human_bytes(p.memory.category_peak_bytes[static_cast<std::size_t>(c)]),
               human_bytes(p.memory.at_peak_bytes[static_cast<std::size_t>(c)]));
  const auto& peak_op = p.program.ops[static_cast<std::size_t>(std::max(0, p.memory.device_peak_op))];
  fmt::print("  {:<26} {:>14}   at {} ({})\n", "simultaneous peak", human_bytes(p.memory.device_peak_bytes),
             peak_op.buffer >= 0 ? p.program.buffers[static_cast<std::size_t>(peak_op.buffer)].name : "-", sim::name_of(peak_op.phase));
  fmt::print("  {:<26} {:>14}   the categories' sum: torch.cuda.max_memory_allocated\n", "allocated peak", human_bytes(p.memory.device_peak_bytes));
  fmt::print("  {:<26} {:>14}   + the caching allocator's cached segments: max_memory_reserved\n", "reserved peak", human_bytes(p.reserved_peak_bytes));
  fmt::print("  {:<26} {:>14}   + {} outside the allocator (CUDA context, NCCL): nvidia-smi\n", "used peak", human_bytes(p.used_peak_bytes),
             human_bytes(p.outside_allocator_bytes));
  fmt::print("  {:<26} {:>14}   ({:.0f}% used, {:.0f}% headroom wanted)\n", "GPU capacity", human_bytes(p.device_capacity_bytes),
             100.0 * static_cast<double>(p.used_peak_bytes) / static_cast<double>(std::max<std::uint64_t>(1, p.device_capacity_bytes)),
             100.0 * p.headroom_fraction);
  if (p.memory.host_peak_bytes > 0) {
    fmt::print("{:<28}\n", "memory per rank (host)");
    for (int c = sim::kNumDeviceCategories; c < sim::kNumCategories; ++c)
      fmt::print("  {:<26} {:>14}\n", sim::name_of(static_cast<sim::MemCategory>(c)), human_bytes(p.memory.category_peak_bytes[static_cast<std::size_t>(c)]));
    fmt::print("  {:<26} {:>14}   of {} per rank\n", "host peak", human_bytes(p.memory.host_peak_bytes), human_bytes(p.host_capacity_bytes));
  }
  if (p.lifecycle) {
    const auto& l = *p.lifecycle;
    fmt::print("outside the step (per rank unless said)\n");
    fmt::print("  {:<26} {:>14} host, {} per node, {} device   {}\n", "loading", human_bytes(l.load_host_per_rank_bytes),
               human_bytes(l.load_host_per_node_bytes), human_bytes(l.load_device_bytes), l.load_how);
    fmt::print("  {:<26} {:>14} host on rank 0, +{} device   {}\n", "saving", human_bytes(l.save_host_bytes), human_bytes(l.save_device_bytes),
               l.save_how);
    if (l.eval_device_bytes > 0)
      fmt::print("  {:<26} {:>14} device allocated   {}\n", "evaluation", human_bytes(l.eval_device_bytes), l.eval_how);
  }
  if (p.time) {
    const auto& tm = *p.time;
    fmt::print("\ntime per step (simulated)\n");
    fmt::print("  {:<26} {:>10.4f} s    {:.0f} tokens/s over {} ranks · MFU {:.1f}%\n", "step", tm.step_s, tm.tokens_per_s,
               in.strategy.ranks, 100.0 * tm.mfu);
    fmt::print("  {:<26} {:>10.4f} s\n", "compute", tm.compute_s);
    fmt::print("  {:<26} {:>10.4f} s    exposed {:.4f} s\n", "communication", tm.comm_s, tm.exposed_comm_s);
    if (tm.sync_wait_s > 0) fmt::print("  {:<26} {:>10.4f} s    (calibrated skew)\n", "waiting for the last rank", tm.sync_wait_s);
    fmt::print("  {:<26} {:>10.4f} s\n", "optimizer", tm.optimizer_s);
    if (tm.offload_s > 0) fmt::print("  {:<26} {:>10.4f} s\n", "offload (copies + host)", tm.offload_s);
    if (tm.host_floor_s > 0)
      fmt::print("  {:<26} {:>10.4f} s    {} FSDP unit passes of hooks the GPU waits for{}\n", "host (FSDP1 hooks)", tm.host_floor_s,
                 p.facts.fsdp_unit_passes, tm.host_bound ? ": host-bound, the step's floor (a larger micro-batch adds no host time)" : "");
    fmt::print("communication per step per rank\n");
    for (int c = 0; c < sim::kNumCollectives; ++c)
      if (tm.collective_count[static_cast<std::size_t>(c)] > 0)
        fmt::print("  {:<26} {:>12} in {} calls\n", sim::name_of(static_cast<sim::Collective>(c)),
                   human_bytes(tm.collective_bytes[static_cast<std::size_t>(c)]), tm.collective_count[static_cast<std::size_t>(c)]);
    fmt::print("  {:<26} {:>12} intra-node, {} inter-node\n", "sent on links", human_bytes(tm.intra_node_bytes), human_bytes(tm.inter_node_bytes));
  }
  if (!p.explanation.empty()) {
    fmt::print("\nwhy\n");
    for (const auto& e : p.explanation) fmt::print("  - {}\n", e);
  }
  for (const auto& w : p.warnings) fmt::print("warning: {}\n", with_flags(w));
  if (p.fits) {
    fmt::print("\nverdict: fits ({} in use of {} per GPU, {:.0f}% headroom kept)\n", human_bytes(p.used_peak_bytes), human_bytes(p.device_capacity_bytes),
               100.0 * p.headroom_fraction);
  } else {
    fmt::print("\nverdict: does not fit\n");
    // The suggestions answer the device reason, which comes first when there is one.
    for (std::size_t i = 0; i < p.reasons.size(); ++i) {
      fmt::print("  - {}\n", p.reasons[i]);
      if (i == 0 && !p.suggestions.empty()) fmt::print("  - {}\n", planner::suggestion_text(p.suggestions, flag_of));
    }
  }
}

// --saved-tensors L: layer L's saved-for-backward table (planner/saved.h).
void print_saved(const planner::SavedTable& t, const planner::PlanInput& in) {
  fmt::print("\nsaved for backward by layer {} (profile {}; what its forward allocates, and keeps unless the layer is checkpointed)\n",
             t.layer, name_of(in.profile));
  fmt::print("  {:<42} {:<22} {:<5} {:>10}  {:<4}  {}\n", "tensor", "shape", "dtype", "bytes", "kept", "why");
  for (const auto& r : t.rows) {
    std::string module(r.module);
    if (const auto cut = module.rfind('.'); cut != std::string::npos) module = module.substr(cut + 1);  // q_proj
    fmt::print("  {:<42} {:<22} {:<5} {:>10}  {:<4}  {}\n", module.empty() ? std::string(r.name) : module + "." + std::string(r.name),
               planner::shape_text(r), name_of(r.dtype), human_bytes(r.bytes()), r.kept ? "yes" : "no", r.rule);
  }
  fmt::print("  {:<42} {:<22} {:<5} {:>10}\n", "kept in all", "", "", human_bytes(t.kept_bytes()));
}

nlohmann::json saved_json(const planner::SavedTable& t) {
  nlohmann::json rows = nlohmann::json::array();
  for (const auto& r : t.rows)
    rows.push_back({{"name", r.name}, {"module", r.module}, {"shape", std::vector<std::int64_t>(r.shape.begin(), r.shape.begin() + r.rank)},
                    {"dtype", name_of(r.dtype)}, {"bytes", r.bytes()}, {"kept", r.kept}, {"rule", r.rule}});
  return {{"layer", t.layer}, {"kept_bytes", t.kept_bytes()}, {"rows", rows}};
}

}  // namespace

void add_plan_command(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand("plan", "memory by category, step time and verdict for one configuration");
  cmd->footer("example: peftplan plan --model llama-2-7b --lora-r 16 --micro-batch 4 --seq-len 2048 --strategy zero2 --cluster 8xA100-80GB");
  struct Options {
    PlanFlags plan;
    bool json = false;
    std::string memory_trace, trace, write_ds_config, write_accelerate_config, write_plan;
    std::optional<std::int64_t> saved_layer;
  };
  auto o = std::make_shared<Options>();
  add_plan_flags(cmd, o->plan);
  cmd->add_flag("--json", o->json, "machine-readable output");
  cmd->add_option("--memory-trace", o->memory_trace, "write the memory timeline as Chrome trace counters")->check(kNonEmpty);
  cmd->add_option("--trace", o->trace, "write the simulated step as a Chrome trace (Perfetto)")->check(kNonEmpty);
  cmd->add_option("--write-ds-config", o->write_ds_config, "write the strategy as a DeepSpeed ds_config.json")->check(kNonEmpty);
  cmd->add_option("--write-accelerate-config", o->write_accelerate_config,
                  "write a DDP or FSDP strategy as accelerate's launch config YAML (accelerate launch --config_file)")
      ->check(kNonEmpty);
  cmd->add_option("--saved-tensors", o->saved_layer,
                  "also print what decoder layer L's forward allocates and saves for backward (shape, dtype, the rule that keeps it)");
  cmd->add_option("--write-plan", o->write_plan,
                  "write plan.json (the configuration and the cluster) for `peftplan compare` against your own job's measurement")
      ->check(kNonEmpty);
  cmd->callback([&exit_code, o] {
    ResolvedPlan r = resolve_plan_flags(o->plan);
    if (o->saved_layer && (*o->saved_layer < 0 || *o->saved_layer >= r.input.model.layers))
      throw input_error("--saved-tensors", "", fmt::format("must be a layer in [0, {})", r.input.model.layers), std::to_string(*o->saved_layer));
    planner::PlanOptions po;
    po.headroom_fraction = r.headroom_fraction;
    planner::Plan p = planner::make_plan(r.input, r.cluster, po);
    p.warnings.insert(p.warnings.begin(), r.warnings.begin(), r.warnings.end());
    // Every file asked for is made before any is written, and every folder checked: a refusal
    // (an FSDP strategy has no ds_config) or a missing folder leaves nothing half-written.
    struct Output {
      const char* flag;
      std::string path, text;
    };
    std::vector<Output> outputs;
    if (!o->memory_trace.empty()) outputs.push_back({"--memory-trace", o->memory_trace, planner::memory_trace(p).dump(1) + "\n"});
    if (!o->write_accelerate_config.empty()) {
      const std::int32_t per_node = std::max(1, r.cluster.gpus_per_node);
      outputs.push_back({"--write-accelerate-config", o->write_accelerate_config,
                         planner::write_accelerate_config(r.input.strategy, r.input.training, (r.input.strategy.ranks + per_node - 1) / per_node)});
    }
    if (!o->write_ds_config.empty())
      outputs.push_back({"--write-ds-config", o->write_ds_config, planner::write_ds_config(r.input.strategy, r.input.training).dump(1) + "\n"});
    if (!o->write_plan.empty()) {
      planner::PlanFile pf;
      pf.input = r.input;
      pf.model_source = planner::model_source_for(o->plan.model);
      pf.cluster = r.cluster;
      outputs.push_back({"--write-plan", o->write_plan, planner::plan_file_to_json(pf).dump(2) + "\n"});
    }
    if (!o->trace.empty() && p.time) {
      sim::TraceOptions to;
      to.process_name = "peftplan predicted";
      outputs.push_back({"--trace", o->trace, sim::chrome_trace(p.program, *p.time, to).dump(1) + "\n"});
    }
    for (std::size_t i = 0; i < outputs.size(); ++i) {
      const Output& out = outputs[i];
      const std::filesystem::path parent = std::filesystem::absolute(out.path).parent_path();
      std::error_code ec;
      if (!std::filesystem::is_directory(parent, ec))
        throw input_error(out.flag, "", fmt::format("its folder {} does not exist (nothing was written)", parent.string()), out.path);
      if (std::filesystem::is_directory(out.path, ec))
        throw input_error(out.flag, "", "is a folder, not a file (nothing was written)", out.path);
      // One file for two flags would keep only the last (a device or a pipe takes both).
      const std::filesystem::path mine = std::filesystem::weakly_canonical(out.path, ec);
      if (ec || (std::filesystem::exists(mine, ec) && !std::filesystem::is_regular_file(mine, ec))) continue;
      for (std::size_t j = 0; j < i; ++j) {
        const std::filesystem::path theirs = std::filesystem::weakly_canonical(outputs[j].path, ec);
        if (!ec && theirs == mine)
          throw input_error(out.flag, "", fmt::format("is also {}'s file: give each its own (nothing was written)", outputs[j].flag), out.path);
      }
    }
    // Every file staged first, then all put in place: one that cannot be written leaves none of
    // the others behind.
    std::vector<FileToWrite> files;
    for (const Output& out : outputs) files.push_back({out.flag, out.path, out.text});
    write_files_together(files);
    std::optional<planner::SavedTable> saved;
    if (o->saved_layer) saved = planner::saved_for_backward(p.input, *o->saved_layer);
    if (o->json) {
      nlohmann::json j = planner::plan_to_json(p);
      if (saved) j["saved_tensors"] = saved_json(*saved);
      fmt::print("{}\n", j.dump(2));
    } else {
      print_text(p);
      if (saved) print_saved(*saved, p.input);
    }
    exit_code = p.fits ? 0 : 1;
  });
}

}  // namespace peftplan::cli
