// make_plan: build, walk, simulate, judge. The verdict's reasons name the categories that take
// the memory and suggest the knob that shrinks them.
#include "peftplan/planner/plan.h"

#include <algorithm>

#include <fmt/format.h>

#include "builder.h"
#include "peftplan/common/schemas.h"
#include "peftplan/common/units.h"
#include "peftplan/planner/runtime.h"
#include "peftplan/sim/caching_allocator.h"
#include "peftplan/sim/trace.h"
#include "peftplan/sim/verify.h"

namespace peftplan::planner {
namespace {

using sim::MemCategory;

std::uint64_t cat(const sim::MemoryProfile& m, MemCategory c) { return m.at_peak_bytes[static_cast<std::size_t>(c)]; }

}  // namespace

std::vector<Suggestion> fit_suggestions(MemCategory c, const PlanInput& in) {
  const bool fsdp_stack = in.profile == RuntimeProfile::hf;  // the hf profile shards with FSDP
  const Stage s = in.strategy.stage;
  const bool can_quantise = !in.peft.quantization.has_value() && !in.peft.adapters.empty();
  const std::string sharded_stage(name_of(fsdp_stack ? Stage::fsdp_full_shard : Stage::zero3));
  std::vector<Suggestion> out;
  auto quant = [&] {
    if (can_quantise) out.push_back({Knob::quantization, Change::set, "nf4", "QLoRA"});
  };
  switch (c) {
    case MemCategory::activations:
      if (in.training.checkpointing == Checkpointing::none) out.push_back({Knob::checkpointing, Change::set, "full", "activation checkpointing"});
      else out.insert(out.end(), {{Knob::micro_batch, Change::smaller, "", ""}, {Knob::seq_len, Change::smaller, "", ""}});
      break;
    case MemCategory::workspace:
      if (in.training.attention == Attention::eager) out.push_back({Knob::attention, Change::set, "flash", "no [B, nh, S, S] scores"});
      else out.push_back({Knob::micro_batch, Change::smaller, "", "logits and backward temporaries scale with it"});
      break;
    case MemCategory::base_weights:
      if (!shards_params(s)) {
        out.push_back({Knob::stage, Change::set, sharded_stage, "shards the frozen base"});
      } else {
        out.push_back({Knob::ranks, Change::larger, "", "a smaller shard each"});
        out.push_back({Knob::offload_param, Change::set, "cpu", ""});
      }
      quant();
      break;
    case MemCategory::gathered_weights:
      if (fsdp_stack) {
        out.push_back({Knob::stage, Change::set, std::string(name_of(Stage::fsdp_full_shard)), "one unit gathered at a time"});
      } else {
        out.push_back({Knob::stage3_prefetch_bucket_size, Change::smaller, "", ""});
        out.push_back({Knob::stage3_max_live_parameters, Change::smaller, "", ""});
      }
      break;
    case MemCategory::optimizer_states:
    case MemCategory::gradients:
      if (fsdp_stack && shards_grads(s)) out.push_back({Knob::offload_param, Change::set, "cpu", "FSDP's CPUOffload"});
      else if (fsdp_stack)
        out.insert(out.end(), {{Knob::stage, Change::set, std::string(name_of(Stage::fsdp_shard_grad_op)), ""},
                               {Knob::stage, Change::set, std::string(name_of(Stage::fsdp_full_shard)), ""}});
      else if (s == Stage::ddp || s == Stage::zero1)
        out.insert(out.end(), {{Knob::stage, Change::set, "zero2", ""}, {Knob::stage, Change::set, "zero3", ""}});
      else out.push_back({Knob::offload_optimizer, Change::set, "cpu", ""});
      break;
    case MemCategory::trainable_weights:
      out.push_back({Knob::stage, Change::set, sharded_stage, ""});
      if (!in.peft.adapters.empty()) out.push_back({Knob::lora_r, Change::smaller, "", "a smaller adapter"});
      break;
    case MemCategory::comm_buffers: out.push_back({Knob::reduce_bucket_size, Change::smaller, "", ""}); break;
    default: out.push_back({Knob::gpu, Change::larger, "", ""}); break;
  }
  // No offload the optimizer cannot follow to the host (8-bit AdamW): more GPUs shrink what the
  // offload would have moved, where the stage shards it.
  const std::size_t before = out.size();
  std::erase_if(out, [&](const Suggestion& x) {
    Strategy st = in.strategy;
    if (x.knob == Knob::offload_optimizer) st.offload_optimizer = OffloadDevice::cpu;
    else if (x.knob == Knob::offload_param) st.offload_param = OffloadDevice::cpu;
    else return false;
    return host_step_refused(in.training.optimizer, st);
  });
  if (out.size() < before && shards_grads(s) &&
      std::none_of(out.begin(), out.end(), [](const Suggestion& x) { return x.knob == Knob::ranks; }))
    out.push_back({Knob::ranks, Change::larger, "", "a smaller shard each"});
  return out;
}

std::string largest_categories(const std::array<std::uint64_t, sim::kNumCategories>& at_peak, int n) {
  std::vector<MemCategory> order;
  for (int c = 0; c < sim::kNumDeviceCategories; ++c) order.push_back(static_cast<MemCategory>(c));
  auto bytes = [&](MemCategory c) { return at_peak[static_cast<std::size_t>(c)]; };
  std::stable_sort(order.begin(), order.end(), [&](MemCategory a, MemCategory b) { return bytes(a) > bytes(b); });
  std::string s;
  for (int i = 0; i < n && i < static_cast<int>(order.size()); ++i)
    if (bytes(order[static_cast<std::size_t>(i)]) > 0)
      s += fmt::format("{}{} {:.1f} GiB", i ? ", " : "", sim::name_of(order[static_cast<std::size_t>(i)]), to_gib(bytes(order[static_cast<std::size_t>(i)])));
  return s;
}

std::uint64_t headroom_bytes(const Plan& p) {
  return static_cast<std::uint64_t>(p.headroom_fraction * static_cast<double>(p.device_capacity_bytes));
}

std::int64_t spare_bytes(const Plan& p) {
  return static_cast<std::int64_t>(p.device_capacity_bytes) - static_cast<std::int64_t>(headroom_bytes(p)) -
         static_cast<std::int64_t>(p.used_peak_bytes);
}

namespace {

void judge(Plan& p) {
  const auto& m = p.memory;
  p.fits = true;
  if (p.used_peak_bytes + headroom_bytes(p) > p.device_capacity_bytes || p.allocator_oom) {
    p.fits = false;
    const std::string top = largest_categories(m.at_peak_bytes);
    MemCategory largest = MemCategory::activations;
    for (int c = 0; c < sim::kNumDeviceCategories; ++c)
      if (cat(m, static_cast<MemCategory>(c)) > cat(m, largest)) largest = static_cast<MemCategory>(c);
    p.reasons.push_back(fmt::format("needs {:.1f} GiB per GPU in use ({:.1f} GiB allocated, {:.1f} GiB reserved) plus {:.0f}% "
                                    "headroom, has {:.1f} GiB{}: {} at micro-batch {}",
                                    to_gib(p.used_peak_bytes), to_gib(m.device_peak_bytes), to_gib(p.reserved_peak_bytes),
                                    100.0 * p.headroom_fraction, to_gib(p.device_capacity_bytes),
                                    p.allocator_oom ? " (the caching allocator runs out)" : "", top,
                                    p.input.training.micro_batch));
    p.suggestions = fit_suggestions(largest, p.input);
  }
  if (p.host_capacity_bytes > 0 && m.host_peak_bytes > p.host_capacity_bytes) {
    p.fits = false;
    p.reasons.push_back(fmt::format("needs {:.1f} GiB of host RAM per rank, has {:.1f} GiB (node RAM / GPUs per node); "
                                    "offloading moves memory to the host",
                                    to_gib(m.host_peak_bytes), to_gib(p.host_capacity_bytes)));
  }
}

std::string signed_gib(std::int64_t delta) {
  return fmt::format("{}{:.2f} GiB", delta >= 0 ? "+" : "-", to_gib(static_cast<std::uint64_t>(delta >= 0 ? delta : -delta)));
}

void explain(Plan& p) {
  const auto& s = p.input.strategy;
  const bool peft = !p.input.peft.adapters.empty();
  if (s.stage == Stage::ddp) {
    p.explanation.push_back(peft ? "DDP keeps the whole frozen base and the adapter on every GPU and all-reduces only "
                                   "the adapter gradients"
                                 : "DDP keeps every weight, gradient and optimizer state on every GPU");
    return;
  }
  // The unsharded reference on the same stack: DDP, or FSDP's NO_SHARD for an FSDP plan (whose
  // runtime differs from DDP's in more than sharding: sharded QLoRA's bf16 norms, for one).
  PlanInput ddp_in = p.input;
  const bool fsdp_plan = is_fsdp(s.stage);
  ddp_in.strategy.stage = fsdp_plan ? Stage::fsdp_no_shard : Stage::ddp;
  ddp_in.strategy.fsdp.version = 1;  // FSDP2 has no NO_SHARD: the flat-parameter one is the reference
  ddp_in.strategy.offload_optimizer = OffloadDevice::none;
  ddp_in.strategy.offload_param = OffloadDevice::none;
  // A reference only, built past validate(): under the deepspeed profile in pure bf16 it is a DDP
  // that DeepSpeed would not run, but its categories are still what the sharding saves.
  const sim::MemoryProfile ddp = sim::walk_memory(builder::Builder(ddp_in, BuildOptions{false}).build().program);
  std::string deltas;
  for (int c = 0; c < sim::kNumCategories; ++c) {
    const auto a = static_cast<std::int64_t>(p.memory.category_peak_bytes[static_cast<std::size_t>(c)]);
    const auto b = static_cast<std::int64_t>(ddp.category_peak_bytes[static_cast<std::size_t>(c)]);
    if (a != b) deltas += fmt::format("{}{} {}", deltas.empty() ? "" : ", ", sim::name_of(static_cast<MemCategory>(c)), signed_gib(a - b));
  }
  if (is_fsdp(s.stage)) {
    const std::string_view what =
        s.stage == Stage::fsdp_no_shard        ? "FSDP NO_SHARD keeps every weight, gradient and optimizer state on every GPU, as DDP does"
        : s.stage == Stage::fsdp_shard_grad_op ? "FSDP SHARD_GRAD_OP shards gradients and optimizer states and the parameters at rest, but keeps "
                                                 "each unit gathered from its forward to its backward"
        : s.stage == Stage::fsdp_hybrid_shard  ? "FSDP HYBRID_SHARD shards like FULL_SHARD inside a node and replicates across nodes (an all-reduce "
                                                 "of the gradient shards between them)"
                                               : "FSDP FULL_SHARD shards every parameter, gradient and optimizer state; one decoder unit is "
                                                 "gathered at a time, the root unit (embedding, final norm, head) from forward to the end of backward";
    p.explanation.push_back(std::string(what));
    if (s.fsdp.version == 2)
      p.explanation.push_back("FSDP2 (fully_shard) shards each parameter's rows (ceil(d0 / N) per rank) instead of flat units; each "
                              "all-gather's flat output is copied out into the unsharded parameters (both live for the copy; in forward "
                              "the flat output is held until the next unit's copy-out) and each unit's gradients are copied into a "
                              "reduce-scatter input held until the next unit's; no record_stream, so no block waits for the GPU");
    if (peft && s.fsdp.version == 1 && p.input.training.checkpointing != Checkpointing::none && p.input.training.checkpoint_reentrant)
      p.explanation.push_back("with reentrant checkpointing, FSDP's hook on each frozen unit's input keeps that input and its gradient "
                              "until backward ends (torch 2.4): the peak is in the first layer's backward");
  }
  const std::string what = s.stage == Stage::zero1   ? "ZeRO-1 shards the optimizer states"
                           : s.stage == Stage::zero2 ? "ZeRO-2 shards the optimizer states and gradients"
                                                     : "ZeRO-3 shards the frozen base, the trainable weights, gradients and optimizer states";
  if (!is_fsdp(s.stage)) {
    if (peft && s.stage != Stage::zero3)
      p.explanation.push_back(what + " of the adapter only: with PEFT they are small, so the saving is small");
    else if (peft)
      p.explanation.push_back(what + ": base_weights is divided by N and gathered_weights holds the layers gathered "
                                     "for compute; every step all-gathers the frozen base in forward and again in backward");
    else
      p.explanation.push_back(what);
  }
  if (s.offload_optimizer == OffloadDevice::cpu)
    p.explanation.push_back(peft ? "optimizer offload moves the adapter's optimizer states to host RAM: little GPU memory with PEFT"
                                 : "optimizer offload moves optimizer states and fp32 gradients to host RAM and runs Adam on the CPU");
  p.explanation.push_back(std::string(fsdp_plan ? "per-category peaks against FSDP NO_SHARD: " : "per-category peaks against DDP: ") +
                          (deltas.empty() ? std::string("no change") : deltas));
}

}  // namespace

PlanInput input_on(const PlanInput& input, const sim::Cluster& cluster) {
  PlanInput in = input;
  if (in.device_sm == 0) in.device_sm = cluster.gpu.compute_capability;
  return in;
}

namespace {

// make_plan after the build: `warnings` are validate(input)'s.
Plan finish_plan(const PlanInput& input, std::vector<std::string> warnings, BuiltProgram built, const sim::Cluster& cluster,
                 const PlanOptions& options);

}  // namespace

Plan make_plan(const PlanInput& input, const sim::Cluster& cluster, const PlanOptions& options) {
  std::vector<std::string> warnings = validate(input);  // refuses contradictions before the builder meets them
  return finish_plan(input, std::move(warnings), build_program(input_on(input, cluster), BuildOptions{options.names}), cluster, options);
}

Plan make_plan_with(const PlanInput& input, BuiltProgram built, const sim::Cluster& cluster, const PlanOptions& options) {
  return finish_plan(input, validate(input), std::move(built), cluster, options);
}

namespace {

Plan finish_plan(const PlanInput& input, std::vector<std::string> warnings, BuiltProgram built, const sim::Cluster& cluster,
                 const PlanOptions& options) {
  Plan p;
  p.input = input_on(input, cluster);
  p.cluster = cluster;
  p.warnings = std::move(warnings);
  // A GPU without bf16 tensor cores (before Ampere, compute capability 8.0: V100) runs bf16 GEMMs
  // on its CUDA cores, which the timeline plans; fp16 has tensor cores there.
  const bool bf16 = input.training.precision == Precision::bf16_mixed || input.training.precision == Precision::bf16_pure;
  if (bf16 && input.profile != RuntimeProfile::executor && !cluster.gpu.bf16_flops_per_s && cluster.gpu.fp16_flops_per_s > cluster.gpu.fp32_flops_per_s)
    p.warnings.push_back(fmt::format("{} has no bf16 tensor cores{}: bf16 GEMMs run at its fp32 rate ({:.1f} TFLOP/s, as planned); "
                                     "fp16 mixed precision ({}) uses its fp16 tensor cores ({:.0f} TFLOP/s)",
                                     cluster.gpu.name,
                                     cluster.gpu.compute_capability > 0 ? fmt::format(" (compute capability {}.{})", cluster.gpu.compute_capability / 10,
                                                                                      cluster.gpu.compute_capability % 10)
                                                                         : std::string(),
                                     cluster.gpu.fp32_flops_per_s / 1e12, field_of(Knob::precision), cluster.gpu.fp16_flops_per_s / 1e12));
  p.facts = built.facts;
  p.program = std::move(built.program);
  sim::verify_or_throw(p.program);  // what the walk, the allocator model and the timeline assume
  p.memory = sim::walk_memory(p.program);
  p.device_capacity_bytes = cluster.gpu.memory_bytes;
  const RuntimeRules rules = runtime_rules(p.input);
  p.runtime_versions = rules.versions;
  // NCCL: one communicator per process group a rank is in (HYBRID_SHARD: its shard group and its
  // replica group).
  const std::uint64_t communicators = p.input.strategy.ranks <= 1 ? 0 : p.input.strategy.stage == Stage::fsdp_hybrid_shard ? 2 : 1;
  p.outside_allocator_bytes = rules.context_bytes + (communicators == 0 ? 0 : rules.nccl_first_bytes + (communicators - 1) * rules.nccl_bytes);
  p.headroom_fraction = options.headroom_fraction;
  if (p.input.profile == RuntimeProfile::executor) {
    p.reserved_peak_bytes = p.used_peak_bytes = p.memory.device_peak_bytes;  // our allocator holds what it uses
  } else if (options.skip_replay_when_allocated_overflows &&
             p.memory.device_peak_bytes + p.outside_allocator_bytes + headroom_bytes(p) > p.device_capacity_bytes) {
    p.reserved_peak_bytes = p.memory.device_peak_bytes;  // reserved is at least this: judge() says it does not fit
    p.used_peak_bytes = p.reserved_peak_bytes + p.outside_allocator_bytes;
  } else {
    const std::uint64_t room = p.device_capacity_bytes > p.outside_allocator_bytes ? p.device_capacity_bytes - p.outside_allocator_bytes : 0;
    const sim::AllocatorReplay a = sim::replay_caching_allocator(p.program, sim::AllocatorConfig::parse(p.input.alloc_conf, room));
    // An allocator that ran out stopped short of the program's peak: reserved is then at least
    // what the program allocates.
    p.reserved_peak_bytes = std::max(a.reserved_peak_bytes, p.memory.device_peak_bytes);
    p.allocator_oom = a.oom.has_value();
    p.used_peak_bytes = p.reserved_peak_bytes + p.outside_allocator_bytes;
  }
  p.host_capacity_bytes = cluster.gpus_per_node > 0 ? cluster.host_ram_bytes_per_node / static_cast<std::uint64_t>(cluster.gpus_per_node) : 0;
  if (p.input.profile == RuntimeProfile::hf) {
    std::uint64_t states = 0, weights = 0;  // what lives on the device between steps; its weights
    for (const auto& op : p.program.ops) {
      if (op.kind != sim::OpKind::alloc || op.phase != sim::Phase::setup) continue;
      const auto& b = p.program.buffers[static_cast<std::size_t>(op.buffer)];
      if (sim::on_host(b.category)) continue;
      states += b.bytes;
      if (b.category == MemCategory::base_weights || b.category == MemCategory::trainable_weights) weights += b.bytes;
    }
    p.lifecycle = lifecycle_peaks(p.input, cluster, weights);
    if (p.input.training.eval_batch > 0) {
      // Trainer.evaluate: prediction_step runs the model under torch.no_grad on
      // per_device_eval_batch_size sequences with labels, and keeps only the loss when there are
      // no compute_metrics (evaluation_loop's prediction_loss_only). Between optimizer steps: the
      // weights and the optimizer states are live, the gradients are not (zero_grad).
      PlanInput ev = p.input;
      ev.training.micro_batch = p.input.training.eval_batch;
      ev.training.grad_accum = 1;
      ev.training.checkpointing = Checkpointing::full;  // no_grad: what reentrant checkpointing's forward does
      ev.training.checkpoint_reentrant = true;
      const sim::Program eval_program = build_program(ev, BuildOptions{.names = false, .evaluation = true}).program;
      p.lifecycle->eval_device_bytes = sim::walk_memory(eval_program).device_peak_bytes;
      p.lifecycle->eval_how = fmt::format("Trainer.evaluate at per_device_eval_batch_size {} (no_grad forward and loss, the logits' fp32 "
                                          "copies at the eval batch)", ev.training.micro_batch);
    }
    const auto& l = *p.lifecycle;
    if (l.eval_device_bytes > p.memory.device_peak_bytes)
      p.warnings.push_back(fmt::format("evaluation peaks at {:.2f} GiB allocated, above the step's {:.2f} GiB ({}): lower "
                                       "per_device_eval_batch_size ({}) if it does not fit",
                                       to_gib(l.eval_device_bytes), to_gib(p.memory.device_peak_bytes), l.eval_how,
                                       field_of(Knob::eval_batch)));
    const std::uint64_t node_ram = cluster.host_ram_bytes_per_node;
    if (node_ram > 0 && l.load_host_per_node_bytes > node_ram)
      p.warnings.push_back(fmt::format("loading needs {:.1f} GiB of host RAM per node, the node has {:.1f} GiB ({}): the load, not the step, "
                                       "is what runs out{}", to_gib(l.load_host_per_node_bytes), to_gib(node_ram), l.load_how,
                                       is_fsdp(p.input.strategy.stage) ? "; fsdp_cpu_ram_efficient_loading loads it once" : ""));
    if (l.load_device_bytes > p.memory.device_peak_bytes)
      p.warnings.push_back(fmt::format("loading peaks at {:.2f} GiB on the device, above the step's {:.2f} GiB allocated ({})",
                                       to_gib(l.load_device_bytes), to_gib(p.memory.device_peak_bytes), l.load_how));
    if (node_ram > 0 && l.save_host_bytes > node_ram)
      p.warnings.push_back(fmt::format("saving needs {:.1f} GiB of host RAM on rank 0's node, the node has {:.1f} GiB ({}); "
                                       "SHARDED_STATE_DICT writes a shard per rank", to_gib(l.save_host_bytes), to_gib(node_ram), l.save_how));
    if (p.memory.device_peak_bytes > 0 && l.save_device_bytes > 0 &&
        states + l.save_device_bytes > p.device_capacity_bytes)
      p.warnings.push_back(fmt::format("saving gathers {:.2f} GiB on the device beyond the model states: more than the GPU holds ({})",
                                       to_gib(l.save_device_bytes), l.save_how));
  }
  if (options.simulate_time) {
    sim::SimOptions so;
    so.compute_dtype = p.facts.compute_dtype;
    so.sustained = cluster.efficiency.sustained.value_or(rules.sustained);
    so.host_floor_s = static_cast<double>(p.facts.fsdp_unit_passes) * rules.fsdp_unit_pass_host_s;
    p.time = sim::simulate(p.program, cluster, so);
  }
  judge(p);
  if (options.explain) explain(p);
  return p;
}

}  // namespace

nlohmann::json plan_to_json(const Plan& p) {
  using nlohmann::json;
  json j;
  j["schema"] = schemas::kPlanResult;
  j["model"] = p.input.model.name;
  j["strategy"] = name_of(p.input.strategy.stage);
  j["ranks"] = p.input.strategy.ranks;
  j["profile"] = name_of(p.input.profile);
  j["runtime_versions"] = p.runtime_versions;
  j["cluster"] = p.cluster.name;
  j["params"] = {{"base_params", p.facts.base_params}, {"trainable_params", p.facts.trainable_params},
                 {"fsdp_unit_passes", p.facts.fsdp_unit_passes}};
  json dev, host;
  for (int c = 0; c < sim::kNumCategories; ++c) {
    const auto cc = static_cast<MemCategory>(c);
    (sim::on_host(cc) ? host : dev)[std::string(sim::name_of(cc)) + "_bytes"] = p.memory.category_peak_bytes[static_cast<std::size_t>(c)];
    (sim::on_host(cc) ? host : dev)["at_peak"][std::string(sim::name_of(cc)) + "_bytes"] = p.memory.at_peak_bytes[static_cast<std::size_t>(c)];
  }
  auto op_name = [&](std::int32_t i) -> std::string {
    if (i < 0) return "";
    const auto& op = p.program.ops[static_cast<std::size_t>(i)];
    return op.buffer >= 0 ? "alloc " + p.program.buffers[static_cast<std::size_t>(op.buffer)].name : std::string(op.label);
  };
  dev["peak_bytes"] = p.memory.device_peak_bytes;
  dev["allocated_peak_bytes"] = p.memory.device_peak_bytes;
  dev["reserved_peak_bytes"] = p.reserved_peak_bytes;
  dev["used_peak_bytes"] = p.used_peak_bytes;
  dev["outside_allocator_bytes"] = p.outside_allocator_bytes;
  dev["headroom_fraction"] = p.headroom_fraction;
  dev["peak_op"] = op_name(p.memory.device_peak_op);
  dev["peak_op_index"] = p.memory.device_peak_op;
  dev["capacity_bytes"] = p.device_capacity_bytes;
  host["peak_bytes"] = p.memory.host_peak_bytes;
  host["peak_op"] = op_name(p.memory.host_peak_op);
  host["capacity_bytes"] = p.host_capacity_bytes;
  j["memory"] = {{"device", dev}, {"host", host}};
  if (p.time) {
    const auto& t = *p.time;
    j["time"] = {{"step_s", t.step_s},       {"compute_s", t.compute_s},       {"comm_s", t.comm_s},
                 {"exposed_comm_s", t.exposed_comm_s}, {"sync_wait_s", t.sync_wait_s}, {"optimizer_s", t.optimizer_s}, {"offload_s", t.offload_s},
                 {"tokens_per_s", t.tokens_per_s},     {"tokens_per_s_per_gpu", t.tokens_per_s / std::max(1, p.input.strategy.ranks)},
                 {"mfu", t.mfu}, {"host_floor_s", t.host_floor_s}, {"host_bound", t.host_bound},
                 {"device_step_s", t.device_step_s}};
    json comm;
    for (int c = 0; c < sim::kNumCollectives; ++c) {
      comm[std::string(sim::name_of(static_cast<sim::Collective>(c))) + "_bytes"] = t.collective_bytes[static_cast<std::size_t>(c)];
      comm[std::string(sim::name_of(static_cast<sim::Collective>(c))) + "_count"] = t.collective_count[static_cast<std::size_t>(c)];
    }
    comm["intra_node_bytes"] = t.intra_node_bytes;
    comm["inter_node_bytes"] = t.inter_node_bytes;
    comm["device_to_host_bytes"] = t.device_to_host_bytes;
    comm["host_to_device_bytes"] = t.host_to_device_bytes;
    j["comm"] = comm;
  }
  if (p.lifecycle) {
    const auto& l = *p.lifecycle;
    j["lifecycle"] = {{"load_host_per_rank_bytes", l.load_host_per_rank_bytes}, {"load_host_per_node_bytes", l.load_host_per_node_bytes},
                      {"load_device_bytes", l.load_device_bytes},           {"save_host_bytes", l.save_host_bytes},
                      {"save_device_bytes", l.save_device_bytes},           {"eval_device_bytes", l.eval_device_bytes},
                      {"eval", l.eval_how},                                 {"load", l.load_how},
                      {"save", l.save_how}};
  }
  j["fits"] = p.fits;
  j["reasons"] = p.reasons;
  j["suggestions"] = suggestions_to_json(p.suggestions);
  j["explanation"] = p.explanation;
  j["warnings"] = p.warnings;
  return j;
}

const std::vector<SweepColumn>& sweep_columns() {
  static const std::vector<SweepColumn> columns = [] {
    std::vector<SweepColumn> c = {{"model", {"model"}}, {"strategy", {"strategy"}}, {"ranks", {"ranks"}}, {"profile", {"profile"}},
                                  {"cluster", {"cluster"}}, {"fits", {"fits"}}};
    for (int i = 0; i < sim::kNumDeviceCategories; ++i) {
      const std::string n = std::string(sim::name_of(static_cast<sim::MemCategory>(i))) + "_bytes";
      c.push_back({n, {"memory", "device", n}});
    }
    for (const char* k : {"allocated_peak_bytes", "reserved_peak_bytes", "used_peak_bytes", "outside_allocator_bytes", "capacity_bytes"})
      c.push_back({k, {"memory", "device", k}});
    c.push_back({"host_peak_bytes", {"memory", "host", "peak_bytes"}});
    for (const char* k : {"step_s", "compute_s", "comm_s", "exposed_comm_s", "optimizer_s", "offload_s", "tokens_per_s", "tokens_per_s_per_gpu", "mfu",
                          "host_bound"})
      c.push_back({k, {"time", k}});
    for (int i = 0; i < sim::kNumCollectives; ++i) {
      const std::string n = std::string(sim::name_of(static_cast<sim::Collective>(i)));
      c.push_back({n + "_bytes", {"comm", n + "_bytes"}});
    }
    c.push_back({"intra_node_bytes", {"comm", "intra_node_bytes"}});
    c.push_back({"inter_node_bytes", {"comm", "inter_node_bytes"}});
    // Added in sweep/2 (after the columns of sweep/1, whose order stays).
    c.push_back({"device_to_host_bytes", {"comm", "device_to_host_bytes"}});
    c.push_back({"host_to_device_bytes", {"comm", "host_to_device_bytes"}});
    c.push_back({"headroom_fraction", {"memory", "device", "headroom_fraction"}});
    return c;
  }();
  return columns;
}

nlohmann::json memory_trace(const Plan& p) {
  sim::TraceOptions o;
  o.process_name = "peftplan predicted memory";
  return p.time ? sim::chrome_memory_trace(p.program, *p.time, o) : sim::chrome_memory_trace(p.program, o);
}

}  // namespace peftplan::planner
