// `peftplan report --out DIR`: the comparison report (reports/report.h) of the seed's strategies
// for the given model, adapter, training and cluster (or a saved plan.json), with the
// recommendation of `recommend`'s search and the knob deltas of the configuration given; or of a
// run folder, a sweep table or a recommend --json as saved (reports/sources.h).
#include <chrono>
#include <memory>

#include <fmt/format.h>

#include "commands.h"
#include "plan_flags.h"
#include "run_report.h"
#include "peftplan/common/error.h"
#include "peftplan/common/json_file.h"
#include "peftplan/common/units.h"
#include "peftplan/planner/plan_file.h"
#include "peftplan/planner/recommend.h"
#include "peftplan/reports/report.h"
#include "peftplan/reports/sources.h"

namespace peftplan::cli {
namespace {

std::string adapter_words(const planner::PlanInput& in) {
  if (in.peft.adapters.empty()) return "full fine-tuning";
  std::string s;
  for (const auto& a : in.peft.adapters) {
    if (!s.empty()) s += " + ";
    s += a.type == models::PeftType::lora ? fmt::format("LoRA r {} alpha {:g}", a.lora.r, a.lora.alpha) : std::string(models::name_of(a.type));
  }
  if (in.peft.quantization) s += fmt::format(", base {}", name_of(in.peft.quantization->dtype));
  return s;
}

}  // namespace

void add_report_command(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand("report", "a shareable comparison report (HTML with inline SVG charts, and Markdown) of the strategies for one job");
  cmd->footer(
      "example: peftplan report --model llama-2-7b --lora-r 16 --seq-len 4096 --cluster 8xA100-80GB --out report/\n"
      "         peftplan report --plan out/run/ddp/plan.json --out report/\n"
      "         peftplan report --sweep grid.csv --out report/");
  struct Options {
    PlanFlags plan;
    std::string plan_file;
    std::string run;
    std::string sweep;
    std::string recommendation;
    std::string out;
    bool no_recommend = false;
  };
  auto o = std::make_shared<Options>();
  add_plan_flags(cmd, o->plan);
  cmd->add_option("--plan", o->plan_file, "a saved plan.json (peftplan plan --write-plan, recommend --emit, run) instead of the plan flags");
  cmd->add_option("--run", o->run, "a peftplan run folder (or a validation.json beside its plan.json): the report of its strategies, predicted and measured");
  cmd->add_option("--sweep", o->sweep, "a peftplan sweep table (CSV or --format jsonl): one column per configuration, as the table holds it");
  cmd->add_option("--recommendation", o->recommendation, "a peftplan recommend --json: the recommendation, its ranked rows and each other family's best");
  cmd->add_option("--out", o->out, "the report's folder (report.html, report.md, memory.svg, time.svg); replaced as a whole")->required();
  cmd->add_flag("--no-recommend", o->no_recommend, "leave out the recommendation (no search)");
  cmd->callback([&exit_code, o] {
    const auto t0 = std::chrono::steady_clock::now();
    const int sources = !o->run.empty() + !o->plan_file.empty() + !o->sweep.empty() + !o->recommendation.empty();
    if (sources > 1) throw InputError("--run, --plan, --sweep and --recommendation: give one source");
    // A saved table: its figures as the file holds them (reports/sources.h).
    if (!o->sweep.empty() || !o->recommendation.empty()) {
      reports::ReportInput ri = !o->sweep.empty()
                                    ? reports::sweep_report(reports::read_sweep(read_text_file(o->sweep), o->sweep), o->sweep)
                                    : reports::recommendation_report(planner::recommendation_from_json(read_json_file(o->recommendation), o->recommendation),
                                                                     o->recommendation);
      ri.spell = flag_of;
      ri.provenance.version = reports::version_string();
      ri.provenance.command = command_line();
      reports::write_report(o->out, ri);
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      fmt::print("report of {} {} written to {} (report.html, report.md, memory.svg, time.svg) in {:.2f} s\n", ri.strategies.size(),
                 !o->sweep.empty() ? "configurations" : "rows", as_folder(o->out), seconds);
      exit_code = 0;
      return;
    }
    if (!o->run.empty()) {
      std::string machine;
      const std::vector<MeasuredStrategy> runs = read_run(o->run, machine);
      const auto& v = runs.front().validation;
      reports::write_report(o->out, run_report(runs, machine, "as the run's plan.json", v.rounds, v.tolerances));
      fmt::print("report of {} measured strateg{} written to {} (report.html, report.md, memory.svg, time.svg)\n", runs.size(),
                 runs.size() == 1 ? "y" : "ies", as_folder(o->out));
      exit_code = 0;
      return;
    }
    ResolvedPlan r = resolve_plan_flags(o->plan);
    std::string source = "the plan flags";
    if (!o->plan_file.empty()) {
      const planner::PlanFile pf = planner::read_plan_file(o->plan_file);
      planner::check_program_hash(pf, o->plan_file);  // as compare and peftplan-exec: the plan this build would not make is refused
      r.input = pf.input;
      if (pf.cluster) r.cluster = *pf.cluster;
      source = o->plan_file;
    } else {
      print_warnings(r.warnings);  // what reading the flags warns of
    }
    planner::PlanOptions po;
    po.headroom_fraction = r.headroom_fraction;
    const planner::Plan base = planner::make_plan(r.input, r.cluster, po);
    reports::ReportInput ri;
    ri.spell = flag_of;
    const auto& t = r.input.training;
    ri.title = fmt::format("{} · {} on {} ({} GPUs)", r.input.model.name, adapter_words(r.input), r.cluster.name, r.input.strategy.ranks);
    ri.provenance.version = reports::version_string();
    ri.provenance.command = command_line();
    ri.provenance.inputs = {
        {"inputs from", source},
        {"model", fmt::format("{} ({} parameters, {} trainable)", r.input.model.name, with_commas(base.facts.base_params + base.facts.trainable_params),
                              with_commas(base.facts.trainable_params))},
        {"adapter", adapter_words(r.input)},
        {"training", fmt::format("micro-batch {} × {} tokens × accumulation {}, {}, attention {}, checkpointing {}", t.micro_batch, t.seq_len, t.grad_accum,
                                 name_of(t.precision), name_of(t.attention),
                                 planner::name_of(planner::CheckpointChoice{t.checkpointing, t.checkpoint_every}))},
        {"cluster", fmt::format("{}: {} node(s) × {} {} ({:.0f} GiB), {}{}", r.cluster.name, r.cluster.nodes, r.cluster.gpus_per_node, r.cluster.gpu.name,
                                to_gib(r.cluster.gpu.memory_bytes), r.cluster.intra_node_link.name,
                                r.cluster.inter_node_link ? ", " + r.cluster.inter_node_link->name + " between nodes" : std::string())},
        {"runtime profile", fmt::format("{}{}", name_of(r.input.profile), base.runtime_versions.empty() ? "" : ": " + std::string(base.runtime_versions))},
        {"headroom", fmt::format("{:.0f}% of the GPU kept free beyond the predicted peak in use", 100 * r.headroom_fraction)},
    };
    std::vector<std::string> refused;
    ri.strategies = reports::seed_strategies(r.input, r.cluster, r.headroom_fraction, &refused);
    for (const auto& x : refused) ri.provenance.inputs.push_back({"strategy left out", with_flags(x)});
    ri.base_label = fmt::format("{}{}{} at micro-batch {} (the configuration given)", name_of(r.input.strategy.stage),
                                r.input.strategy.offload_optimizer == planner::OffloadDevice::cpu ? " + offload optimizer" : "",
                                r.input.strategy.offload_param == planner::OffloadDevice::cpu ? " + offload param" : "", t.micro_batch);
    ri.knobs = reports::knob_deltas(base);
    ri.no_recommendation = !o->plan_file.empty() ? "No recommendation: the report was made from a saved plan (--no-recommend)."
                                                 : "No recommendation (--no-recommend).";
    if (!o->no_recommend) {
      planner::Constraints k;
      k.headroom_fraction = r.headroom_fraction;
      ri.recommendation = planner::recommend(r.input, r.cluster, {}, k, planner::Objective::tokens_per_s);
    }
    reports::write_report(o->out, ri);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    fmt::print("report of {} strategies written to {} (report.html, report.md, memory.svg, time.svg) in {:.2f} s\n", ri.strategies.size(), as_folder(o->out), seconds);
    exit_code = 0;
  });
}

}  // namespace peftplan::cli
