// `peftplan explain`: the plan's peak as a derivation (planner/explain.h): per category the
// buffers live at the peak, each kind with its formula, the numbers and what it is. Exit code 1
// when the plan does not fit, as `plan`.
#include <memory>

#include <fmt/format.h>

#include "commands.h"
#include "plan_flags.h"
#include "peftplan/common/units.h"
#include "peftplan/planner/explain.h"

namespace peftplan::cli {

void add_explain_command(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand("explain", "the plan's memory peak as a derivation: each category's buffers, formulas and numbers");
  cmd->footer("example: peftplan explain --model llama-2-7b --lora-r 16 --micro-batch 2 --seq-len 4096 --strategy zero3");
  struct Options {
    PlanFlags plan;
    bool json = false;
  };
  auto o = std::make_shared<Options>();
  add_plan_flags(cmd, o->plan);
  cmd->add_flag("--json", o->json, "machine-readable output");
  cmd->callback([&exit_code, o] {
    ResolvedPlan r = resolve_plan_flags(o->plan);
    print_warnings(r.warnings);
    planner::PlanOptions po;
    po.headroom_fraction = r.headroom_fraction;
    po.explain = false;
    const planner::Plan p = planner::make_plan(r.input, r.cluster, po);
    const planner::Explanation e = planner::explain_plan(p);
    exit_code = p.fits ? 0 : 1;
    if (o->json) {
      fmt::print("{}\n", planner::explanation_to_json(e).dump(2));
      return;
    }
    const auto& t = r.input.training;
    fmt::print("peftplan explain: {} · {} on {} ranks · micro-batch {} × seq {} · {} · profile {}\n", r.input.model.name,
               name_of(r.input.strategy.stage), r.input.strategy.ranks, t.micro_batch, t.seq_len, name_of(t.precision), name_of(r.input.profile));
    fmt::print("dimensions: {}\n", fmt::join(e.dims, ", "));
    fmt::print("the device peak: {} allocated, at the {}\n", human_bytes(p.memory.device_peak_bytes), e.peak_at);
    for (const auto& c : e.categories) {
      fmt::print("\n{} = {} at the peak{}\n", sim::name_of(c.category), human_bytes(c.at_peak_bytes),
                 c.peak_bytes != c.at_peak_bytes ? fmt::format(" (its own peak, elsewhere in the step: {})", human_bytes(c.peak_bytes)) : "");
      if (!c.closed_form.empty()) fmt::print("  closed form: {}\n", c.closed_form);
      for (const auto& term : c.terms) {
        std::string size = term.count > 1 && term.bytes_each > 0 ? fmt::format("{} × {}", term.count, human_bytes(term.bytes_each))
                                                                  : term.count > 1 ? fmt::format("{} buffers", term.count) : std::string("1");
        fmt::print("  {:>10}  {:<48} {}", human_bytes(term.bytes), term.what, size);
        if (!term.formula.empty()) fmt::print(", each {} = {}", term.formula, term.numbers);
        if (!term.source.empty()) fmt::print(" — {}", term.source);
        fmt::print("\n");
      }
    }
    fmt::print("\nmemory kinds:\n");
    for (const auto& k : e.kinds) fmt::print("  {}\n", k);
  });
}

}  // namespace peftplan::cli
