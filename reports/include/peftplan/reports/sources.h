// Reports from saved tables: a `peftplan sweep` table (CSV or JSON lines) and a `peftplan
// recommend --json`, read back as the report's columns. Nothing is re-planned: the figures are the
// file's own (a sweep keeps only the grid's flags, not the inputs they were added to), so the
// report shows exactly what the file says.
// Deliberately not here: the provenance (the command that makes the report: cli/cmd_report.cpp)
// and rendering (report.h).
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "peftplan/planner/recommend.h"
#include "peftplan/reports/report.h"

namespace peftplan::reports {

struct SweepRow {
  std::vector<std::pair<std::string, std::string>> grid;  // the grid's flags and this row's values
  std::string model, strategy, profile, cluster;
  std::string error;  // the planner refused the row (its figures are then empty)
  Figures figures;
};

struct SweepTable {
  std::vector<std::string> grid_flags;  // "--micro-batch", "--strategy": the grid's own columns
  std::vector<SweepRow> rows;           // in the file's (grid) order
};

// `text` is a sweep's output: CSV (its first line the schema comment "# peftplan.sweep/2: ...",
// then the header) or JSON lines (each line an object with "schema"). Throws InputError naming
// `source`, the line and the field for anything else (another schema, a missing column, a value
// of the wrong type, a truncated line).
SweepTable read_sweep(const std::string& text, const std::string& source);

// The report of a sweep: one column per row, labelled by its grid values ("2 · zero3"), every
// row in the "every configuration" table, the first rows in the charts.
ReportInput sweep_report(const SweepTable& table, const std::string& source);

// The report of a recommend --json: the ranked rows it holds and each rejected family's best row
// as columns, the recommendation with its reasons above them.
ReportInput recommendation_report(const planner::Recommendation& r, const std::string& source);

}  // namespace peftplan::reports
