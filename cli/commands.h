// The subcommands of `peftplan`. Each add_* registers one CLI11 subcommand whose callback sets
// `exit_code` (0 ok, 1 a negative result such as "does not fit", 2 bad input via InputError).
#pragma once

#include <string>

#include <CLI/CLI.hpp>

namespace peftplan::cli {

// The command line peftplan was started with, shell-quoted (for reports' "reproduce with").
void set_command_line(int argc, char** argv);
const std::string& command_line();

// A folder as the messages name it, with one trailing slash: "out", "out/" and "out//" -> "out/".
std::string as_folder(const std::string& path);

// A flag's number that must be finite and >= 0 (a tolerance): NaN passes a comparison-based
// range check, so this one asks for what it wants.
CLI::Validator finite_non_negative();

void add_models_command(CLI::App& app, int& exit_code);
void add_params_command(CLI::App& app, int& exit_code);
void add_plan_command(CLI::App& app, int& exit_code);
void add_estimate_command(CLI::App& app, int& exit_code);
void add_clusters_command(CLI::App& app, int& exit_code);
void add_calibrate_command(CLI::App& app, int& exit_code);
void add_run_command(CLI::App& app, int& exit_code);
void add_compare_command(CLI::App& app, int& exit_code);
void add_recommend_command(CLI::App& app, int& exit_code);
void add_sweep_command(CLI::App& app, int& exit_code);
void add_explain_command(CLI::App& app, int& exit_code);
void add_report_command(CLI::App& app, int& exit_code);

}  // namespace peftplan::cli
