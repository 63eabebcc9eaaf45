// peftplan: plan, simulate and validate distributed PEFT fine-tuning. This file only wires the
// subcommands and maps failures to exit codes: 2 for bad input (one line, no stack trace),
// 1 for a negative result decided by a command, 3 for an internal error.
#include <cstdio>
#include <exception>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "commands.h"
#include "plan_flags.h"
#include "peftplan/common/error.h"
#include "peftplan/common/heap.h"

int main(int argc, char** argv) {
  peftplan::keep_freed_heap_memory();  // recommend and sweep plan thousands over the cores
  CLI::App app{"peftplan: plan, simulate and validate distributed PEFT (LoRA) fine-tuning"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "peftplan 0.1.0");
  int exit_code = 0;
  peftplan::cli::set_command_line(argc, argv);
  peftplan::cli::add_models_command(app, exit_code);
  peftplan::cli::add_params_command(app, exit_code);
  peftplan::cli::add_plan_command(app, exit_code);
  peftplan::cli::add_recommend_command(app, exit_code);
  peftplan::cli::add_sweep_command(app, exit_code);
  peftplan::cli::add_explain_command(app, exit_code);
  peftplan::cli::add_report_command(app, exit_code);
  peftplan::cli::add_clusters_command(app, exit_code);
  peftplan::cli::add_estimate_command(app, exit_code);
  peftplan::cli::add_calibrate_command(app, exit_code);
  peftplan::cli::add_run_command(app, exit_code);
  peftplan::cli::add_compare_command(app, exit_code);
  try {
    app.parse(argc, argv);
  } catch (const CLI::Success& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    // CLI11's own words for a flag it cannot take, in our error's form (one line, exit 2), and
    // where the flags are listed.
    fmt::print(stderr, "peftplan: error: {} (see peftplan{} --help)\n", e.what(),
               app.get_subcommands().empty() ? "" : " " + app.get_subcommands().front()->get_name());
    return 2;
  } catch (const peftplan::planner::KnobError& e) {  // names fields: say which flags set them
    std::vector<std::string> flags;
    for (const auto k : e.knobs()) flags.push_back(fmt::format("{} is {}", peftplan::planner::field_of(k), peftplan::cli::flag_of(k)));
    fmt::print(stderr, "peftplan: error: {} ({})\n", e.what(), fmt::join(flags, "; "));
    return 2;
  } catch (const peftplan::InputError& e) {
    fmt::print(stderr, "peftplan: error: {}\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    fmt::print(stderr, "peftplan: internal error: {}\n", e.what());
    return 3;
  }
  return exit_code;
}
