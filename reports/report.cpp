// Comparison reports (see report.h).
#include "peftplan/reports/report.h"

#include <unistd.h>

#include <system_error>

#include <fmt/format.h>

#include "peftplan/common/atomic_file.h"
#include "peftplan/common/error.h"
#include "peftplan/common/units.h"
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
    for (const auto& s : r.strategies) most = std::max(most, s.plan.used_peak_bytes);
    g_unit = most < 2ull * (1ull << 30) ? Unit{"MiB", 1024.0 * 1024.0} : Unit{"GiB", kGiB};
  }
};
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

std::string fits_word(const Plan& p) { return p.fits ? "fits" : "does not fit"; }

// A reason followed by what to try ("...; try --strategy zero3 (shards the frozen base)").
std::string with_suggestions(const std::string& text, const std::vector<planner::Suggestion>& s, planner::KnobSpelling spell) {
  return s.empty() ? text : fmt::format("{}; {}", text, planner::suggestion_text(s, spell));
}

}  // namespace

std::vector<StrategyColumn> seed_strategies(const planner::PlanInput& input, const sim::Cluster& cluster, double headroom) {
  using planner::OffloadDevice, planner::Stage;
  struct Want {
    std::string label, args;
    Stage stage;
    OffloadDevice opt, param;
    bool full_ft;
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
    wants.push_back({label, args, s, o, q, full});
  };
  if (peft) add(Stage::ddp, OffloadDevice::none, OffloadDevice::none, true);
  if (hf) {
    for (Stage s : {Stage::ddp, Stage::fsdp_no_shard, Stage::fsdp_shard_grad_op, Stage::fsdp_full_shard}) add(s, OffloadDevice::none, OffloadDevice::none, false);
    add(Stage::fsdp_full_shard, OffloadDevice::none, OffloadDevice::cpu, false);
  } else {
    for (Stage s : {Stage::ddp, Stage::zero1, Stage::zero2, Stage::zero3}) add(s, OffloadDevice::none, OffloadDevice::none, false);
    add(Stage::zero2, OffloadDevice::cpu, OffloadDevice::none, false);
    add(Stage::zero3, OffloadDevice::cpu, OffloadDevice::cpu, false);
  }
  std::vector<StrategyColumn> out;
  planner::PlanOptions po;
  po.headroom_fraction = headroom;
  for (const auto& w : wants) {
    planner::PlanInput in = input;
    in.strategy.stage = w.stage;
    in.strategy.offload_optimizer = w.opt;
    in.strategy.offload_param = w.param;
    in.strategy.shard_group = 0;
    if (w.full_ft) {
      in.peft = {};
      in.training.full_finetune = true;
      in.inventory.reset();
    }
    out.push_back({w.label, w.args, planner::make_plan(in, cluster, po)});
  }
  return out;
}

std::vector<KnobDelta> knob_deltas(const Plan& base) {
  using planner::Checkpointing, planner::OffloadDevice, planner::Stage;
  std::vector<KnobDelta> out;
  planner::PlanOptions po;
  po.headroom_fraction = base.headroom_fraction;
  po.explain = false;
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
  for (const auto& s : r.strategies) {
    const Plan& p = s.plan;
    capacity = p.device_capacity_bytes;
    headroom = p.headroom_fraction;
    Bar b;
    b.label = s.label;
    for (int i = 0; i < sim::kNumDeviceCategories; ++i) {
      const auto cat = static_cast<MemCategory>(i);
      const std::uint64_t v = p.memory.at_peak_bytes[static_cast<std::size_t>(i)];
      b.segments.push_back({std::string(sim::name_of(cat)), in_unit(v), std::string(colour_of(cat)),
                            fmt::format("{}: {} {} at the peak ({})", sim::name_of(cat), gib(v), g_unit.name, s.label)});
    }
    const std::uint64_t cache = p.reserved_peak_bytes - std::min(p.reserved_peak_bytes, p.memory.device_peak_bytes);
    b.segments.push_back({"allocator cache (reserved - allocated)", in_unit(cache), "#cfcfcf",
                          fmt::format("the caching allocator's cached segments: {} {} ({})", gib(cache), g_unit.name, s.label)});
    b.segments.push_back({"outside the allocator (CUDA context, NCCL)", in_unit(p.outside_allocator_bytes), "#9a9a9a",
                          fmt::format("outside the allocator: {} {u} ({}); the bar's top is what nvidia-smi shows, {} {u}", gib(p.outside_allocator_bytes),
                                      s.label, gib(p.used_peak_bytes), fmt::arg("u", g_unit.name))});
    b.note = p.fits ? "" : "does not fit";
    c.bars.push_back(std::move(b));
  }
  // The GPU's memory and the headroom, unless they are far off the bars' scale (a tiny model).
  const double tallest = tallest_bar(c);
  if (in_unit(capacity) <= 3 * tallest) {
    c.lines.push_back({in_unit(capacity), fmt::format("GPU memory {:.0f} {}", in_unit(capacity), g_unit.name)});
    if (headroom > 0) c.lines.push_back({in_unit(capacity) * (1 - headroom), fmt::format("{:.0f}% headroom kept", 100 * headroom)});
  } else {
    c.subtitle = fmt::format("the device's {:.0f} {} is off this scale", in_unit(capacity), g_unit.name);
  }
  return stacked_bars_svg(c);
}

