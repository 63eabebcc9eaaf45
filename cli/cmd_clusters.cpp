// `peftplan clusters`: the GPU and link catalogs and the bundled cluster presets.
#include <memory>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "peftplan/sim/cluster.h"

namespace peftplan::cli {

void add_clusters_command(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand("clusters", "list GPU and link catalogs and cluster presets");
  cmd->footer("example: peftplan clusters");
  auto json_out = std::make_shared<bool>(false);
  cmd->add_flag("--json", *json_out, "machine-readable output");
  cmd->callback([&exit_code, json_out] {
    if (*json_out) fmt::print("{}\n", sim::catalogs_to_json().dump(2));
    else fmt::print("{}", sim::describe_catalogs());
    exit_code = 0;
  });
}

}  // namespace peftplan::cli
