// The schema id of every JSON file peftplan writes or reads, one per file kind, in one place:
// a reader compares with the constant its writer uses, so the two cannot drift. Bump the number
// when a reader of the old version would misread the new one. (tools/peftplan_callback.py, in
// Python, writes kMeasurementTotals itself; tests/test_compare.cpp reads its output.)
// Deliberately not here: each file's fields (they live with the code that reads and writes them).
#pragma once

#include <string_view>

namespace peftplan::schemas {

inline constexpr std::string_view kPlanFile = "peftplan.plan/1";                  // plan.json (planner/plan_file.h)
inline constexpr std::string_view kPlanResult = "peftplan.plan-result/3";         // peftplan plan --json (3: suggestions as data)
inline constexpr std::string_view kMeasurement = "peftplan.measurement/1";        // peftplan-exec's measurement.json
inline constexpr std::string_view kMeasurementTotals = "peftplan.measurement-totals/1";  // a training job's totals
inline constexpr std::string_view kValidation = "peftplan.validation/2";          // validation.json
inline constexpr std::string_view kRunSummary = "peftplan.run-summary/2";         // peftplan run's summary.json
inline constexpr std::string_view kSpeedProbe = "peftplan.speed-probe/1";         // peftplan-exec probe
inline constexpr std::string_view kRecommendation = "peftplan.recommendation/3";  // peftplan recommend --json (2: suggestions as data; 3: model, cluster, capacity, headroom)
inline constexpr std::string_view kSweep = "peftplan.sweep/2";                   // peftplan sweep (CSV comment, JSON lines; 2: offload bytes, headroom)
inline constexpr std::string_view kScenario = "peftplan.scenario/1";             // peftplan-gui's saved scenario
inline constexpr std::string_view kCheckpoint = "peftplan.checkpoint/1";          // a training checkpoint's state.json

}  // namespace peftplan::schemas