std::string time_chart_svg(const ReportInput& r) {
  BarChart c;
  c.title = fmt::format("Step time per strategy, {} (s)", r.provenance.label);
  c.unit = "seconds per optimizer step";
  for (const auto& s : r.strategies) {
    const Plan& p = s.plan;
    if (!p.time) continue;
    const auto& t = *p.time;
    const double rest = std::max(0.0, t.step_s - t.compute_s - t.exposed_comm_s);
    Bar b;
    b.label = s.label;
    b.segments = {{"compute", t.compute_s, std::string(kComputeColour), fmt::format("compute {:.3f} s ({})", t.compute_s, s.label)},
                  {"exposed communication", t.exposed_comm_s, std::string(kCommColour),
                   fmt::format("exposed communication {:.3f} s of {:.3f} s transferred ({})", t.exposed_comm_s, t.comm_s, s.label)},
                  {t.host_bound ? "host-bound (FSDP hooks)" : "offload, CPU optimizer and other waits", rest,
                   std::string(t.host_bound ? kHostColour : kOffloadColour), fmt::format("{:.3f} s beyond compute and exposed communication ({})", rest, s.label)}};
    b.note = fmt::format("{:.3f} s, {} tok/s{}", t.step_s, with_commas(static_cast<std::int64_t>(t.tokens_per_s + 0.5)), p.fits ? "" : ", does not fit");
    c.bars.push_back(std::move(b));
  }
  return horizontal_bars_svg(c);
}

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
  for (const auto& s : r.strategies) h += fmt::format("<th data-strategy=\"{}\" data-plan-args=\"{}\">{}</th>", esc(s.label), esc(s.plan_args), esc(s.label));
  h += "</tr></thead><tbody>\n";
  for (int i = 0; i < sim::kNumDeviceCategories; ++i) {
    const auto cat = static_cast<MemCategory>(i);
    h += fmt::format("<tr><th><span class=\"swatch\" style=\"background:{}\"></span>{}</th>", colour_of(cat), sim::name_of(cat));
    for (const auto& s : r.strategies) h += bytes_cell(category_field(cat), s.plan.memory.at_peak_bytes[static_cast<std::size_t>(i)]);
    h += "</tr>\n";
  }
  auto row = [&](const std::string& name, const std::string& field, auto get) {
    h += fmt::format("<tr><th>{}</th>", esc(name));
    for (const auto& s : r.strategies) h += bytes_cell(field, get(s.plan));
    h += "</tr>\n";
  };
  row("allocated peak", "memory.device.allocated_peak_bytes", [](const Plan& p) { return p.memory.device_peak_bytes; });
  row("reserved peak", "memory.device.reserved_peak_bytes", [](const Plan& p) { return p.reserved_peak_bytes; });
  row("used peak (nvidia-smi)", "memory.device.used_peak_bytes", [](const Plan& p) { return p.used_peak_bytes; });
  row("host peak per rank", "memory.host.peak_bytes", [](const Plan& p) { return p.memory.host_peak_bytes; });
  h += "<tr><th>verdict</th>";
  for (const auto& s : r.strategies)
    h += fmt::format(R"(<td data-field="fits" data-value="{}" class="{}">{}</td>)", s.plan.fits ? "true" : "false", s.plan.fits ? "good" : "bad", fits_word(s.plan));
  h += "</tr>\n</tbody></table>\n</section>\n";
  // --- time ---
  h += "<section id=\"time\">\n<h2>Step time</h2>\n";
  h += fmt::format("<figure id=\"time-chart\">{}\n<figcaption>{}: the simulated optimizer step of each strategy, split into compute, "
                   "communication that compute does not hide, and the rest (offload copies, the CPU optimizer, host-bound hooks).</figcaption></figure>\n",
                   time_chart_svg(r), esc(r.provenance.label));
  h += "<table id=\"time-table\"><thead><tr><th>per optimizer step</th>";
  for (const auto& s : r.strategies) h += fmt::format("<th>{}</th>", esc(s.label));
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
    for (const auto& s : r.strategies) {
      if (!s.plan.time) {
        h += "<td>-</td>";
        continue;
      }
      const auto& t = *s.plan.time;
      const std::string key = tr.key;
      const double v = key == "step_s" ? t.step_s : key == "compute_s" ? t.compute_s : key == "exposed_comm_s" ? t.exposed_comm_s : key == "comm_s" ? t.comm_s
                     : key == "optimizer_s" ? t.optimizer_s : key == "offload_s" ? t.offload_s : key == "tokens_per_s" ? t.tokens_per_s
                     : key == "tokens_per_s_per_gpu" ? t.tokens_per_s / std::max(1, s.plan.input.strategy.ranks) : t.mfu;
      const std::string shown = tr.pct ? fmt::format("{:.1f}%", 100 * v) : key.rfind("tokens", 0) == 0 ? with_commas(static_cast<std::int64_t>(v + 0.5)) : fmt::format("{:.4f}", v);
      h += number_cell("time." + key, v, shown);
    }
    h += "</tr>\n";
  }
  h += "</tbody></table>\n";
  // --- communication ---
  h += fmt::format("<h2>Communication per step per rank</h2>\n<table id=\"comm-table\"><thead><tr><th>{}</th>", g_unit.name);
  for (const auto& s : r.strategies) h += fmt::format("<th>{}</th>", esc(s.label));
  h += "</tr></thead><tbody>\n";
  for (int c = 0; c < sim::kNumCollectives; ++c) {
    const auto coll = static_cast<sim::Collective>(c);
    bool any = false;
    for (const auto& s : r.strategies) any |= s.plan.time && s.plan.time->collective_bytes[static_cast<std::size_t>(c)] > 0;
    if (!any) continue;
    h += fmt::format("<tr><th>{}</th>", sim::name_of(coll));
    for (const auto& s : r.strategies)
      h += s.plan.time ? bytes_cell(fmt::format("comm.{}_bytes", sim::name_of(coll)), s.plan.time->collective_bytes[static_cast<std::size_t>(c)]) : "<td>-</td>";
    h += "</tr>\n";
  }
  struct LinkRow {
    const char* name;
    const char* key;
  };
  for (const LinkRow lr : {LinkRow{"sent inside nodes", "intra_node_bytes"}, LinkRow{"sent between nodes", "inter_node_bytes"},
                           LinkRow{"device to host", "device_to_host_bytes"}, LinkRow{"host to device", "host_to_device_bytes"}}) {
    h += fmt::format("<tr><th>{}</th>", lr.name);
    for (const auto& s : r.strategies) {
      if (!s.plan.time) {
        h += "<td>-</td>";
        continue;
      }
      const auto& t = *s.plan.time;
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
      if (!v.notes.empty()) {
        h += "<ul>\n";
        for (const auto& n : v.notes) h += fmt::format("<li>{}</li>\n", esc(n));
        h += "</ul>\n";
      }
    }
    h += "</section>\n";
  }
  // --- knobs ---
  h += fmt::format("<section id=\"knobs\">\n<h2>What moves if I change one knob</h2>\n<p>Against {}: memory in use, "
                   "step time and tokens/s after one change, {}.</p>\n",
                   esc(r.base_label), esc(r.provenance.label));
  h += fmt::format("<table id=\"knob-table\"><thead><tr><th>knob</th><th>change</th><th>in use ({})</th><th>step</th><th>tokens/s</th><th>verdict</th></tr></thead><tbody>\n", g_unit.name);
  for (const auto& k : r.knobs)
    h += fmt::format("<tr><td>{}</td><td>{}</td><td>{}{}</td><td>{}</td><td>{}</td><td class=\"{}\">{}</td></tr>\n", esc(k.knob), esc(k.change),
                     k.used_delta_bytes >= 0 ? "+" : "-", gib(static_cast<std::uint64_t>(k.used_delta_bytes >= 0 ? k.used_delta_bytes : -k.used_delta_bytes)),
                     signed_pct(k.step_delta), signed_pct(k.tokens_delta), k.fits ? "good" : "bad", k.fits ? "fits" : "does not fit");
  h += "</tbody></table>\n</section>\n";
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
  for (const auto& s : r.strategies) m += fmt::format(" {} |", s.label);
  m += "\n|---|";
  for (std::size_t i = 0; i < r.strategies.size(); ++i) m += "---:|";
  m += "\n";
  for (int i = 0; i < sim::kNumDeviceCategories; ++i) {
    m += fmt::format("| {} |", sim::name_of(static_cast<MemCategory>(i)));
    for (const auto& s : r.strategies) m += fmt::format(" {} |", gib(s.plan.memory.at_peak_bytes[static_cast<std::size_t>(i)]));
    m += "\n";
  }
  auto mrow = [&](const char* name, auto get) {
    m += fmt::format("| {} |", name);
    for (const auto& s : r.strategies) m += fmt::format(" {} |", get(s.plan));
    m += "\n";
  };
  mrow("allocated peak", [](const Plan& p) { return gib(p.memory.device_peak_bytes); });
  mrow("reserved peak", [](const Plan& p) { return gib(p.reserved_peak_bytes); });
  mrow("used peak (nvidia-smi)", [](const Plan& p) { return gib(p.used_peak_bytes); });
  mrow("verdict", [](const Plan& p) { return fits_word(p); });
  m += "\n## Step time\n\n![step time per strategy](time.svg)\n\n| per step |";
  for (const auto& s : r.strategies) m += fmt::format(" {} |", s.label);
  m += "\n|---|";
  for (std::size_t i = 0; i < r.strategies.size(); ++i) m += "---:|";
  m += "\n";
  mrow("step (s)", [](const Plan& p) { return p.time ? fmt::format("{:.4f}", p.time->step_s) : std::string("-"); });
  mrow("exposed communication (s)", [](const Plan& p) { return p.time ? fmt::format("{:.4f}", p.time->exposed_comm_s) : std::string("-"); });
  mrow("tokens/s", [](const Plan& p) { return p.time ? with_commas(static_cast<std::int64_t>(p.time->tokens_per_s + 0.5)) : std::string("-"); });
  mrow("MFU", [](const Plan& p) { return p.time ? fmt::format("{:.1f}%", 100 * p.time->mfu) : std::string("-"); });
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
  }
  m += fmt::format("\n## What moves if I change one knob\n\nAgainst {}:\n\n| knob | change | in use | step | tokens/s | verdict |\n|---|---|---:|---:|---:|---|\n",
                   r.base_label);
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
  const fs::path target = fs::absolute(out).lexically_normal();
  const fs::path parent = target.parent_path();
  std::error_code ec;
  if (!fs::is_directory(parent, ec))
    throw InputError(fmt::format("report folder {}: its parent {} does not exist", out.string(), parent.string()));
  const fs::path tmp = parent / fmt::format(".{}.tmp.{}", target.filename().string(), ::getpid());
  fs::remove_all(tmp, ec);
  if (!fs::create_directory(tmp, ec) || ec) throw InputError(fmt::format("report folder {}: cannot be written ({})", out.string(), ec ? ec.message() : "exists"));
  try {
    write_text_atomic(tmp / "report.html", render_html(r));
    write_text_atomic(tmp / "report.md", render_markdown(r));
    write_text_atomic(tmp / "memory.svg", "<?xml version=\"1.0\" encoding=\"utf-8\"?>\n" + memory_chart_svg(r) + "\n");
    write_text_atomic(tmp / "time.svg", "<?xml version=\"1.0\" encoding=\"utf-8\"?>\n" + time_chart_svg(r) + "\n");
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
