// Comparison reports (see report.h).
#include "peftplan/reports/report.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <exception>
#include <span>
#include <system_error>
#include <thread>

#include <fmt/format.h>

#include "peftplan/common/atomic_file.h"
#include "peftplan/common/error.h"
#include "peftplan/common/units.h"
#include "peftplan/planner/launcher_config.h"
#include "peftplan/planner/program.h"
#include "peftplan/reports/colours.h"
#include "peftplan/reports/svg.h"

namespace peftplan::reports {

std::string_view definition_of(sim::MemCategory c) {
  switch (c) {
    case sim::MemCategory::base_weights: return "the frozen base in its storage dtype (whole, or this rank's shard under ZeRO-3 / FSDP)";
    case sim::MemCategory::gathered_weights: return "sharded parameters all-gathered for compute, prefetch included";
    case sim::MemCategory::trainable_weights: return "the adapter (every weight in full fine-tuning), or this rank's shard";
    case sim::MemCategory::gradients: return "gradients of the trainable weights, whole or this rank's shard, and their buckets";
    case sim::MemCategory::optimizer_states: return "optimizer moments and fp32 master copies";
    case sim::MemCategory::activations: return "tensors saved for backward, checkpoints included";
    case sim::MemCategory::workspace: return "transients: logits and the loss's buffers, attention scores, recompute, backward temporaries";
    case sim::MemCategory::comm_buffers: return "communication buckets and flat buffers";
    case sim::MemCategory::runtime_overhead: return "library buffers inside the allocator (cuBLAS workspaces)";
    case sim::MemCategory::host_optimizer_states: return "optimizer states offloaded to host RAM";
    case sim::MemCategory::host_weights: return "weights offloaded to host RAM";
    case sim::MemCategory::host_pinned_buffers: return "pinned host buffers for offload copies";
    case sim::MemCategory::host_other: return "other host memory of the step";
  }
  return "";
}

namespace {

using planner::Plan;
using sim::MemCategory;

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

// The report's memory unit: GiB, or MiB when every strategy's peak in use is under 2 GiB (a tiny
// model on the CPU); chosen once per rendering (Scope below).
struct Unit {
  std::string_view name = "GiB";
  double bytes = kGiB;
};
thread_local Unit g_unit;
struct Scope {  // sets the unit for one rendering
  explicit Scope(const ReportInput& r) {
    std::uint64_t most = 0;
    for (const auto& s : r.strategies) most = std::max(most, s.figures.used_peak_bytes);
    g_unit = most < 2ull * (1ull << 30) ? Unit{"MiB", 1024.0 * 1024.0} : Unit{"GiB", kGiB};
  }
};
// The columns the charts and the per-column tables show: the first kMaxColumns (a sweep may have
// hundreds of rows; the "every configuration" table lists them all).
constexpr std::size_t kMaxColumns = 12;
std::span<const StrategyColumn> charted(const ReportInput& r) {
  return std::span<const StrategyColumn>(r.strategies).first(std::min(r.strategies.size(), kMaxColumns));
}

std::string gib(std::uint64_t b) { return fmt::format("{:.2f}", static_cast<double>(b) / g_unit.bytes); }
double in_unit(std::uint64_t b) { return static_cast<double>(b) / g_unit.bytes; }
std::string esc(std::string_view s) { return xml_escape(s); }

// A table cell with its raw value and the plan --json field it is.
std::string cell(const std::string& field, const std::string& raw, const std::string& shown) {
  return fmt::format(R"(<td data-field="{}" data-value="{}">{}</td>)", esc(field), esc(raw), esc(shown));
}
std::string bytes_cell(const std::string& field, std::uint64_t b) { return cell(field, std::to_string(b), gib(b)); }
std::string number_cell(const std::string& field, double v, const std::string& shown) { return cell(field, fmt::format("{:.17g}", v), shown); }

std::string signed_pct(double x) { return fmt::format("{:+.1f}%", 100 * x); }

std::string category_field(MemCategory c) { return fmt::format("memory.device.at_peak.{}_bytes", sim::name_of(c)); }

constexpr std::string_view kCss = R"CSS(
body{font-family:"DejaVu Sans",Arial,sans-serif;font-size:10.5pt;color:#222;max-width:190mm;margin:0 auto;padding:8mm}
h1{font-size:17pt;margin:0 0 4pt}h2{font-size:13pt;margin:16pt 0 6pt;border-bottom:1px solid #ccc}h3{font-size:11pt;margin:10pt 0 4pt}
table{border-collapse:collapse;width:100%;table-layout:fixed;margin:4pt 0;font-size:8.5pt}
th,td{border:1px solid #ccc;padding:2pt 3pt;text-align:right;overflow-wrap:anywhere}
th:first-child,td:first-child{text-align:left}
thead th{background:#f2f2f2}
tr>:first-child{width:24%}
#knob-table tr>:first-child,#summary tr>:first-child{width:auto}
.measured-table tr>:first-child{width:30%}
.label{display:inline-block;background:#eef3fa;border:1px solid #9db4d6;border-radius:3pt;padding:1pt 5pt;font-size:9pt}
figure{margin:6pt 0;break-inside:avoid}figcaption{font-size:8.5pt;color:#555}
svg.chart{width:100%;height:auto;display:block}
.swatch{display:inline-block;width:9pt;height:9pt;margin-right:4pt;vertical-align:middle}
ul{margin:2pt 0 2pt 14pt;padding:0}li{margin:1pt 0}
.bad{color:#b00}.good{color:#070}
.prov td{text-align:left}
@page{margin:12mm}
@media print{body{padding:0;max-width:none}h2{break-after:avoid}table,figure{break-inside:avoid}}
)CSS";

// A validation figure's value as the measured tables show it: bytes in MiB, times in seconds.
std::string figure_text(bool bytes, double x) { return bytes ? fmt::format("{:.3f} MiB", x / kGiB * 1024) : fmt::format("{:.4f} s", x); }

std::string fits_word(const Figures& f) { return f.fits ? "fits" : "does not fit"; }

// A reason followed by what to try ("...; try --strategy zero3 (shards the frozen base)").
std::string with_suggestions(const std::string& text, const std::vector<planner::Suggestion>& s, planner::KnobSpelling spell) {
  return s.empty() ? text : fmt::format("{}; {}", text, planner::suggestion_text(s, spell));
}

}  // namespace

Figures figures_of(const Plan& p) {
  Figures f;
  for (int i = 0; i < sim::kNumDeviceCategories; ++i) f.at_peak_bytes[static_cast<std::size_t>(i)] = p.memory.at_peak_bytes[static_cast<std::size_t>(i)];
  f.allocated_peak_bytes = p.memory.device_peak_bytes;
  f.reserved_peak_bytes = p.reserved_peak_bytes;
  f.used_peak_bytes = p.used_peak_bytes;
  f.outside_allocator_bytes = p.outside_allocator_bytes;
  f.host_peak_bytes = p.memory.host_peak_bytes;
  f.capacity_bytes = p.device_capacity_bytes;
  f.headroom_fraction = p.headroom_fraction;
  f.fits = p.fits;
  f.ranks = p.input.strategy.ranks;
  if (p.time) {
    const auto& t = *p.time;
    f.time = Figures::Time{t.step_s, t.compute_s, t.exposed_comm_s, t.comm_s, t.optimizer_s, t.offload_s, t.tokens_per_s,
                           t.tokens_per_s / std::max(1, p.input.strategy.ranks), t.mfu, t.host_bound};
    f.comm = Figures::Comm{t.collective_bytes, t.intra_node_bytes, t.inter_node_bytes, t.device_to_host_bytes, t.host_to_device_bytes};
  }
  return f;
}

StrategyColumn plan_column(std::string label, std::string plan_args, Plan plan) {
  StrategyColumn c;
  c.label = std::move(label);
  c.plan_args = std::move(plan_args);
  c.figures = figures_of(plan);
  c.plan = std::move(plan);
  return c;
}

std::vector<TimelineLane> predicted_timeline(const Plan& p) {
  std::vector<TimelineLane> lanes;
  if (!p.time) return lanes;
  std::array<std::vector<TimelineBar>, sim::kNumStreams> by_stream;
  for (std::size_t i = 0; i < p.program.ops.size() && i < p.time->ops.size(); ++i) {
    const sim::Op& op = p.program.ops[i];
    const sim::OpTime& t = p.time->ops[i];
    if (op.phase == sim::Phase::setup || t.end_s <= t.start_s) continue;
    if (op.kind != sim::OpKind::compute && op.kind != sim::OpKind::collective && op.kind != sim::OpKind::copy) continue;
    std::string name = !op.label.empty() ? std::string(op.label)
                       : op.kind == sim::OpKind::collective ? std::string(sim::name_of(op.collective))
                       : op.kind == sim::OpKind::copy ? std::string("copy") : std::string(sim::name_of(op.kernel));
    by_stream[static_cast<std::size_t>(op.stream)].push_back({t.start_s, t.end_s, std::move(name), op.phase, op.kind == sim::OpKind::collective});
  }
  for (int s = 0; s < sim::kNumStreams; ++s)
    if (!by_stream[static_cast<std::size_t>(s)].empty())
      lanes.push_back({fmt::format("predicted: {} stream", sim::name_of(static_cast<sim::Stream>(s))), std::move(by_stream[static_cast<std::size_t>(s)])});
  return lanes;
}

std::vector<TimelineLane> measured_timeline(const nlohmann::json& trace, const std::string& source, const std::string& what) {
  const nlohmann::json* events = trace.is_object() && trace.contains("traceEvents") ? &trace["traceEvents"] : nullptr;
  if (!events || !events->is_array()) throw input_error(source, "traceEvents", "must list the trace's events (an executor trace.json)");
  TimelineLane lane{fmt::format("measured: {}", what), {}};
  double first = 0;
  bool any = false;
  for (const auto& e : *events) {
    if (!e.is_object() || e.value("ph", std::string()) != "X" || e.value("pid", -1) != 0) continue;
    const nlohmann::json* ts = e.contains("ts") ? &e["ts"] : nullptr;
    const nlohmann::json* dur = e.contains("dur") ? &e["dur"] : nullptr;
    if (!ts || !dur || !ts->is_number() || !dur->is_number() || !std::isfinite(ts->get<double>()) || !(dur->get<double>() >= 0))
      throw input_error(source, "traceEvents[].ts/dur", "must be finite numbers of microseconds, the duration not negative", e.dump().substr(0, 80));
    sim::Phase phase = sim::Phase::forward;
    if (e.contains("args") && e["args"].is_object() && e["args"].contains("phase") && e["args"]["phase"].is_string()) {
      const std::string name = e["args"]["phase"].get<std::string>();
      for (int k = 0; k < sim::kNumPhases; ++k)
        if (sim::name_of(static_cast<sim::Phase>(k)) == name) phase = static_cast<sim::Phase>(k);
    }
    const double start = ts->get<double>() * 1e-6;
    first = any ? std::min(first, start) : start;
    any = true;
    lane.bars.push_back({start, start + dur->get<double>() * 1e-6, e.value("name", std::string("op")), phase, e.value("cat", std::string()) == "nccl"});
  }
  if (!any) return {};
  for (auto& b : lane.bars) {  // from the start of the step
    b.start_s -= first;
    b.end_s -= first;
  }
  return {std::move(lane)};
}

std::vector<StrategyColumn> seed_strategies(const planner::PlanInput& input, const sim::Cluster& cluster, double headroom,
                                            std::vector<std::string>* refused) {
  using planner::OffloadDevice, planner::Stage;
  struct Want {
    std::string label, args;
    Stage stage;
    OffloadDevice opt, param;
    bool full_ft;
    planner::RuntimeProfile profile;
  };
  std::vector<Want> wants;
  const bool peft = !input.peft.adapters.empty();
  const bool hf = input.profile == planner::RuntimeProfile::hf;
  auto add = [&](Stage s, OffloadDevice o, OffloadDevice q, bool full) {
    std::string label = std::string(name_of(s));
    std::string args = fmt::format("--strategy {}", name_of(s));
    if (o == OffloadDevice::cpu) {
      label += " + offload optimizer";
      args += " --offload-optimizer cpu";
    }
    if (q == OffloadDevice::cpu) {
      label += planner::is_fsdp(s) ? " + offload params" : " + offload param";
      args += " --offload-param cpu";
    }
    if (full) {
      label = "full FT " + label;
      args += " --full-finetune";
    }
    // A column DeepSpeed cannot run (pure-bf16 DDP) is planned as what runs it, as plan and
    // recommend do (planner::profile_that_runs), and says so.
    planner::Strategy strategy = input.strategy;
    strategy.stage = s;
    strategy.offload_optimizer = o;
    strategy.offload_param = q;
    const planner::RuntimeProfile runs = planner::profile_that_runs(input.profile, strategy, input.training);
    if (runs != input.profile) {
      label += fmt::format(" ({})", planner::name_of(runs));
      args += fmt::format(" --profile {}", planner::name_of(runs));
    }
    wants.push_back({label, args, s, o, q, full, runs});
  };
  // Full fine-tuning beside the adapter, except of a checkpoint saved quantised, which the
  // Trainer refuses to fine-tune whole (models::apply_checkpoint_quantization).
  if (peft && !input.model.checkpoint_quantization) add(Stage::ddp, OffloadDevice::none, OffloadDevice::none, true);
  if (hf) {
    for (Stage s : {Stage::ddp, Stage::fsdp_no_shard, Stage::fsdp_shard_grad_op, Stage::fsdp_full_shard}) add(s, OffloadDevice::none, OffloadDevice::none, false);
    add(Stage::fsdp_full_shard, OffloadDevice::none, OffloadDevice::cpu, false);
  } else {
    for (Stage s : {Stage::ddp, Stage::zero1, Stage::zero2, Stage::zero3}) add(s, OffloadDevice::none, OffloadDevice::none, false);
    add(Stage::zero2, OffloadDevice::cpu, OffloadDevice::none, false);
    add(Stage::zero3, OffloadDevice::cpu, OffloadDevice::cpu, false);
  }
  // Each column is a make_plan of its own (no DDP reference for an explanation the columns do
  // not show), the PEFT columns sharing one inventory, planned side by side over the cores: the
  // explorer re-plans every column on each change (bench/bench_gui).
  planner::PlanOptions po;
  po.headroom_fraction = headroom;
  po.explain = false;
  planner::PlanInput shared = input;
  if (!shared.inventory) shared.inventory = std::make_shared<const planner::ModelInventory>(planner::make_inventory(shared.model, shared.peft));
  std::vector<std::optional<planner::Plan>> plans(wants.size());
  std::vector<std::exception_ptr> errors(wants.size());
  auto plan_one = [&](std::size_t i) {
    const Want& w = wants[i];
    try {
      planner::PlanInput in = shared;
      in.strategy.stage = w.stage;
      in.strategy.offload_optimizer = w.opt;
      in.strategy.offload_param = w.param;
      in.strategy.shard_group = 0;
      in.profile = w.profile;
      if (w.full_ft) {
        in.peft = {};
        in.training.full_finetune = true;
        in.inventory.reset();
      }
      plans[i] = planner::make_plan(in, cluster, po);
    } catch (...) {
      errors[i] = std::current_exception();
    }
  };
  const std::size_t threads = std::clamp<std::size_t>(std::thread::hardware_concurrency(), 1, wants.size());
  std::atomic<std::size_t> next{0};
  std::vector<std::thread> pool;
  for (std::size_t t = 1; t < threads; ++t)
    pool.emplace_back([&] {
      for (std::size_t i; (i = next++) < wants.size();) plan_one(i);
    });
  for (std::size_t i; (i = next++) < wants.size();) plan_one(i);
  for (auto& t : pool) t.join();
  std::vector<StrategyColumn> out;
  std::exception_ptr first_refusal;
  for (std::size_t i = 0; i < wants.size(); ++i) {
    if (errors[i]) {
      try {
        std::rethrow_exception(errors[i]);
      } catch (const planner::KnobError& e) {  // this strategy with these settings: left out, with why
        if (!first_refusal) first_refusal = errors[i];
        if (refused) refused->push_back(fmt::format("{}: {}", wants[i].label, e.what()));
        continue;
      }  // anything else is the first column's error, as planning them in turn would throw
    }
    out.push_back(plan_column(wants[i].label, wants[i].args, std::move(*plans[i])));
  }
  if (out.empty() && first_refusal) std::rethrow_exception(first_refusal);
  return out;
}

std::vector<KnobDelta> knob_deltas(const Plan& base) {
  using planner::Checkpointing, planner::OffloadDevice, planner::Stage;
  std::vector<KnobDelta> out;
  planner::PlanOptions po;
  po.headroom_fraction = base.headroom_fraction;
  po.explain = false;
  po.names = false;  // only the figures of each neighbour are shown
  auto try_one = [&](const std::string& knob, const std::string& change, planner::PlanInput in) {
    try {
      const Plan p = planner::make_plan(in, base.cluster, po);
      KnobDelta d{knob, change, p.fits, static_cast<std::int64_t>(p.used_peak_bytes) - static_cast<std::int64_t>(base.used_peak_bytes), 0, 0};
      if (p.time && base.time) {
        d.step_delta = p.time->step_s / base.time->step_s - 1;
        d.tokens_delta = p.time->tokens_per_s / base.time->tokens_per_s - 1;
      }
      out.push_back(d);
    } catch (const InputError&) {  // a combination the planner refuses is not a knob here
    }
  };
  const auto& in = base.input;
  const auto mb = in.training.micro_batch;
  {
    auto x = in;
    x.training.micro_batch = mb * 2;
    try_one("micro-batch", fmt::format("{} -> {}", mb, mb * 2), x);
  }
  if (mb >= 2) {
    auto x = in;
    x.training.micro_batch = mb / 2;
    try_one("micro-batch", fmt::format("{} -> {}", mb, mb / 2), x);
  }
  {
    auto x = in;
    const bool on = in.training.checkpointing != Checkpointing::none;
    x.training.checkpointing = on ? Checkpointing::none : Checkpointing::full;
    try_one("checkpointing", on ? fmt::format("{} -> none", name_of(in.training.checkpointing)) : "none -> full", x);
  }
  if (planner::can_offload_optimizer(in.strategy.stage)) {
    auto x = in;
    const bool on = in.strategy.offload_optimizer == OffloadDevice::cpu;
    x.strategy.offload_optimizer = on ? OffloadDevice::none : OffloadDevice::cpu;
    if (on) x.strategy.offload_param = OffloadDevice::none;
    try_one("offload", on ? "optimizer offload off" : "optimizer offload on", x);
  }
  if (planner::can_offload_params(in.strategy.stage)) {
    auto x = in;
    const bool on = in.strategy.offload_param == OffloadDevice::cpu;
    x.strategy.offload_param = on ? OffloadDevice::none : OffloadDevice::cpu;
    if (!on && !planner::is_fsdp(in.strategy.stage)) x.strategy.offload_optimizer = OffloadDevice::cpu;
    try_one("offload", on ? "parameter offload off" : "parameter offload on", x);
  }
  const std::vector<Stage> ladder = planner::is_fsdp(in.strategy.stage)
                                        ? std::vector<Stage>{Stage::fsdp_no_shard, Stage::fsdp_shard_grad_op, Stage::fsdp_full_shard}
                                        : std::vector<Stage>{Stage::ddp, Stage::zero1, Stage::zero2, Stage::zero3};
  for (std::size_t i = 0; i < ladder.size(); ++i) {
    if (ladder[i] != in.strategy.stage) continue;
    for (int step : {+1, -1}) {
      const auto j = static_cast<std::ptrdiff_t>(i) + step;
      if (j < 0 || j >= static_cast<std::ptrdiff_t>(ladder.size())) continue;
      auto x = in;
      x.strategy.stage = ladder[static_cast<std::size_t>(j)];
      if (!planner::can_offload_params(x.strategy.stage)) x.strategy.offload_param = OffloadDevice::none;
      if (!planner::can_offload_optimizer(x.strategy.stage)) x.strategy.offload_optimizer = OffloadDevice::none;
      try_one("stage", fmt::format("{} -> {}", name_of(in.strategy.stage), name_of(x.strategy.stage)), x);
    }
  }
  return out;
}

std::string memory_chart_svg(const ReportInput& r) {
  const Scope scope(r);
  BarChart c;
  c.title = fmt::format("Memory per GPU by category, {} ({})", r.provenance.label, g_unit.name);
  c.unit = fmt::format("{} per GPU", g_unit.name);
  std::uint64_t capacity = 0;
  double headroom = 0;
  for (const auto& s : charted(r)) {
    const Figures& f = s.figures;
    capacity = std::max(capacity, f.capacity_bytes);
    headroom = f.headroom_fraction;
    Bar b;
    b.label = s.label;
    for (int i = 0; i < sim::kNumDeviceCategories; ++i) {
      const auto cat = static_cast<MemCategory>(i);
      const std::uint64_t v = f.at_peak_bytes[static_cast<std::size_t>(i)];
      b.segments.push_back({std::string(sim::name_of(cat)), in_unit(v), std::string(colour_of(cat)),
                            fmt::format("{}: {} {} at the peak ({})", sim::name_of(cat), gib(v), g_unit.name, s.label)});
    }
    const std::uint64_t cache = f.reserved_peak_bytes - std::min(f.reserved_peak_bytes, f.allocated_peak_bytes);
    b.segments.push_back({"allocator cache (reserved - allocated)", in_unit(cache), "#cfcfcf",
                          fmt::format("the caching allocator's cached segments: {} {} ({})", gib(cache), g_unit.name, s.label)});
    b.segments.push_back({"outside the allocator (CUDA context, NCCL)", in_unit(f.outside_allocator_bytes), "#9a9a9a",
                          fmt::format("outside the allocator: {} {u} ({}); the bar's top is what nvidia-smi shows, {} {u}", gib(f.outside_allocator_bytes),
                                      s.label, gib(f.used_peak_bytes), fmt::arg("u", g_unit.name))});
    b.note = !s.note.empty() ? s.note : f.fits ? "" : "does not fit";
    c.bars.push_back(std::move(b));
  }
  // The GPU's memory and the headroom, unless they are far off the bars' scale (a tiny model).
  if (r.strategies.size() > kMaxColumns) c.subtitle = fmt::format("the first {} of {} {}; every one is in the table below", kMaxColumns, r.strategies.size(), r.columns_are);
  const double tallest = tallest_bar(c);
  if (in_unit(capacity) <= 3 * tallest) {
    c.lines.push_back({in_unit(capacity), fmt::format("GPU memory {:.0f} {}", in_unit(capacity), g_unit.name)});
    if (headroom > 0) c.lines.push_back({in_unit(capacity) * (1 - headroom), fmt::format("{:.0f}% headroom kept", 100 * headroom)});
  } else {
    c.subtitle = (c.subtitle.empty() ? "" : c.subtitle + "; ") + fmt::format("the device's {:.0f} {} is off this scale", in_unit(capacity), g_unit.name);
  }
  return stacked_bars_svg(c);
}

std::string time_chart_svg(const ReportInput& r) {
  BarChart c;
  c.title = fmt::format("Step time per strategy, {} (s)", r.provenance.label);
  c.unit = "seconds per optimizer step";
  for (const auto& s : charted(r)) {
    const Figures& f = s.figures;
    if (!f.time) continue;
    const auto& t = *f.time;
    const double rest = std::max(0.0, t.step_s - t.compute_s - t.exposed_comm_s);
    Bar b;
    b.label = s.label;
    b.segments = {{"compute", t.compute_s, std::string(kComputeColour), fmt::format("compute {:.3f} s ({})", t.compute_s, s.label)},
                  {"exposed communication", t.exposed_comm_s, std::string(kCommColour),
                   std::isnan(t.comm_s) ? fmt::format("exposed communication {:.3f} s ({})", t.exposed_comm_s, s.label)
                                       : fmt::format("exposed communication {:.3f} s of {:.3f} s transferred ({})", t.exposed_comm_s, t.comm_s, s.label)},
                  {t.host_bound ? "host-bound (FSDP hooks)" : "offload, CPU optimizer and other waits", rest,
                   std::string(t.host_bound ? kHostColour : kOffloadColour), fmt::format("{:.3f} s beyond compute and exposed communication ({})", rest, s.label)}};
    b.note = fmt::format("{:.3f} s, {} tok/s{}", t.step_s, with_commas(static_cast<std::int64_t>(t.tokens_per_s + 0.5)), f.fits ? "" : ", does not fit");
    c.bars.push_back(std::move(b));
  }
  return horizontal_bars_svg(c);
}

namespace {

// The file a strategy's step timeline goes to beside report.md ("timeline-zero3-offload-optimizer.svg").
std::string timeline_file(const StrategyColumn& s) {
  std::string name = "timeline-";
  for (char ch : s.label) {
    const bool keep = (ch >= 'a' && ch <= 'z') || (ch >= '0' && ch <= '9');
    if (keep) name += ch;
    else if (ch >= 'A' && ch <= 'Z') name += static_cast<char>(ch - 'A' + 'a');
    else if (name.back() != '-') name += '-';
  }
  while (name.back() == '-') name.pop_back();
  return name + ".svg";
}

bool has_timeline(const StrategyColumn& s) { return s.plan && s.plan->time && !s.measured_steps.empty(); }

// The predicted step above the measured one, on one time axis in milliseconds.
std::string timeline_chart_svg(const StrategyColumn& s) {
  LaneChart c;
  c.title = fmt::format("One step of {}: predicted above, measured below (ms)", s.label);
  c.unit = "milliseconds from the start of the step";
  std::vector<TimelineLane> lanes = predicted_timeline(*s.plan);
  lanes.insert(lanes.end(), s.measured_steps.begin(), s.measured_steps.end());
  std::array<bool, sim::kNumPhases> phase_seen{};
  bool collective_seen = false;
  for (const auto& l : lanes) {
    Lane lane{l.label, {}};
    for (const auto& b : l.bars) {
      const std::string colour(b.collective ? kCommColour : colour_of(b.phase));
      (b.collective ? collective_seen : phase_seen[static_cast<std::size_t>(b.phase)]) = true;
      lane.bars.push_back({b.start_s * 1e3, b.end_s * 1e3, colour,
                           fmt::format("{} ({}{}): {:.3f} to {:.3f} ms, {:.3f} ms ({})", b.name, b.collective ? "collective, " : "", sim::name_of(b.phase),
                                       b.start_s * 1e3, b.end_s * 1e3, (b.end_s - b.start_s) * 1e3, l.label)});
    }
    c.lanes.push_back(std::move(lane));
  }
  for (int k = 0; k < sim::kNumPhases; ++k)
    if (phase_seen[static_cast<std::size_t>(k)]) c.legend.push_back({std::string(sim::name_of(static_cast<sim::Phase>(k))), std::string(colour_of(static_cast<sim::Phase>(k)))});
  if (collective_seen) c.legend.push_back({"collective", std::string(kCommColour)});
  return lanes_svg(c);
}

// Where the measured step's time went against the prediction: the op that differs most and the
// op kinds that differ most (validate.h's OpDiff).
std::string op_by_op_html(const planner::Validation& v) {
  std::string h = fmt::format("<p>Op by op, from round {}'s {}.{}</p>\n", v.op_round + 1, esc(v.op_time_source),
                              v.most_different ? " Differs most: " + esc(planner::describe(*v.most_different)) + "." : std::string());
  if (v.kinds.empty()) return h;
  h += "<table class=\"op-kinds\"><thead><tr><th>op kind (phase, kernel, label)</th><th>ops</th><th>predicted (ms)</th><th>measured (ms)</th>"
       "<th>difference (ms)</th></tr></thead><tbody>\n";
  for (std::size_t i = 0; i < std::min<std::size_t>(5, v.kinds.size()); ++i) {
    const auto& d = v.kinds[i];
    h += fmt::format("<tr><td>{}, {}, {}</td><td>{}</td><td>{:.3f}</td><td>{:.3f}</td><td>{:+.3f}</td></tr>\n", esc(d.phase), esc(d.kernel), esc(d.label), d.ops,
                     d.predicted_s * 1e3, d.measured_s * 1e3, d.diff_s() * 1e3);
  }
  return h + "</tbody></table>\n";
}

// One row per column: the verdict, the three peaks and the step (a sweep's configurations, a
// search's rows; every one, where the charts draw the first kMaxColumns).
std::string every_column_table(const ReportInput& r) {
  std::string h = fmt::format("<h2>Every one of the {} {}</h2>\n<table id=\"every-table\"><thead><tr><th>{}</th><th>verdict</th><th>allocated ({u})</th>"
                              "<th>reserved ({u})</th><th>used ({u})</th><th>step (s)</th><th>tokens/s per GPU</th><th>MFU</th></tr></thead><tbody>\n",
                              r.strategies.size(), esc(r.columns_are), esc(r.columns_are), fmt::arg("u", g_unit.name));
  for (const auto& s : r.strategies) {
    const Figures& f = s.figures;
    h += fmt::format("<tr data-strategy=\"{}\"><td>{}</td><td data-field=\"fits\" data-value=\"{}\" class=\"{}\">{}</td>{}{}{}", esc(s.label), esc(s.label),
                     f.fits ? "true" : "false", f.fits ? "good" : "bad", esc(s.note.empty() ? fits_word(f) : s.note),
                     bytes_cell("memory.device.allocated_peak_bytes", f.allocated_peak_bytes), bytes_cell("memory.device.reserved_peak_bytes", f.reserved_peak_bytes),
                     bytes_cell("memory.device.used_peak_bytes", f.used_peak_bytes));
    if (f.time)
      h += number_cell("time.step_s", f.time->step_s, fmt::format("{:.4f}", f.time->step_s)) +
           number_cell("time.tokens_per_s_per_gpu", f.time->tokens_per_s_per_gpu, with_commas(static_cast<std::int64_t>(f.time->tokens_per_s_per_gpu + 0.5))) +
           number_cell("time.mfu", f.time->mfu, fmt::format("{:.1f}%", 100 * f.time->mfu));
    else
      h += "<td>-</td><td>-</td><td>-</td>";
    h += "</tr>\n";
  }
  return h + "</tbody></table>\n";
}

}  // namespace

std::string render_html(const ReportInput& r) {
  const std::string memory_chart = memory_chart_svg(r);
  const Scope scope(r);
  std::string h;
  h += "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\"/>\n";
  h += fmt::format("<title>{}</title>\n<style>{}</style>\n</head>\n<body>\n", esc(r.title), kCss);
  // --- header and provenance ---
  bool any_measured = false;
  for (const auto& s : r.strategies) any_measured |= s.validation.has_value();
  h += fmt::format("<header>\n<h1>{}</h1>\n<p><span class=\"label\">{}</span> {}</p>\n", esc(r.title), esc(r.provenance.label),
                   any_measured ? "Figures are predicted by peftplan's model, except those labelled \"measured on\" a machine, which a run measured."
                                : fmt::format("Every figure here is {} by peftplan's model, not measured.", r.provenance.label));
  h += "<table class=\"prov\"><tbody>\n";
  h += fmt::format("<tr><th>peftplan</th><td>{}</td></tr>\n", esc(r.provenance.version));
  h += fmt::format("<tr><th>reproduce with</th><td><code>{}</code></td></tr>\n", esc(r.provenance.command));
  for (const auto& [k, v] : r.provenance.inputs) h += fmt::format("<tr><th>{}</th><td>{}</td></tr>\n", esc(k), esc(v));
  h += "</tbody></table>\n</header>\n";
  // --- summary: the recommendation ---
  h += "<section id=\"summary\">\n<h2>Recommendation</h2>\n";
  if (r.recommendation) {
    const auto& rec = *r.recommendation;
    h += fmt::format("<p><strong>{}</strong></p>\n", esc(with_suggestions(rec.summary, rec.suggestions, r.spell)));
    if (!rec.ranked.empty()) {
      h += fmt::format("<p>Why: {}</p>\n", esc(rec.ranked.front().reason));
      h += "<table><thead><tr><th>#</th><th>strategy</th><th>micro-batch</th><th>accum</th><th>ckpt</th><th>GPUs</th><th>GiB in use</th><th>tokens/s</th><th>step s</th></tr></thead><tbody>\n";
      for (std::size_t i = 0; i < rec.ranked.size() && i < 5; ++i) {
        const auto& c = rec.ranked[i];
        const auto& t = c.input.training;
        h += fmt::format("<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{:.3f}</td></tr>\n", i + 1, esc(c.family),
                         t.micro_batch, t.grad_accum, esc(planner::name_of(planner::CheckpointChoice{t.checkpointing, t.checkpoint_every})),
                         c.input.strategy.ranks, gib(c.used_peak_bytes), with_commas(static_cast<std::int64_t>(c.tokens_per_s + 0.5)), c.step_s);
      }
      h += "</tbody></table>\n";
    }
    if (!rec.rejected.empty()) {
      h += "<p>The other strategies:</p>\n<ul>\n";
      for (const auto& x : rec.rejected)
        h += fmt::format("<li><strong>{}</strong>: {}</li>\n", esc(x.family), esc(with_suggestions(x.reason, x.suggestions, r.spell)));
      h += "</ul>\n";
    }
    if (!rec.alternatives.empty()) {
      h += "<p>Outside the search:</p>\n<ul>\n";
      for (const auto& a : rec.alternatives) h += fmt::format("<li>{}</li>\n", esc(a.what));
      h += "</ul>\n";
    }
  } else {
    h += fmt::format("<p>{}</p>\n", esc(r.no_recommendation));
  }
  h += "</section>\n";
  // --- memory ---
  h += "<section id=\"memory\">\n<h2>Memory per GPU</h2>\n";
  h += fmt::format("<figure id=\"memory-chart\">{}\n<figcaption>{}: each bar is one strategy at the user's training settings; the categories "
                   "stack to the allocated peak (torch.cuda.max_memory_allocated), the allocator's cache to reserved, and what lives outside "
                   "the allocator to what nvidia-smi shows; the red lines are the GPU's memory and the headroom the verdict keeps.</figcaption></figure>\n",
                   memory_chart, esc(r.provenance.label));
  h += fmt::format("<table id=\"memory-table\"><thead><tr><th>{} per GPU</th>", g_unit.name);
  for (const auto& s : charted(r))
    h += fmt::format("<th data-strategy=\"{}\"{}>{}</th>", esc(s.label), s.plan_args.empty() ? std::string() : fmt::format(" data-plan-args=\"{}\"", esc(s.plan_args)),
                     esc(s.label));
  h += "</tr></thead><tbody>\n";
  for (int i = 0; i < sim::kNumDeviceCategories; ++i) {
    const auto cat = static_cast<MemCategory>(i);
    h += fmt::format("<tr><th><span class=\"swatch\" style=\"background:{}\"></span>{}</th>", colour_of(cat), sim::name_of(cat));
    for (const auto& s : charted(r)) h += bytes_cell(category_field(cat), s.figures.at_peak_bytes[static_cast<std::size_t>(i)]);
    h += "</tr>\n";
  }
  auto row = [&](const std::string& name, const std::string& field, auto get) {
    h += fmt::format("<tr><th>{}</th>", esc(name));
    for (const auto& s : charted(r)) h += bytes_cell(field, get(s.figures));
    h += "</tr>\n";
  };
  row("allocated peak", "memory.device.allocated_peak_bytes", [](const Figures& f) { return f.allocated_peak_bytes; });
  row("reserved peak", "memory.device.reserved_peak_bytes", [](const Figures& f) { return f.reserved_peak_bytes; });
  row("used peak (nvidia-smi)", "memory.device.used_peak_bytes", [](const Figures& f) { return f.used_peak_bytes; });
  row("host peak per rank", "memory.host.peak_bytes", [](const Figures& f) { return f.host_peak_bytes; });
  h += "<tr><th>verdict</th>";
  for (const auto& s : charted(r))
    h += fmt::format(R"(<td data-field="fits" data-value="{}" class="{}">{}</td>)", s.figures.fits ? "true" : "false", s.figures.fits ? "good" : "bad",
                     esc(s.note.empty() ? fits_word(s.figures) : s.note));
  h += "</tr>\n</tbody></table>\n</section>\n";
  // --- time ---
  h += "<section id=\"time\">\n<h2>Step time</h2>\n";
  h += fmt::format("<figure id=\"time-chart\">{}\n<figcaption>{}: the simulated optimizer step of each strategy, split into compute, "
                   "communication that compute does not hide, and the rest (offload copies, the CPU optimizer, host-bound hooks).</figcaption></figure>\n",
                   time_chart_svg(r), esc(r.provenance.label));
  h += "<table id=\"time-table\"><thead><tr><th>per optimizer step</th>";
  for (const auto& s : charted(r)) h += fmt::format("<th>{}</th>", esc(s.label));
  h += "</tr></thead><tbody>\n";
  struct TimeRow {
    const char* name;
    const char* key;
    bool pct;
  };
  for (const TimeRow tr : {TimeRow{"step (s)", "step_s", false}, TimeRow{"compute (s)", "compute_s", false}, TimeRow{"exposed communication (s)", "exposed_comm_s", false},
                           TimeRow{"communication transferred (s)", "comm_s", false}, TimeRow{"optimizer (s)", "optimizer_s", false},
                           TimeRow{"offload copies and host (s)", "offload_s", false}, TimeRow{"tokens/s (all GPUs)", "tokens_per_s", false},
                           TimeRow{"tokens/s per GPU", "tokens_per_s_per_gpu", false}, TimeRow{"MFU", "mfu", true}}) {
    h += fmt::format("<tr><th>{}</th>", tr.name);
    for (const auto& s : charted(r)) {
      if (!s.figures.time) {
        h += "<td>-</td>";
        continue;
      }
      const auto& t = *s.figures.time;
      const std::string key = tr.key;
      const double v = key == "step_s" ? t.step_s : key == "compute_s" ? t.compute_s : key == "exposed_comm_s" ? t.exposed_comm_s : key == "comm_s" ? t.comm_s
                     : key == "optimizer_s" ? t.optimizer_s : key == "offload_s" ? t.offload_s : key == "tokens_per_s" ? t.tokens_per_s
                     : key == "tokens_per_s_per_gpu" ? t.tokens_per_s_per_gpu : t.mfu;
      if (std::isnan(v)) {  // a figure the source does not carry (a recommend row's transferred communication)
        h += "<td>-</td>";
        continue;
      }
      const std::string shown = tr.pct ? fmt::format("{:.1f}%", 100 * v) : key.rfind("tokens", 0) == 0 ? with_commas(static_cast<std::int64_t>(v + 0.5)) : fmt::format("{:.4f}", v);
      h += number_cell("time." + key, v, shown);
    }
    h += "</tr>\n";
  }
  h += "</tbody></table>\n";
  if (r.list_every_column || r.strategies.size() > kMaxColumns) h += every_column_table(r);
  // --- communication ---
  h += fmt::format("<h2>Communication per step per rank</h2>\n<table id=\"comm-table\"><thead><tr><th>{}</th>", g_unit.name);
  for (const auto& s : charted(r)) h += fmt::format("<th>{}</th>", esc(s.label));
  h += "</tr></thead><tbody>\n";
  for (int c = 0; c < sim::kNumCollectives; ++c) {
    const auto coll = static_cast<sim::Collective>(c);
    bool any = false;
    for (const auto& s : charted(r)) any |= s.figures.comm && s.figures.comm->collective_bytes[static_cast<std::size_t>(c)] > 0;
    if (!any) continue;
    h += fmt::format("<tr><th>{}</th>", sim::name_of(coll));
    for (const auto& s : charted(r))
      h += s.figures.comm ? bytes_cell(fmt::format("comm.{}_bytes", sim::name_of(coll)), s.figures.comm->collective_bytes[static_cast<std::size_t>(c)]) : "<td>-</td>";
    h += "</tr>\n";
  }
  struct LinkRow {
    const char* name;
    const char* key;
  };
  for (const LinkRow lr : {LinkRow{"sent inside nodes", "intra_node_bytes"}, LinkRow{"sent between nodes", "inter_node_bytes"},
                           LinkRow{"device to host", "device_to_host_bytes"}, LinkRow{"host to device", "host_to_device_bytes"}}) {
    h += fmt::format("<tr><th>{}</th>", lr.name);
    for (const auto& s : charted(r)) {
      if (!s.figures.comm) {
        h += "<td>-</td>";
        continue;
      }
      const auto& t = *s.figures.comm;
      const std::string key = lr.key;
      const std::uint64_t v = key == "intra_node_bytes" ? t.intra_node_bytes : key == "inter_node_bytes" ? t.inter_node_bytes
                            : key == "device_to_host_bytes" ? t.device_to_host_bytes : t.host_to_device_bytes;
      h += bytes_cell("comm." + key, v);
    }
    h += "</tr>\n";
  }
  h += "</tbody></table>\n</section>\n";
  // --- predicted versus measured ---
  bool measured = false;
  for (const auto& s : r.strategies) measured |= s.validation.has_value();
  if (measured) {
    h += "<section id=\"measured\">\n<h2>Predicted versus measured</h2>\n";
    std::vector<Point> points;
    for (const auto& s : r.strategies) {
      if (!s.validation) continue;
      for (const auto* figs : {&s.validation->memory, &s.validation->comm})
        for (const auto& f : *figs)
          if (f.predicted > 0 || f.measured > 0)
            points.push_back({f.predicted / kGiB * 1024, f.measured / kGiB * 1024, f.name,
                              fmt::format("{} {} ({}): predicted {:.3f} MiB, measured {:.3f} MiB", f.section, f.name, s.label, f.predicted / kGiB * 1024,
                                          f.measured / kGiB * 1024)});
    }
    const std::string on = r.strategies.front().measured_on;
    h += fmt::format("<figure id=\"measured-chart\">{}\n<figcaption>measured on {} against predicted: every memory category and collective of every "
                     "strategy; on the diagonal the prediction is exact.</figcaption></figure>\n",
                     scatter_svg(fmt::format("Predicted against measured on {} (MiB)", on), "MiB", points), esc(on));
    for (const auto& s : r.strategies) {
      if (!s.validation) continue;
      const auto& v = *s.validation;
      h += fmt::format("<h3>{} <span class=\"label\">measured on {}</span></h3>\n", esc(s.label), esc(s.measured_on));
      h += fmt::format("<table class=\"measured-table\" data-strategy=\"{}\"><thead><tr><th>figure</th><th>predicted</th><th>measured</th><th>error</th>"
                       "<th>spread</th><th>tolerance</th><th>verdict</th></tr></thead><tbody>\n", esc(s.label));
      for (const auto* figs : {&v.memory, &v.comm, &v.time}) {
        for (const auto& f : *figs) {
          const bool bytes = f.section != "time";
          auto shown = [&](double x) { return figure_text(bytes, x); };
          const std::string base = fmt::format("validation.{}.{}", f.section, f.name);
          const auto verdict = f.verdict();
          h += fmt::format("<tr><td>{} {}</td>{}{}<td>{:+.2f}%</td><td>{}</td><td>{:.1f}%</td><td class=\"{}\">{}</td></tr>\n", esc(f.section), esc(f.name),
                           cell(base + ".predicted", fmt::format("{:.17g}", f.predicted), shown(f.predicted)),
                           cell(base + ".measured", fmt::format("{:.17g}", f.measured), shown(f.measured)), 100 * f.relative_error,
                           f.has_spread ? fmt::format("{:.1f}%", 100 * f.spread / std::max(1e-300, f.measured)) : std::string("-"), 100 * f.tolerance,
                           verdict == planner::Verdict::within ? "good" : verdict == planner::Verdict::outside ? "bad" : "", planner::name_of(verdict));
        }
      }
      h += "</tbody></table>\n";
      h += op_by_op_html(v);
      if (has_timeline(s))
        h += fmt::format("<figure class=\"timeline-chart\" data-strategy=\"{}\">{}\n<figcaption>The predicted step (the simulated timeline, one lane per "
                         "stream) above the step measured on {} (every op the executor timed in its last step), on one time axis: where they "
                         "part is where the prediction is off.</figcaption></figure>\n",
                         esc(s.label), timeline_chart_svg(s), esc(s.measured_on));
      if (!v.notes.empty()) {
        h += "<ul>\n";
        for (const auto& n : v.notes) h += fmt::format("<li>{}</li>\n", esc(n));
        h += "</ul>\n";
      }
    }
    h += "</section>\n";
  }
  // --- knobs ---
  h += "<section id=\"knobs\">\n<h2>What moves if I change one knob</h2>\n";
  if (r.knobs.empty()) {
    h += fmt::format("<p>{}</p>\n", esc(r.no_knobs));
  } else {
    h += fmt::format("<p>Against {}: memory in use, step time and tokens/s after one change, {}.</p>\n", esc(r.base_label), esc(r.provenance.label));
    h += fmt::format("<table id=\"knob-table\"><thead><tr><th>knob</th><th>change</th><th>in use ({})</th><th>step</th><th>tokens/s</th><th>verdict</th></tr></thead><tbody>\n", g_unit.name);
    for (const auto& k : r.knobs)
      h += fmt::format("<tr><td>{}</td><td>{}</td><td>{}{}</td><td>{}</td><td>{}</td><td class=\"{}\">{}</td></tr>\n", esc(k.knob), esc(k.change),
                       k.used_delta_bytes >= 0 ? "+" : "-", gib(static_cast<std::uint64_t>(k.used_delta_bytes >= 0 ? k.used_delta_bytes : -k.used_delta_bytes)),
                       signed_pct(k.step_delta), signed_pct(k.tokens_delta), k.fits ? "good" : "bad", k.fits ? "fits" : "does not fit");
    h += "</tbody></table>\n";
  }
  h += "</section>\n";
  // --- definitions ---
  h += "<section id=\"definitions\">\n<h2>Definitions</h2>\n<ul>\n";
  for (int i = 0; i < sim::kNumDeviceCategories; ++i) {
    const auto cat = static_cast<MemCategory>(i);
    h += fmt::format("<li><span class=\"swatch\" style=\"background:{}\"></span><strong>{}</strong>: {}</li>\n", colour_of(cat), sim::name_of(cat),
                     esc(definition_of(cat)));
  }
  h += "<li><strong>allocated</strong>: the categories' sum at the simultaneous peak, what torch.cuda.max_memory_allocated reports</li>\n"
       "<li><strong>reserved</strong>: allocated plus the caching allocator's cached and split segments (max_memory_reserved), from a model "
       "of PyTorch's allocator run over the step's allocations</li>\n"
       "<li><strong>used</strong>: reserved plus what lives outside the allocator (the CUDA context, NCCL's buffers): what nvidia-smi shows, and "
       "what the verdict compares with the GPU's memory less the headroom</li>\n"
       "<li><strong>exposed communication</strong>: time in which a collective runs and compute does not</li>\n"
       "<li><strong>MFU</strong>: the model's FLOPs per step over the step time and the GPU's dense peak</li>\n</ul>\n</section>\n";
  h += "</body>\n</html>\n";
  return h;
}

std::string render_markdown(const ReportInput& r) {
  const Scope scope(r);
  std::string m = fmt::format("# {}\n\n**{}** — every figure here is {} by peftplan's model, not measured.\n\n", r.title, r.provenance.label, r.provenance.label);
  m += fmt::format("| | |\n|---|---|\n| peftplan | {} |\n| reproduce with | `{}` |\n", r.provenance.version, r.provenance.command);
  for (const auto& [k, v] : r.provenance.inputs) m += fmt::format("| {} | {} |\n", k, v);
  m += "\n## Recommendation\n\n";
  if (r.recommendation) {
    m += fmt::format("**{}**\n\n", with_suggestions(r.recommendation->summary, r.recommendation->suggestions, r.spell));
    if (!r.recommendation->ranked.empty()) m += fmt::format("Why: {}\n\n", r.recommendation->ranked.front().reason);
    for (const auto& x : r.recommendation->rejected) m += fmt::format("- **{}**: {}\n", x.family, with_suggestions(x.reason, x.suggestions, r.spell));
    for (const auto& a : r.recommendation->alternatives) m += fmt::format("- outside the search: {}\n", a.what);
    m += "\n";
  } else {
    m += r.no_recommendation + "\n\n";
  }
  m += fmt::format("## Memory per GPU\n\n![memory per GPU by category](memory.svg)\n\n| {} per GPU |", g_unit.name);
  for (const auto& s : charted(r)) m += fmt::format(" {} |", s.label);
  m += "\n|---|";
  for (std::size_t i = 0; i < charted(r).size(); ++i) m += "---:|";
  m += "\n";
  for (int i = 0; i < sim::kNumDeviceCategories; ++i) {
    m += fmt::format("| {} |", sim::name_of(static_cast<MemCategory>(i)));
    for (const auto& s : charted(r)) m += fmt::format(" {} |", gib(s.figures.at_peak_bytes[static_cast<std::size_t>(i)]));
    m += "\n";
  }
  auto mrow = [&](const char* name, auto get) {
    m += fmt::format("| {} |", name);
    for (const auto& s : charted(r)) m += fmt::format(" {} |", get(s.figures));
    m += "\n";
  };
  mrow("allocated peak", [](const Figures& f) { return gib(f.allocated_peak_bytes); });
  mrow("reserved peak", [](const Figures& f) { return gib(f.reserved_peak_bytes); });
  mrow("used peak (nvidia-smi)", [](const Figures& f) { return gib(f.used_peak_bytes); });
  mrow("verdict", [](const Figures& f) { return fits_word(f); });
  m += "\n## Step time\n\n![step time per strategy](time.svg)\n\n| per step |";
  for (const auto& s : charted(r)) m += fmt::format(" {} |", s.label);
  m += "\n|---|";
  for (std::size_t i = 0; i < charted(r).size(); ++i) m += "---:|";
  m += "\n";
  mrow("step (s)", [](const Figures& f) { return f.time ? fmt::format("{:.4f}", f.time->step_s) : std::string("-"); });
  mrow("exposed communication (s)", [](const Figures& f) { return f.time ? fmt::format("{:.4f}", f.time->exposed_comm_s) : std::string("-"); });
  mrow("tokens/s", [](const Figures& f) { return f.time ? with_commas(static_cast<std::int64_t>(f.time->tokens_per_s + 0.5)) : std::string("-"); });
  mrow("MFU", [](const Figures& f) { return f.time ? fmt::format("{:.1f}%", 100 * f.time->mfu) : std::string("-"); });
  for (const auto& s : r.strategies) {
    if (!s.validation) continue;
    m += fmt::format("\n## Predicted versus measured: {} (measured on {})\n\n| figure | predicted | measured | error | verdict |\n|---|---:|---:|---:|---|\n",
                     s.label, s.measured_on);
    for (const auto* figs : {&s.validation->memory, &s.validation->comm, &s.validation->time})
      for (const auto& f : *figs) {
        const bool bytes = f.section != "time";
        auto shown = [&](double x) { return figure_text(bytes, x); };
        m += fmt::format("| {} {} | {} | {} | {:+.2f}% | {} |\n", f.section, f.name, shown(f.predicted), shown(f.measured), 100 * f.relative_error,
                         planner::name_of(f.verdict()));
      }
    const auto& v = *s.validation;
    m += fmt::format("\nOp by op, from round {}'s {}.", v.op_round + 1, v.op_time_source);
    if (v.most_different) m += " Differs most: " + planner::describe(*v.most_different) + ".";
    m += "\n";
    if (!v.kinds.empty()) {
      m += "\n| op kind (phase, kernel, label) | ops | predicted (ms) | measured (ms) | difference (ms) |\n|---|--:|--:|--:|--:|\n";
      for (std::size_t i = 0; i < std::min<std::size_t>(5, v.kinds.size()); ++i) {
        const auto& d = v.kinds[i];
        m += fmt::format("| {}, {}, {} | {} | {:.3f} | {:.3f} | {:+.3f} |\n", d.phase, d.kernel, d.label, d.ops, d.predicted_s * 1e3, d.measured_s * 1e3, d.diff_s() * 1e3);
      }
    }
    if (has_timeline(s)) m += fmt::format("\n![one step of {}, predicted above measured]({})\n", s.label, timeline_file(s));
  }
  if (r.list_every_column || r.strategies.size() > kMaxColumns) {
    m += fmt::format("\n## Every one of the {} {}\n\n| {} | verdict | allocated | reserved | used | step (s) | tokens/s per GPU |\n|---|---|---:|---:|---:|---:|---:|\n",
                     r.strategies.size(), r.columns_are, r.columns_are);
    for (const auto& s : r.strategies)
      m += fmt::format("| {} | {} | {} | {} | {} | {} | {} |\n", s.label, s.note.empty() ? fits_word(s.figures) : s.note, gib(s.figures.allocated_peak_bytes),
                       gib(s.figures.reserved_peak_bytes), gib(s.figures.used_peak_bytes), s.figures.time ? fmt::format("{:.4f}", s.figures.time->step_s) : "-",
                       s.figures.time ? with_commas(static_cast<std::int64_t>(s.figures.time->tokens_per_s_per_gpu + 0.5)) : "-");
  }
  if (r.knobs.empty()) {
    m += fmt::format("\n## What moves if I change one knob\n\n{}\n", r.no_knobs);
  } else {
    m += fmt::format("\n## What moves if I change one knob\n\nAgainst {}:\n\n| knob | change | in use | step | tokens/s | verdict |\n|---|---|---:|---:|---:|---|\n",
                     r.base_label);
  }
  for (const auto& k : r.knobs)
    m += fmt::format("| {} | {} | {}{} {} | {} | {} | {} |\n", k.knob, k.change, k.used_delta_bytes >= 0 ? "+" : "-",
                     gib(static_cast<std::uint64_t>(k.used_delta_bytes >= 0 ? k.used_delta_bytes : -k.used_delta_bytes)), g_unit.name, signed_pct(k.step_delta),
                     signed_pct(k.tokens_delta), k.fits ? "fits" : "does not fit");
  m += "\n## Definitions\n\n";
  for (int i = 0; i < sim::kNumDeviceCategories; ++i)
    m += fmt::format("- **{}**: {}\n", sim::name_of(static_cast<MemCategory>(i)), definition_of(static_cast<MemCategory>(i)));
  m += "- **allocated / reserved / used**: torch.cuda.max_memory_allocated; plus the caching allocator's cache (max_memory_reserved); plus "
       "the CUDA context and NCCL outside the allocator (nvidia-smi)\n";
  return m;
}

void write_report(const std::filesystem::path& out, const ReportInput& r) {
  namespace fs = std::filesystem;
  if (out.empty()) throw InputError("report folder: the name is empty (--out needs a folder, e.g. --out report/)");
  fs::path target = fs::absolute(out).lexically_normal();
  if (!target.has_filename()) target = target.parent_path();  // "report/" names the folder report
  const fs::path parent = target.parent_path();
  std::error_code ec;
  if (!fs::is_directory(parent, ec))
    throw InputError(fmt::format("report folder {}: its parent {} does not exist", out.string(), parent.string()));
  // The folder is replaced as a whole: only a report's own folder may be (`--out .` once took
  // the working directory with it). A report writes these files and nothing else.
  if (fs::is_directory(target, ec))
    for (const auto& e : fs::directory_iterator(target, ec)) {
      const std::string name = e.path().filename().string();
      const bool ours = e.is_regular_file(ec) && (name == "report.html" || name == "report.md" || name == "memory.svg" || name == "time.svg" ||
                                                  (name.starts_with("timeline-") && name.ends_with(".svg")));
      if (!ours)
        throw InputError(fmt::format("report folder {}: holds {}, which is not a report's file; the folder is replaced as a whole, so give "
                                     "a new folder or one a report wrote",
                                     out.string(), name));
    }
  const fs::path tmp = parent / fmt::format(".{}.tmp.{}", target.filename().string(), ::getpid());
  fs::remove_all(tmp, ec);
  if (!fs::create_directory(tmp, ec) || ec) throw InputError(fmt::format("report folder {}: cannot be written ({})", out.string(), ec ? ec.message() : "exists"));
  try {
    write_text_atomic(tmp / "report.html", render_html(r));
    write_text_atomic(tmp / "report.md", render_markdown(r));
    write_text_atomic(tmp / "memory.svg", "<?xml version=\"1.0\" encoding=\"utf-8\"?>\n" + memory_chart_svg(r) + "\n");
    write_text_atomic(tmp / "time.svg", "<?xml version=\"1.0\" encoding=\"utf-8\"?>\n" + time_chart_svg(r) + "\n");
    for (const auto& s : r.strategies)
      if (has_timeline(s)) write_text_atomic(tmp / timeline_file(s), "<?xml version=\"1.0\" encoding=\"utf-8\"?>\n" + timeline_chart_svg(s) + "\n");
    if (fs::exists(target, ec) && !fs::is_directory(target, ec)) throw InputError(fmt::format("report folder {}: is a file, not a folder", out.string()));
    replace_directory(tmp, target);
  } catch (const fs::filesystem_error& e) {
    fs::remove_all(tmp, ec);
    throw InputError(fmt::format("report folder {}: cannot be written ({})", out.string(), e.code().message()));
  } catch (...) {
    fs::remove_all(tmp, ec);
    throw;
  }
}

}  // namespace peftplan::reports
