// `peftplan sweep`: a grid over any `plan` flag. Every flag `plan` takes may carry a list or a
// range in recommend's syntax (8,16,32 · 1..8 · 8..64:8 · 8..64:x2 for integers; comma lists for
// words: --strategy ddp,zero3, --model llama-2-7b,llama-2-13b); the cartesian product is planned,
// in parallel over the cores, and written as CSV (a header comment names the schema) or JSON
// lines, one row per configuration in grid order, with plan --json's memory, time and
// communication fields in a fixed column order. A combination the planner refuses (offload with
// ddp, say) is a row with its `error`, not a failed sweep; a value that does not parse is bad
// input (exit code 2) before anything is planned, and so is one the planner refuses for itself
// in every configuration that holds it (--strategy zero9).
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <thread>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "plan_flags.h"
#include "ranges.h"
#include "peftplan/common/atomic_file.h"
#include "peftplan/common/error.h"
#include "peftplan/common/schemas.h"
#include "peftplan/planner/plan.h"

namespace peftplan::cli {
namespace {

// Flags whose values are integers (lists and ranges), and flags whose value is never split at
// commas (their own syntax has commas, or they name files).
const std::set<std::string, std::less<>> kIntegerFlags = {"--micro-batch", "--seq-len", "--grad-accum", "--gpus", "--lora-r", "--eval-batch", "--fsdp-version"};
const std::set<std::string, std::less<>> kWholeFlags = {"--lora-targets", "--alloc-conf", "--peft", "--ds-config", "--accelerate-config"};

struct Axis {
  std::string flag;                 // "--micro-batch"; a boolean flag has no values
  std::vector<std::string> values;  // one value: fixed; more: a grid axis
  bool boolean = false;
};

std::string csv_field(const nlohmann::json& v) {
  if (v.is_null()) return "";
  if (v.is_boolean()) return v.get<bool>() ? "true" : "false";
  if (v.is_number_float()) return fmt::format("{:.9g}", v.get<double>());
  if (v.is_number()) return v.dump();
  std::string s = v.is_string() ? v.get<std::string>() : v.dump();
  if (s.find_first_of(",\"\n") == std::string::npos) return s;
  std::string q = "\"";
  for (char ch : s) q += ch == '"' ? std::string("\"\"") : std::string(1, ch);
  return q + "\"";
}

// Reads the flags after `sweep` into axes; which flags are booleans comes from the plan flags
// themselves.
std::vector<Axis> read_axes(const std::vector<std::string>& args) {
  CLI::App probe;
  PlanFlags unused;
  add_plan_flags(&probe, unused);
  std::vector<Axis> axes;
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a.rfind("--", 0) != 0) throw InputError(fmt::format("sweep: \"{}\" is not a flag (give plan flags, e.g. --micro-batch 1..8)", a));
    std::string flag = a, value;
    bool has_value = false;
    if (const auto eq = a.find('='); eq != std::string::npos) {
      flag = a.substr(0, eq);
      value = a.substr(eq + 1);
      has_value = true;
    }
    const CLI::Option* opt = probe.get_option_no_throw(flag);
    if (!opt) throw InputError(fmt::format("sweep: {} is not a plan flag (see peftplan plan --help)", flag));
    Axis ax{flag, {}, opt->get_expected_min() == 0};
    if (ax.boolean) {
      if (has_value) throw InputError(fmt::format("sweep: {} takes no value", flag));
      axes.push_back(ax);
      continue;
    }
    if (!has_value) {
      if (i + 1 >= args.size()) throw InputError(fmt::format("sweep: {} needs a value", flag));
      value = args[++i];
    }
    if (kWholeFlags.count(flag)) ax.values = {value};
    else if (kIntegerFlags.count(flag) && (value.find(',') != std::string::npos || value.find("..") != std::string::npos))
      for (std::int64_t v : parse_int_list(flag, value)) ax.values.push_back(std::to_string(v));
    else
      for (auto w : split_commas(flag, value)) ax.values.emplace_back(w);
    axes.push_back(std::move(ax));
  }
  return axes;
}

}  // namespace

