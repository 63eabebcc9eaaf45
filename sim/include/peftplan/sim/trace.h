// Chrome trace export of a simulated step, in the Trace Event Format that chrome://tracing,
// Perfetto and Holistic Trace Analysis load, shaped like PyTorch profiler (Kineto) traces so a
// predicted and a measured trace can sit side by side: one pid per rank (named with
// process_name/process_labels metadata), one tid per stream (named with thread_name), ph "X"
// complete events with ts/dur in microseconds, memory as ph "C" counter events, and Kineto's
// top-level distributedInfo. The memory-only variant carries the counters alone.
// Pure functions returning JSON; writing the file is the caller's business.
#pragma once

#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "peftplan/sim/program.h"
#include "peftplan/sim/timeline.h"

namespace peftplan::sim {

struct TraceOptions {
  std::string process_name = "peftplan predicted";  // pid label; " rank <r>" is appended
  std::int32_t ranks = 1;          // ranks to draw (SPMD: each one a copy of the simulated rank)
  std::int32_t pid_base = 0;       // pid of rank 0, to keep clear of another trace's pids
  bool memory_counters = true;     // device/host totals as "C" events
  bool category_counters = true;   // and one series per memory category
};

// traceEvents for every op with a duration, plus memory counters and metadata.
nlohmann::json chrome_trace(const Program& program, const Timeline& timeline,
                            const TraceOptions& options = {});

// Counters only, stamped with the simulated time of each alloc/free.
nlohmann::json chrome_memory_trace(const Program& program, const Timeline& timeline,
                                   const TraceOptions& options = {});
// Counters only, without a timeline: the time axis is the op index (1 us per op).
nlohmann::json chrome_memory_trace(const Program& program, const TraceOptions& options = {});

}  // namespace peftplan::sim
