// measurement.json (see measurement.h).
#include "peftplan/executor/measurement.h"

#include <numeric>

#include "peftplan/common/schemas.h"

namespace peftplan::executor {

nlohmann::json measurement_to_json(const Measurement& m) {
  using nlohmann::json;
  json dev, host;
  for (int c = 0; c < sim::kNumCategories; ++c) {
    const auto cc = static_cast<sim::MemCategory>(c);
    const auto i = static_cast<std::size_t>(c);
    json& side = sim::on_host(cc) ? host : dev;
    side[std::string(sim::name_of(cc)) + "_bytes"] = m.memory.peak_bytes[i];
    side["at_peak"][std::string(sim::name_of(cc)) + "_bytes"] = m.memory.at_peak_bytes[i];
  }
  dev["peak_bytes"] = m.memory.device_peak_bytes;
  dev["peak_op"] = m.device_peak_op;
  dev["peak_op_index"] = m.memory.device_peak_op;
  dev["untracked_gemm_scratch_bytes"] = m.untracked_gemm_scratch_bytes;
  if (m.device_total_bytes > 0) {  // a device that is not the host: its reserved and in-use kinds
    dev["reserved_peak_bytes"] = m.device_reserved_peak_bytes;
    dev["in_use_bytes"] = m.device_in_use_bytes;
    dev["total_bytes"] = m.device_total_bytes;
  }
  host["peak_bytes"] = m.memory.host_peak_bytes;
  host["peak_op"] = m.host_peak_op;
  host["peak_op_index"] = m.memory.host_peak_op;
  const double total_s = std::accumulate(m.step_times_s.begin(), m.step_times_s.end(), 0.0);
  const auto steps = static_cast<double>(m.step_times_s.size());
  json ops = json::array();
  for (const OpTime& o : m.op_times)
    ops.push_back({{"phase", o.phase}, {"kernel", o.kernel}, {"label", o.label}, {"calls", o.calls},
                   {"total_s", o.total_s}, {"flops", o.flops}});
  json time = {{"step_s", steps > 0 ? total_s / steps : 0.0},
               {"tokens_per_s", total_s > 0 ? static_cast<double>(m.tokens_per_step) * steps / total_s : 0.0},
               {"model_flops_per_step", m.model_flops_per_step},
               {"achieved_flops_per_s", total_s > 0 ? m.model_flops_per_step * steps / total_s : 0.0},
               {"gemm_s", m.gemm_s},
               {"gemm_fraction", total_s > 0 ? m.gemm_s / total_s : 0.0},
               {"gemm_flops_per_s", m.gemm_s > 0 ? m.gemm_flops / m.gemm_s : 0.0}};
  json coll = json::object();
  for (const CollectiveStat& c : m.collectives)
    coll[c.kind] = {{"calls", c.calls}, {"bytes", c.bytes}, {"seconds", c.seconds}, {"bytes_per_step", c.bytes_per_step},
                    {"predicted_calls_per_step", c.predicted_calls_per_step},
                    {"predicted_bytes_per_step", c.predicted_bytes_per_step}};
  json j = json{{"schema", schemas::kMeasurement},
              {"backend", m.backend},
              {"ranks", m.ranks},
              {"rank", m.rank},
              {"collectives", coll},
              {"steps", m.losses.size()},
              {"tokens_per_step", m.tokens_per_step},
              {"losses", m.losses},
              {"grad_norms", m.grad_norms},
              {"skipped_steps", m.skipped_steps},
              {"lrs", m.lrs},
              {"step_times_s", m.step_times_s},
              {"time", time},
              {"memory", {{"device", dev}, {"host", host}}},
              {"ops", ops},
              {"op_s", m.op_s},
              {"op_s_steps", m.op_s_steps},
              {"exposed_comm_s", m.exposed_comm_s},
              {"collective_ops", m.collective_ops},
              {"collective_op_s_by_step", m.collective_op_s_by_step}};
  if (!m.collective_transfer_s.empty()) {
    j["collective_transfer_s"] = m.collective_transfer_s;
    j["collective_wait_s"] = m.collective_wait_s;
    j["sync_wait_s"] = m.sync_wait_s;
  }
  if (m.speed_probe_flops_per_s > 0.0) j["speed_probe_flops_per_s"] = m.speed_probe_flops_per_s;
  if (m.others_cpu_share) j["others_cpu_share"] = *m.others_cpu_share;
  if (!m.per_rank.is_null()) j["per_rank"] = m.per_rank;
  return j;
}

}  // namespace peftplan::executor