void add_sweep_command(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand("sweep", "plan a grid over any plan flag (lists and ranges), one row per configuration");
  cmd->footer(
      "Every flag of `peftplan plan` may hold a list: integers as 8,16,32 / 1..8 / 8..64:8 / 8..64:x2, words as comma lists.\n"
      "--lora-targets, --alloc-conf and file flags are never split.\n"
      "example: peftplan sweep --model llama-2-7b,llama-2-13b --lora-r 16 --strategy ddp,zero2,zero3 --micro-batch 1..8:x2 --out grid.csv");
  struct Options {
    std::string format = "csv";
    std::string out;
  };
  auto o = std::make_shared<Options>();
  cmd->add_option("--format", o->format, "csv (a header comment names the schema) or jsonl")->capture_default_str();
  cmd->add_option("--out", o->out, "write here (atomically) instead of stdout")->check(kNonEmpty);
  cmd->allow_extras();
  cmd->callback([&exit_code, o, cmd] {
    if (o->format != "csv" && o->format != "jsonl") throw input_error("--format", "", "must be csv or jsonl", fmt::format("\"{}\"", o->format));
    const std::vector<Axis> axes = read_axes(cmd->remaining());
    std::size_t total = 1;
    for (const auto& a : axes) {
      if (!a.boolean) total *= a.values.size();
      if (total > 1'000'000) throw InputError("sweep: the grid has more than 1,000,000 configurations; narrow a list");
    }
    // Every configuration's flags, parsed up front: a value CLI11 refuses stops the sweep here.
    std::vector<std::vector<std::string>> grid_values(total);
    std::vector<PlanFlags> flags(total);
    for (std::size_t k = 0; k < total; ++k) {
      std::vector<std::string> argv;
      std::size_t rest = k;
      for (auto it = axes.rbegin(); it != axes.rend(); ++it) {  // the last axis varies fastest
        if (it->boolean) {
          argv.push_back(it->flag);
          continue;
        }
        const std::string& v = it->values[rest % it->values.size()];
        rest /= it->values.size();
        argv.push_back(it->flag + "=" + v);
        if (it->values.size() > 1) grid_values[k].insert(grid_values[k].begin(), v);
      }
      CLI::App one;
      add_plan_flags(&one, flags[k]);
      // argv runs from the last axis to the first: the reversed order CLI11's parse(vector) takes.
      try {
        one.parse(argv);
      } catch (const CLI::ParseError& e) {
        throw InputError(fmt::format("sweep: {}", e.what()));
      }
    }
    std::vector<std::string> grid_names;
    for (const auto& a : axes)
      if (a.values.size() > 1) grid_names.push_back(a.flag);  // "--micro-batch": the grid's own columns, named as the flags

    const std::vector<planner::SweepColumn>& columns = planner::sweep_columns();
    std::vector<nlohmann::json> rows(total);
    std::atomic<std::size_t> next{0}, done{0};
    // What resolving the flags warns of (a target the model lacks, a checkpoint saved quantised
    // that --quant asks otherwise of): once each on stderr, as plan prints them, in the order the
    // grid first meets them.
    std::mutex warned_mutex;
    std::map<std::string, std::size_t> warned;  // each warning once, with the first row that gave it
    auto worker = [&] {
      for (std::size_t k; (k = next.fetch_add(1)) < total; ++done) {
        nlohmann::json row;
        try {
          const ResolvedPlan rp = resolve_plan_flags(flags[k]);
          if (!rp.warnings.empty()) {
            const std::lock_guard<std::mutex> lock(warned_mutex);
            for (const auto& w : rp.warnings)
              if (auto [it, fresh] = warned.emplace(w, k); !fresh) it->second = std::min(it->second, k);
          }
          planner::PlanOptions po;
          po.headroom_fraction = rp.headroom_fraction;
          po.explain = false;
          po.names = false;
          const nlohmann::json pj = planner::plan_to_json(planner::make_plan(rp.input, rp.cluster, po));
          for (const auto& c : columns) {
            const nlohmann::json* v = &pj;
            for (const auto& key : c.path) v = v->is_object() && v->contains(key) ? &(*v)[key] : nullptr;
            row[c.name] = v ? *v : nlohmann::json(nullptr);
          }
          row["error"] = nullptr;
        } catch (const InputError& e) {
          for (const auto& c : columns) row[c.name] = nullptr;
          row["error"] = e.what();
        }
        rows[k] = std::move(row);
      }
    };
    const unsigned n = std::max(1u, std::min<unsigned>(std::thread::hardware_concurrency(), static_cast<unsigned>(total)));
    std::vector<std::thread> threads;
    for (unsigned t = 0; t < n; ++t) threads.emplace_back(worker);
    if (::isatty(2)) {  // a progress bar on a terminal
      while (done.load() < total) {
        const std::size_t d = done.load();
        const int w = 40, f = static_cast<int>(w * d / total);
        fmt::print(stderr, "\r[{}{}] {}/{}", std::string(static_cast<std::size_t>(f), '='), std::string(static_cast<std::size_t>(w - f), ' '), d, total);
        std::fflush(stderr);
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
      fmt::print(stderr, "\r{}\r", std::string(60, ' '));
    }
    for (auto& t : threads) t.join();
    std::vector<std::pair<std::size_t, std::string_view>> in_grid_order;
    for (const auto& [w, k] : warned) in_grid_order.emplace_back(k, w);
    std::sort(in_grid_order.begin(), in_grid_order.end());
    for (const auto& [k, w] : in_grid_order) fmt::print(stderr, "warning: {}\n", with_flags(std::string(w)));

    // A value refused in every configuration that holds it, for itself (the error names its own
    // flag: "--strategy: must be one of ..."), is bad input, not a refused combination: exit 2,
    // nothing written.
    for (std::size_t a = 0; a < axes.size(); ++a) {
      if (axes[a].boolean) continue;
      std::size_t stride = 1;  // the last axis varies fastest
      for (std::size_t b = a + 1; b < axes.size(); ++b)
        if (!axes[b].boolean) stride *= axes[b].values.size();
      const std::string prefix = axes[a].flag + ":";
      for (std::size_t v = 0; v < axes[a].values.size(); ++v) {
        const nlohmann::json* first = nullptr;
        bool every = true;
        for (std::size_t k = 0; k < total && every; ++k) {
          if ((k / stride) % axes[a].values.size() != v) continue;
          const auto& e = rows[k]["error"];
          every = e.is_string() && e.get<std::string>().rfind(prefix, 0) == 0;
          if (!first) first = &e;
        }
        if (every && first) throw InputError(first->get<std::string>());
      }
    }

    // Every configuration refused: no table to write (an --out file keeps what it held).
    if (std::all_of(rows.begin(), rows.end(), [](const nlohmann::json& r) { return !r["error"].is_null(); }))
      throw InputError(fmt::format("sweep: the planner refused every configuration ({}); the first: {}", total,
                                   rows.front()["error"].get<std::string>()));

    std::string text;
    std::size_t errors = 0;
    if (o->format == "csv") {
      text += fmt::format("# {}: one row per configuration of the grid ({}), in grid order; bytes per GPU, seconds per optimizer step\n",
                          schemas::kSweep, grid_names.empty() ? std::string("a single configuration") : fmt::format("{}", fmt::join(grid_names, " x ")));
      std::vector<std::string> header = grid_names;
      for (const auto& c : columns) header.push_back(c.name);
      header.push_back("error");
      text += fmt::format("{}\n", fmt::join(header, ","));
    }
    for (std::size_t k = 0; k < total; ++k) {
      errors += !rows[k]["error"].is_null();
      if (o->format == "csv") {
        std::vector<std::string> f;
        for (const auto& v : grid_values[k]) f.push_back(csv_field(v));
        for (const auto& c : columns) f.push_back(csv_field(rows[k][c.name]));
        f.push_back(csv_field(rows[k]["error"]));
        text += fmt::format("{}\n", fmt::join(f, ","));
      } else {
        nlohmann::ordered_json j;
        j["schema"] = schemas::kSweep;
        for (std::size_t g = 0; g < grid_names.size(); ++g) j[grid_names[g]] = grid_values[k][g];
        for (const auto& c : columns) j[c.name] = rows[k][c.name];
        j["error"] = rows[k]["error"];
        text += j.dump() + "\n";
      }
    }
    if (o->out.empty()) fmt::print("{}", text);
    else {
      write_text_atomic(o->out, text);
      fmt::print(stderr, "{} configuration(s) ({} refused by the planner) written to {}\n", total, errors, o->out);
    }
    exit_code = 0;
  });
}

}  // namespace peftplan::cli
