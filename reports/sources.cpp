// Reports from saved tables (see sources.h).
#include "peftplan/reports/sources.h"

#include <cmath>
#include <limits>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "peftplan/common/error.h"
#include "peftplan/common/json_fields.h"
#include "peftplan/common/json_file.h"
#include "peftplan/common/schemas.h"
#include "peftplan/common/units.h"
#include "peftplan/planner/plan.h"

namespace peftplan::reports {
namespace {

namespace jf = json_fields;
using Json = nlohmann::json;

// One CSV record from `text` at `pos` (RFC 4180: a quoted field may hold commas, doubled quotes
// and newlines), as csv_field in cli/cmd_sweep.cpp writes them. `pos` moves past the record.
std::vector<std::string> csv_record(const std::string& text, std::size_t& pos, const std::string& where) {
  std::vector<std::string> fields(1);
  bool quoted = false;
  for (; pos < text.size(); ++pos) {
    const char c = text[pos];
    if (quoted) {
      if (c != '"') fields.back() += c;
      else if (pos + 1 < text.size() && text[pos + 1] == '"') fields.back() += text[++pos];
      else quoted = false;
    } else if (c == '"') {
      quoted = true;
    } else if (c == ',') {
      fields.emplace_back();
    } else if (c == '\n') {
      ++pos;
      return fields;
    } else if (c != '\r') {
      fields.back() += c;
    }
  }
  if (quoted) throw InputError(fmt::format("{}: a quoted field is not closed (the file is truncated)", where));
  return fields;
}

// A CSV cell as the JSON value the JSON-lines form writes: empty is null, true/false booleans,
// numbers numbers, anything else a string.
Json csv_value(const std::string& cell) {
  if (cell.empty()) return nullptr;
  if (cell == "true") return true;
  if (cell == "false") return false;
  const char c = cell.front();
  if ((c >= '0' && c <= '9') || c == '-') {
    const Json v = Json::parse(cell, nullptr, false);
    if (!v.is_discarded() && v.is_number()) return v;
  }
  return cell;
}

std::uint64_t bytes_of(const Json& row, const std::string& key, const std::string& where) {
  return static_cast<std::uint64_t>(jf::required_integer(row, key, where, {}, 0));
}
double seconds_of(const Json& row, const std::string& key, const std::string& where) {
  return jf::required_number(row, key, where, {}, jf::Sign::non_negative);
}

SweepRow sweep_row(const Json& row, const std::vector<std::string>& grid, const std::string& where) {
  SweepRow r;
  for (const auto& g : grid) {
    const Json& v = jf::required(row, g, where);
    r.grid.push_back({g, v.is_string() ? v.get<std::string>() : v.dump()});
  }
  for (const auto& c : planner::sweep_columns()) jf::required(row, c.name, where);  // every column, even a refused row's (null)
  jf::required(row, "error", where);
  if (const Json* e = jf::find(row, "error")) {
    r.error = jf::as_string(*e, where, "error");
    return r;
  }
  r.model = jf::as_string(row["model"], where, "model");
  r.strategy = jf::as_string(row["strategy"], where, "strategy");
  r.profile = jf::as_string(row["profile"], where, "profile");
  r.cluster = jf::as_string(row["cluster"], where, "cluster");
  Figures& f = r.figures;
  for (int i = 0; i < sim::kNumDeviceCategories; ++i)
    f.at_peak_bytes[static_cast<std::size_t>(i)] = bytes_of(row, std::string(sim::name_of(static_cast<sim::MemCategory>(i))) + "_bytes", where);
  f.allocated_peak_bytes = bytes_of(row, "allocated_peak_bytes", where);
  f.reserved_peak_bytes = bytes_of(row, "reserved_peak_bytes", where);
  f.used_peak_bytes = bytes_of(row, "used_peak_bytes", where);
  f.outside_allocator_bytes = bytes_of(row, "outside_allocator_bytes", where);
  f.capacity_bytes = bytes_of(row, "capacity_bytes", where);
  f.host_peak_bytes = bytes_of(row, "host_peak_bytes", where);
  f.headroom_fraction = jf::required_number(row, "headroom_fraction", where, {}, jf::Sign::non_negative);
  f.fits = jf::as_boolean(row["fits"], where, "fits");
  f.ranks = static_cast<std::int32_t>(jf::required_integer(row, "ranks", where, {}, 1, 1 << 20));
  Figures::Time t;
  t.step_s = seconds_of(row, "step_s", where);
  t.compute_s = seconds_of(row, "compute_s", where);
  t.comm_s = seconds_of(row, "comm_s", where);
  t.exposed_comm_s = seconds_of(row, "exposed_comm_s", where);
  t.optimizer_s = seconds_of(row, "optimizer_s", where);
  t.offload_s = seconds_of(row, "offload_s", where);
  t.tokens_per_s = seconds_of(row, "tokens_per_s", where);
  t.tokens_per_s_per_gpu = seconds_of(row, "tokens_per_s_per_gpu", where);
  t.mfu = seconds_of(row, "mfu", where);
  t.host_bound = jf::as_boolean(row["host_bound"], where, "host_bound");
  f.time = t;
  Figures::Comm c;
  for (int i = 0; i < sim::kNumCollectives; ++i)
    c.collective_bytes[static_cast<std::size_t>(i)] = bytes_of(row, std::string(sim::name_of(static_cast<sim::Collective>(i))) + "_bytes", where);
  c.intra_node_bytes = bytes_of(row, "intra_node_bytes", where);
  c.inter_node_bytes = bytes_of(row, "inter_node_bytes", where);
  c.device_to_host_bytes = bytes_of(row, "device_to_host_bytes", where);
  c.host_to_device_bytes = bytes_of(row, "host_to_device_bytes", where);
  f.comm = c;
  return r;
}

std::string schema_problem(std::string_view got) {
  return fmt::format("must be \"{}\" (the output of peftplan sweep, CSV or --format jsonl), got \"{}\"", schemas::kSweep, got);
}

}  // namespace

SweepTable read_sweep(const std::string& text, const std::string& source) {
  SweepTable t;
  if (text.empty()) throw input_error(source, "", "is empty (expected the output of peftplan sweep)");
  // A sweep is UTF-8 text: a byte that is not (a binary file, Latin-1) is refused where it is.
  if (const std::size_t at = first_unprintable(text, true); at != std::string::npos)
    throw input_error(source, "", fmt::format("holds a byte that is not UTF-8 text at offset {} (expected the output of peftplan sweep)", at));
  if (text.front() == '{') {  // JSON lines
    std::size_t pos = 0;
    for (int line = 1; pos < text.size(); ++line) {
      const std::size_t end = std::min(text.find('\n', pos), text.size());
      const std::string l = text.substr(pos, end - pos);
      pos = end + 1;
      if (l.empty()) continue;
      const std::string where = fmt::format("{} line {}", source, line);
      const Json row = parse_json_text(l, where);  // depth-checked; a truncated line is an InputError naming it
      if (!row.is_object()) throw InputError(fmt::format("{}: is not a JSON object (a foreign line)", where));
      const std::string schema = jf::as_string(jf::required(row, "schema", where), where, "schema");
      if (schema != schemas::kSweep) throw input_error(where, "schema", schema_problem(schema));
      // The grid's flags in the line's order (the sweep's axis order; a plain json sorts its keys).
      std::vector<std::string> grid;
      const nlohmann::ordered_json in_order = nlohmann::ordered_json::parse(l);
      for (const auto& [k, v] : in_order.items())
        if (k.rfind("--", 0) == 0) grid.push_back(k);
      if (t.rows.empty()) t.grid_flags = grid;
      else if (grid != t.grid_flags) throw InputError(fmt::format("{}: its grid flags differ from line 1's (rows of two sweeps?)", where));
      t.rows.push_back(sweep_row(row, t.grid_flags, where));
    }
  } else {  // CSV: the schema comment, the header, the rows
    const std::string prefix = "# ";
    const std::size_t first_end = std::min(text.find('\n'), text.size());
    const std::string comment = text.substr(0, first_end);
    const std::size_t colon = comment.find(':');
    const std::string schema = comment.rfind(prefix, 0) == 0 ? comment.substr(2, colon == std::string::npos ? std::string::npos : colon - 2) : "";
    if (schema != schemas::kSweep)
      throw input_error(source, "line 1 (the schema comment)", schema_problem(schema.empty() ? comment.substr(0, 40) : schema));
    std::size_t pos = first_end + 1;
    if (pos >= text.size()) throw input_error(source, "line 2 (the header)", "is missing (the file is truncated)");
    const std::vector<std::string> header = csv_record(text, pos, source + " line 2");
    std::size_t fixed = header.size();
    for (std::size_t i = 0; i < header.size(); ++i)
      if (header[i].rfind("--", 0) != 0) {
        fixed = i;
        break;
      }
    t.grid_flags.assign(header.begin(), header.begin() + static_cast<std::ptrdiff_t>(fixed));
    for (int line = 3; pos < text.size(); ++line) {
      const std::string where = fmt::format("{} line {}", source, line);
      const std::vector<std::string> cells = csv_record(text, pos, where);
      if (cells.size() == 1 && cells[0].empty()) continue;  // a blank line
      if (cells.size() != header.size())
        throw InputError(fmt::format("{}: has {} fields, the header {} (a truncated or foreign row)", where, cells.size(), header.size()));
      Json row = Json::object();
      for (std::size_t i = 0; i < cells.size(); ++i) row[header[i]] = i < fixed ? Json(cells[i]) : csv_value(cells[i]);
      t.rows.push_back(sweep_row(row, t.grid_flags, where));
    }
  }
  if (t.rows.empty()) throw input_error(source, "", "holds no rows (a sweep writes one per configuration)");
  return t;
}

ReportInput sweep_report(const SweepTable& t, const std::string& source) {
  ReportInput ri;
  const SweepRow* planned = nullptr;
  for (const auto& r : t.rows)
    if (r.error.empty()) {
      planned = &r;
      break;
    }
  std::string grid;
  for (const auto& g : t.grid_flags) grid += (grid.empty() ? "" : " · ") + g;
  ri.title = fmt::format("peftplan sweep: {} configurations{}{}", t.rows.size(), planned ? " of " + planned->model : std::string(),
                         grid.empty() ? "" : " over " + grid);
  ri.provenance.inputs = {{"inputs from", source}, {"grid", grid.empty() ? std::string("a single configuration") : grid}};
  if (planned) {
    ri.provenance.inputs.push_back({"model", planned->model});
    ri.provenance.inputs.push_back({"cluster", planned->cluster});
    ri.provenance.inputs.push_back({"runtime profile", planned->profile});
  }
  std::size_t refused = 0;
  for (const auto& r : t.rows) {
    StrategyColumn c;
    std::string label, args;
    for (const auto& [flag, value] : r.grid) {
      label += (label.empty() ? "" : " · ") + value;
      args += (args.empty() ? "" : " ") + flag + " " + value;
    }
    c.label = label.empty() ? r.strategy : label;
    c.plan_args = args;
    c.figures = r.figures;
    if (!r.error.empty()) {
      c.note = "refused: " + r.error;
      ++refused;
    }
    ri.strategies.push_back(std::move(c));
  }
  ri.provenance.inputs.push_back({"rows", fmt::format("{} ({} refused by the planner)", t.rows.size(), refused)});
  ri.list_every_column = true;
  ri.columns_are = grid.empty() ? "configurations" : "configurations (" + grid + ")";
  ri.no_recommendation = "No recommendation: a sweep plans the grid it was given (peftplan recommend searches and ranks).";
  ri.no_knobs = "No knob deltas: the sweep's own rows are the changes (see the table of every configuration).";
  ri.base_label = ri.strategies.front().label;
  return ri;
}

ReportInput recommendation_report(const planner::Recommendation& rec, const std::string& source) {
  ReportInput ri;
  ri.title = fmt::format("peftplan recommend: {} on {}", rec.model, rec.cluster);
  ri.provenance.inputs = {{"inputs from", source},
                          {"model", rec.model},
                          {"cluster", fmt::format("{} ({:.0f} GiB per GPU)", rec.cluster, to_gib(rec.capacity_bytes))},
                          {"objective", std::string(planner::name_of(rec.objective))},
                          {"search", fmt::format("{} plans made, {} timed, {} fitting (the file holds the top {})", rec.evaluated, rec.timed, rec.fitting, rec.ranked.size())},
                          {"headroom", fmt::format("{:.0f}% of the GPU kept free beyond the predicted peak in use", 100 * rec.headroom_fraction)}};
  ri.recommendation = rec;
  auto column = [&](const planner::Candidate& c, std::string label, std::string note) {
    StrategyColumn col;
    col.label = std::move(label);
    col.note = std::move(note);
    Figures& f = col.figures;
    for (int i = 0; i < sim::kNumDeviceCategories; ++i) f.at_peak_bytes[static_cast<std::size_t>(i)] = c.at_peak_bytes[static_cast<std::size_t>(i)];
    f.allocated_peak_bytes = c.allocated_peak_bytes;
    f.reserved_peak_bytes = c.reserved_peak_bytes;
    f.used_peak_bytes = c.used_peak_bytes;
    f.outside_allocator_bytes = c.used_peak_bytes - std::min(c.used_peak_bytes, c.reserved_peak_bytes);
    f.capacity_bytes = rec.capacity_bytes;
    f.headroom_fraction = rec.headroom_fraction;
    f.fits = c.fits;
    f.ranks = c.input.strategy.ranks;
    // A recommend row carries no communication transferred nor optimizer time (NaN: shown as "-"),
    // and no breakdown of its bytes.
    const double unknown = std::numeric_limits<double>::quiet_NaN();
    f.time = Figures::Time{c.step_s, c.compute_s, c.exposed_comm_s, unknown, unknown, c.offload_s, c.tokens_per_s,
                           c.tokens_per_s / std::max(1, c.input.strategy.ranks), c.mfu, c.host_bound};
    const auto& t = c.input.training;
    col.plan_args = fmt::format("--strategy {}{}{} --micro-batch {} --grad-accum {} --checkpointing {} --gpus {}", planner::name_of(c.input.strategy.stage),
                                c.input.strategy.offload_optimizer == planner::OffloadDevice::cpu ? " --offload-optimizer cpu" : "",
                                c.input.strategy.offload_param == planner::OffloadDevice::cpu ? " --offload-param cpu" : "", t.micro_batch, t.grad_accum,
                                planner::name_of(planner::CheckpointChoice{t.checkpointing, t.checkpoint_every}), c.input.strategy.ranks);
    ri.strategies.push_back(std::move(col));
  };
  // The top rows, then each other family's best (the strategies side by side, as the seed's chart
  // has them), then the rest of the ranked rows: the charts draw the first kMaxColumns.
  constexpr std::size_t kTopRows = 5;
  for (std::size_t i = 0; i < rec.ranked.size() && i < kTopRows; ++i) column(rec.ranked[i], fmt::format("#{} {}", i + 1, rec.ranked[i].family), "");
  for (const auto& x : rec.rejected)
    if (x.best) column(*x.best, x.family, x.fits ? "ranks lower" : "does not fit");
  for (std::size_t i = kTopRows; i < rec.ranked.size(); ++i) column(rec.ranked[i], fmt::format("#{} {}", i + 1, rec.ranked[i].family), "");
  if (ri.strategies.empty()) throw input_error(source, "ranked", "holds no row to show (nor does any rejected family have one)");
  ri.list_every_column = true;
  ri.columns_are = "rows of the search (the top 5, each other family's best, the other ranked rows)";
  ri.no_knobs = "No knob deltas: the search's rows are the alternatives (re-plan a row with peftplan report and its flags for them).";
  ri.base_label = ri.strategies.front().label;
  return ri;
}

}  // namespace peftplan::reports
