// `peftplan compare PLAN.json MEASUREMENT.json [MORE.json ...]`: the predicted-versus-measured
// tables of `peftplan run` for a plan and any measurement in our formats — peftplan-exec's
// measurement.json (per category, per op; several files are rounds of one run) or the totals a
// user's own training job writes through tools/peftplan_callback.py — with the tolerances of the
// plan's runtime profile (planner::tolerances_for) unless given. Exit code 0 when every
// conclusive figure is within tolerance, 1 when one is outside, 2 for bad input (a file that is
// no measurement of this plan, a field missing). The cluster is the one plan.json records
// (`peftplan run` and `peftplan plan --write-plan` write it) unless --cluster says otherwise.
// It runs nothing and writes only --out's validation.json and report.md when asked.
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "commands.h"
#include "peftplan/common/error.h"
#include "peftplan/common/paths.h"
#include "peftplan/common/schemas.h"
#include "peftplan/models/config.h"
#include "peftplan/planner/plan.h"
#include "peftplan/planner/plan_file.h"
#include "peftplan/planner/validate.h"
#include "peftplan/common/atomic_file.h"
#include "plan_flags.h"
#include "validation_text.h"

namespace peftplan::cli {
namespace {

namespace fs = std::filesystem;

// The config.json object a plan file's model came from (a zoo name's bundled file).
std::optional<std::string> plan_config_sha256(const planner::PlanFile& pf) {
  if (pf.model_source.is_object()) return models::config_sha256(pf.model_source);
  if (pf.model_source.is_string())
    if (const char* text = models::zoo_config_text(pf.model_source.get<std::string>()))
      return models::config_sha256(nlohmann::json::parse(text));
  return std::nullopt;
}

}  // namespace

void add_compare_command(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand("compare", "compare a plan with a measurement: peftplan-exec's measurement.json (several: rounds) or "
                                            "a training job's totals from tools/peftplan_callback.py");
  cmd->footer("example: peftplan compare plan.json peftplan-measurement.json --out cmp/");
  struct Options {
    std::string plan;
    std::vector<std::string> measurements;
    std::string cluster;
    std::optional<double> tolerance_memory, tolerance_time;
    std::string out;
  };
  auto o = std::make_shared<Options>();
  cmd->add_option("plan", o->plan, "plan.json (written by peftplan run or peftplan plan --write-plan)")->required();
  cmd->add_option("measurements", o->measurements, "measurement JSON files (one totals file, or executor measurements as rounds)")
      ->required();
  cmd->add_option("--cluster", o->cluster, "cluster to predict on (default: the one plan.json records)");
  cmd->add_option("--tolerance-memory", o->tolerance_memory, "relative tolerance of memory (default: the plan's runtime profile's)")
      ->check(finite_non_negative());
  cmd->add_option("--tolerance-time", o->tolerance_time, "relative tolerance of time (default: the plan's runtime profile's)")
      ->check(finite_non_negative());
  cmd->add_option("--out", o->out, "folder to write validation.json and report.md into")->check(kNonEmpty);
  cmd->callback([o, &exit_code] {
    if (!o->out.empty()) {  // a folder, refused before anything is read or printed
      std::error_code ec;
      if (fs::exists(o->out, ec) && !fs::is_directory(o->out, ec))
        throw input_error("--out", "", "is a file, not a folder (validation.json and report.md go into a folder)", o->out);
    }
    const planner::PlanFile pf = planner::read_plan_file(o->plan);
    planner::check_program_hash(pf, o->plan);
    sim::Cluster cluster;
    std::string cluster_from;
    if (!o->cluster.empty()) {
      cluster = sim::resolve_cluster(o->cluster);
      cluster_from = "--cluster";
    } else if (pf.cluster) {
      cluster = *pf.cluster;
      cluster_from = "recorded in the plan";
    } else {
      throw input_error(o->plan, "cluster", "is missing (plans from peftplan run and peftplan plan --write-plan record it): give --cluster");
    }
    planner::PlanOptions po;
    po.explain = false;
    const planner::Plan plan = planner::make_plan(pf.input, cluster, po);
    const planner::Tolerances defaults = planner::tolerances_for(pf.input.profile);
    const planner::Tolerances tol{o->tolerance_memory.value_or(defaults.memory), o->tolerance_time.value_or(defaults.time)};

    // Sort the files by schema: executor rounds, or one totals file.
    std::vector<nlohmann::json> rounds;
    std::optional<std::pair<std::string, nlohmann::json>> totals;
    for (const std::string& path : o->measurements) {
      nlohmann::json m = models::read_json_file(path);
      const std::string schema = m.is_object() && m.contains("schema") && m.at("schema").is_string() ? m.at("schema").get<std::string>() : "";
      if (schema == schemas::kMeasurement) {
        rounds.push_back(std::move(m));
        continue;
      }
      if (schema == schemas::kMeasurementTotals) {
        if (totals) throw input_error(path, "schema", "a totals measurement must be compared alone (one per job)", "\"" + schema + "\"");
        totals.emplace(path, std::move(m));
        continue;
      }
      throw input_error(path, "schema",
                        fmt::format("must be \"{}\" (peftplan-exec) or \"{}\" (tools/peftplan_callback.py)", schemas::kMeasurement,
                                    schemas::kMeasurementTotals),
                        m.is_object() && m.contains("schema") ? m.at("schema").dump() : "nothing");
    }
    if (totals && !rounds.empty())
      throw input_error(totals->first, "schema", "cannot be mixed with executor measurements (compare them apart)");

    planner::Validation v;
    if (totals) {
      v = planner::validate_totals(plan, totals->second, totals->first, plan_config_sha256(pf), tol);
    } else {
      try {
        v = planner::validate_rounds(plan, rounds, tol);
      } catch (const InputError& e) {  // name the files: the planner only sees JSON
        throw InputError(fmt::format("{}{}: {}", o->measurements.front(), o->measurements.size() > 1 ? " (and the other rounds)" : "",
                                     e.what()));
      }
    }
    fmt::print("plan: {} ({}, {}, {} rank(s), profile {}); cluster {} ({})\n", shown_path(o->plan), pf.input.model.name,
               planner::name_of(pf.input.strategy.stage), pf.input.strategy.ranks, planner::name_of(pf.input.profile), cluster.name,
               cluster_from);
    fmt::print("measurement: {}{}; tolerances: memory {:.4g}%, time {:.4g}%\n",
               totals ? "totals of a training job, " : fmt::format("{} executor round(s), ", rounds.size()), shown_path(o->measurements.front()),
               100.0 * tol.memory, 100.0 * tol.time);
    fmt::print("{}", validation_tables(v, false));
    fmt::print("{}", validation_notes(v));
    if (!o->out.empty()) {
      const fs::path dir = fs::absolute(o->out);
      std::error_code ec;
      fs::create_directories(dir, ec);
      if (ec) throw input_error("--out", "", fmt::format("the folder cannot be made ({})", ec.message()), o->out);
      write_text_atomic(dir / "validation.json", planner::validation_to_json(v).dump(1) + "\n");
      write_text_atomic(dir / "report.md", validation_report(plan, v, cluster_from));
      fmt::print("wrote {} and {}\n", shown_path(dir / "validation.json"), shown_path(dir / "report.md"));
    }
    fmt::print("{}\n", v.within_tolerance ? (v.inconclusive.empty() ? "verdict: every figure within tolerance"
                                                                     : "verdict: every conclusive figure within tolerance")
                                          : fmt::format("verdict: {} figure(s) outside tolerance", v.outside.size()));
    std::fflush(stdout);  // the tables first, then the verdict lines on stderr
    fmt::print(stderr, "{}", verdict_lines(v));
    std::fflush(stderr);
    exit_code = v.within_tolerance ? 0 : 1;
  });
}

}  // namespace peftplan::cli
