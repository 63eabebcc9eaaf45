// What a Session reports (session_impl.h): its measurement, every rank's gathered on rank 0
// with each collective's transfer and wait, and run_plan, which runs a plan end to end.
#include "session_impl.h"

#include "peftplan/common/atomic_file.h"
#include "peftplan/common/paths.h"
#include "peftplan/executor/host_load.h"

namespace peftplan::executor {

Measurement Session::measurement() const {
  const Impl& s = *impl_;
  Measurement m = s.meas;
  m.memory = s.alloc.stats();
  if (const std::optional<Backend::MemoryKinds> k = s.be.device_memory_kinds()) {
    m.device_reserved_peak_bytes = k->reserved_peak_bytes;
    m.device_in_use_bytes = k->in_use_bytes;
    m.device_total_bytes = k->total_bytes;
  }
  auto op_name = [&](std::int32_t i) -> std::string {
    if (i < 0) return "";
    const auto& op = s.program.ops[static_cast<std::size_t>(i)];
    return op.buffer >= 0 ? "alloc " + s.buffer_label(op.buffer) : std::string(op.label);
  };
  m.device_peak_op = op_name(m.memory.device_peak_op);
  m.host_peak_op = op_name(m.memory.host_peak_op);
  // Per program op: mean seconds per step over the steady steps (planner::steady_samples, as
  // validation takes the step: the fastest of the recent steps after the first), so the
  // op times add up to the step they are compared with; over every step after the first when
  // the session ran its ops outside step() (forward_backward) and kept no steps to choose from.
  m.op_s.assign(s.program.ops.size(), 0.0);
  const std::vector<std::size_t> steady_steps = planner::steady_samples(s.meas.step_times_s, 1);
  std::vector<const Impl::StepOps*> steady;
  for (std::size_t k : steady_steps)
    for (const auto& r : s.ops_recent)
      if (r.step == k) steady.push_back(&r);
  if (!steady.empty() && steady.size() == steady_steps.size()) {
    for (const auto* r : steady) {
      for (std::size_t i = 0; i < m.op_s.size(); ++i) m.op_s[i] += r->op_s[i];
      m.exposed_comm_s += r->exposed_s;
    }
    for (double& x : m.op_s) x /= static_cast<double>(steady.size());
    m.exposed_comm_s /= static_cast<double>(steady.size());
    m.op_s_steps = static_cast<std::int64_t>(steady.size());
  } else if (s.op_runs > 1) {
    for (std::size_t i = 0; i < m.op_s.size(); ++i) m.op_s[i] = s.op_warm_s[i] / static_cast<double>(s.op_runs - 1);
    m.op_s_steps = s.op_runs - 1;
    m.exposed_comm_s = s.exposed_warm_s / static_cast<double>(s.op_runs - 1);
  }
  m.collective_ops = s.coll_ops;
  m.collective_op_s_by_step.assign(s.coll_recent.begin(), s.coll_recent.end());
  // Time per (phase, kernel, label), in first-appearance order.
  std::map<std::tuple<std::string, std::string, std::string>, std::size_t> index;
  nlohmann::json events = nlohmann::json::array();
  for (std::size_t i = s.first_step_op; i < s.program.ops.size(); ++i) {
    const sim::Op& op = s.program.ops[i];
    if (op.kind != OpKind::compute) continue;
    auto key = std::make_tuple(std::string(sim::name_of(op.phase)), std::string(sim::name_of(op.kernel)), std::string(op.label));
    auto [it, inserted] = index.emplace(key, m.op_times.size());
    if (inserted) m.op_times.push_back({std::get<0>(key), std::get<1>(key), std::get<2>(key), 0, 0.0, 0.0});
    OpTime& o = m.op_times[it->second];
    o.calls += static_cast<std::int64_t>(s.steps_done);
    o.total_s += s.op_s[i];
    o.flops += op.work.flops * static_cast<double>(s.steps_done);
    if (s.last_dur_s[i] >= 0.0)
      events.push_back({{"name", op.label.empty() ? std::string(sim::name_of(op.kernel)) : std::string(op.label)},
                        {"cat", sim::name_of(op.kernel)},
                        {"ph", "X"},
                        {"ts", s.last_start_s[i] * 1e6},
                        {"dur", s.last_dur_s[i] * 1e6},
                        {"pid", 0},
                        {"tid", 0},
                        {"args", {{"op", i}, {"phase", sim::name_of(op.phase)}, {"layer", op.layer}, {"micro_batch", op.micro_batch},
                                  {"flops", op.work.flops}}}});
  }
  // Collectives: measured (the communicator's counters) and the program's, per step.
  const auto steps = static_cast<std::uint64_t>(s.meas.step_times_s.size());
  CommCounters cc;
  if (s.comm) cc = s.comm->counters();
  for (int k = 0; k < sim::kNumCollectives; ++k) {
    CollectiveStat c;
    c.kind = std::string(sim::name_of(static_cast<sim::Collective>(k)));
    for (std::size_t i = s.first_step_op; i < s.program.ops.size(); ++i) {
      const sim::Op& op = s.program.ops[i];
      if (op.kind == OpKind::collective && static_cast<int>(op.collective) == k && s.N > 1) {
        c.predicted_calls_per_step += 1;
        c.predicted_bytes_per_step += op.bytes;
      }
    }
    const CommCounter& got = cc[static_cast<CommKind>(k)];  // CommKind shares NCCL's order
    const CommCounter& before = s.base_counters[static_cast<CommKind>(k)];
    c.calls = got.calls - before.calls;
    c.bytes = got.bytes - before.bytes;
    c.seconds = got.seconds - before.seconds;
    c.bytes_per_step = steps ? c.bytes / steps : 0;
    m.collectives.push_back(c);
  }
  m.rank = s.rank;
  m.trace = {{"traceEvents", events}, {"displayTimeUnit", "ms"},
             {"otherData", {{"process", "peftplan measured step"}, {"backend", m.backend}}}};
  return m;
}

namespace {

// Every rank's measurement JSON on rank 0 (null elsewhere): lengths, then the texts padded to
// the longest, with all_gather.
nlohmann::json gather_measurements(Communicator& comm, const nlohmann::json& mine) {
  const std::string text = mine.dump();
  const auto n = static_cast<std::size_t>(comm.size());
  std::vector<std::int64_t> lengths(n);
  const auto len = static_cast<std::int64_t>(text.size());
  comm.all_gather(&len, lengths.data(), 1, CommDType::int64);
  const auto longest = static_cast<std::size_t>(*std::max_element(lengths.begin(), lengths.end()));
  std::vector<char> send(longest, ' '), all(longest * n);
  std::copy(text.begin(), text.end(), send.begin());
  comm.all_gather(send.data(), all.data(), longest, CommDType::uint8);
  if (comm.rank() != 0) return nullptr;
  nlohmann::json ranks = nlohmann::json::array();
  for (std::size_t r = 0; r < n; ++r)
    ranks.push_back(nlohmann::json::parse(all.begin() + static_cast<std::ptrdiff_t>(r * longest),
                                          all.begin() + static_cast<std::ptrdiff_t>(r * longest + static_cast<std::size_t>(lengths[r]))));
  return ranks;
}

}  // namespace

void split_collective_time(Measurement& m) {
  const auto& ranks = m.per_rank;
  if (!ranks.is_array() || ranks.empty() || m.collective_ops.empty()) return;
  std::vector<std::vector<std::vector<double>>> d;  // [rank][step][collective]
  for (const auto& r : ranks) {
    if (!r.contains("collective_op_s_by_step") || r.at("collective_ops") != nlohmann::json(m.collective_ops)) return;
    d.push_back(r.at("collective_op_s_by_step").get<std::vector<std::vector<double>>>());
  }
  std::size_t steps = d.front().size();
  for (const auto& r : d) steps = std::min(steps, r.size());
  if (steps == 0) return;
  // Row k of the last `steps` rows is step n - steps + k of rank 0's step_times_s; the first
  // step (warm-up) is left out.
  const std::size_t n = m.step_times_s.size();
  std::vector<std::size_t> rows;
  for (std::size_t k = 0; k < steps; ++k)
    if (n < steps || n - steps + k >= 1) rows.push_back(k);
  if (rows.empty())  // one step only: it is all there is
    for (std::size_t k = 0; k < steps; ++k) rows.push_back(k);
  const std::size_t C = m.collective_ops.size();
  m.collective_transfer_s.assign(C, 0.0);
  m.collective_wait_s.assign(C, 0.0);
  for (std::size_t c = 0; c < C; ++c) {
    for (std::size_t k : rows) {
      double lo = std::numeric_limits<double>::max(), sum = 0.0;
      for (const auto& r : d) {
        const std::size_t kk = r.size() - steps + k;  // align the last `steps` steps
        lo = std::min(lo, r[kk][c]);
        sum += r[kk][c];
      }
      m.collective_transfer_s[c] += lo;
      m.collective_wait_s[c] += sum / static_cast<double>(d.size()) - lo;
    }
    m.collective_transfer_s[c] /= static_cast<double>(rows.size());
    m.collective_wait_s[c] /= static_cast<double>(rows.size());
  }
  m.sync_wait_s = std::accumulate(m.collective_wait_s.begin(), m.collective_wait_s.end(), 0.0);
}

void gather_ranks(Measurement& m, Communicator& comm) {
  if (comm.size() <= 1) return;
  nlohmann::json mine = measurement_to_json(m);
  mine.erase("per_rank");
  m.per_rank = gather_measurements(comm, mine);
  if (comm.rank() == 0) split_collective_time(m);
}

Measurement run_plan(const planner::PlanFile& plan, Backend& backend, const std::filesystem::path& out_dir,
                     std::FILE* progress, Communicator* comm, const SessionOptions& options) {
  check_executable(plan);
  // Every folder the run writes into, made before the first step (rank 0 writes them).
  if (!comm || comm->rank() == 0) {
    if (plan.run.checkpoint_every > 0) make_folder(plan.run.checkpoint_dir, "run.checkpoint_dir");
    if (!plan.run.save_adapter.empty()) make_folder(plan.run.save_adapter, "run.save_adapter");
    make_folder(out_dir, "--out");
  }
  // The machine's speed as calibration measures it (calibrate.h), before the session: its
  // all_reduce is not the program's and must not reach the session's collective counters.
  const double probe = speed_probe(backend, comm, kProbeWindowS);
  Session session(plan, backend, load_data(plan), comm, options);
  const bool root = !comm || comm->rank() == 0;
  if (!root) progress = nullptr;
  const auto& t = plan.input.training;
  if (!plan.run.resume.empty()) {
    session.resume(plan.run.resume);
    if (progress) std::fprintf(progress, "peftplan-exec: resumed from %s at step %lld\n", plan.run.resume.c_str(),
                               static_cast<long long>(session.steps_done()));
  }
  if (progress)
    std::fprintf(progress, "peftplan-exec: %s, %s, %d rank(s) %s, B=%lld S=%lld accum=%lld, %lld steps\n", plan.input.model.name.c_str(),
                 backend.description().c_str(), plan.input.strategy.ranks, std::string(planner::name_of(plan.input.strategy.stage)).c_str(),
                 static_cast<long long>(t.micro_batch), static_cast<long long>(t.seq_len),
                 static_cast<long long>(t.grad_accum), static_cast<long long>(plan.run.steps));
  HostLoad load;  // other work beside the steps (host_load.h)
  load.begin(comm);
  while (session.steps_done() < plan.run.steps) {
    const StepStats st = session.step();
    if (progress) {
      std::fprintf(progress, "step %lld/%lld  loss %.6f  grad_norm %.4f  lr %.3g  %.3f s  %.0f tokens/s\n",
                   static_cast<long long>(st.step), static_cast<long long>(plan.run.steps), st.loss, st.grad_norm, st.lr,
                   st.seconds, static_cast<double>(t.micro_batch * t.seq_len * t.grad_accum * plan.input.strategy.ranks) / st.seconds);
      std::fflush(progress);
    }
    if (plan.run.checkpoint_every > 0 && st.step % plan.run.checkpoint_every == 0) {
      session.save_checkpoint(plan.run.checkpoint_dir);
      if (progress) {
        std::fprintf(progress, "checkpoint %s/step-%lld\n", plan.run.checkpoint_dir.c_str(), static_cast<long long>(st.step));
        std::fflush(progress);
      }
    }
  }
  Measurement m = session.measurement();  // before load.end: its all_reduces are not the program's
  m.speed_probe_flops_per_s = probe;
  m.others_cpu_share = load.end(comm);
  // ZeRO-3: the adapter is sharded; every rank takes part in gathering it.
  if (plan.input.strategy.stage == planner::Stage::zero3 && !plan.run.save_adapter.empty()) session.trainable_weights();
  if (comm) gather_ranks(m, *comm);
  if (!root) return m;
  auto write = [](const std::filesystem::path& p, const nlohmann::json& j) { write_text_atomic(p, j.dump(1) + "\n"); };
  write(out_dir / "measurement.json", measurement_to_json(m));
  write(out_dir / "trace.json", m.trace);
  if (!plan.run.save_adapter.empty()) session.save_adapter(plan.run.save_adapter);
  return m;
}

planner::PlanFile round_plan(const planner::PlanFile& plan, int round) {
  planner::PlanFile r = plan;
  if (round > 1) {
    r.run.save_adapter.clear();
    r.run.checkpoint_every = 0;
    r.run.checkpoint_dir.clear();
  }
  return r;
}

void run_rounds(const std::vector<std::filesystem::path>& plan_paths, int rounds, Backend& backend, std::FILE* progress,
                Communicator* comm, const SessionOptions& options, const std::filesystem::path& out_dir) {
  namespace fs = std::filesystem;
  if (plan_paths.empty()) throw InputError("peftplan-exec: no plan.json to run");
  if (rounds < 1) throw InputError(fmt::format("peftplan-exec --rounds {}: must be at least 1", rounds));
  if (!out_dir.empty() && (plan_paths.size() > 1 || rounds > 1))
    throw InputError(fmt::format("peftplan-exec --out {}: takes one plan and one round (several: each plan's folder is its output)",
                                 out_dir.string()));
  const int ranks = comm ? comm->size() : 1;
  const bool root = !comm || comm->rank() == 0;
  if (!root) progress = nullptr;
  struct Job {
    fs::path dir;  // round 1's output; later rounds' under it
    planner::PlanFile plan;
    std::string strategy;
    fs::path plan_path;
  };
  std::vector<Job> jobs;
  for (const fs::path& p : plan_paths) {  // every plan checked before anything runs
    Job j{out_dir.empty() ? fs::absolute(p).parent_path() : fs::absolute(out_dir), load_plan(p), "", p};
    if (j.plan.input.strategy.ranks != ranks)
      throw InputError(fmt::format("peftplan-exec {}: the plan is for {} ranks, the job has {} (mpirun -np {})", p.string(),
                                   j.plan.input.strategy.ranks, ranks, j.plan.input.strategy.ranks));
    j.strategy = std::string(planner::name_of(j.plan.input.strategy.stage));
    jobs.push_back(std::move(j));
  }
  const bool several = jobs.size() > 1;
  for (int round = 1; round <= rounds; ++round) {
    std::string line;
    for (std::size_t i = 0; i < jobs.size(); ++i) {
      const Job& job = jobs[i];
      const fs::path dir = round == 1 ? job.dir : job.dir / "rounds" / std::to_string(round);
      const planner::PlanFile plan = round_plan(job.plan, round);
      if (round > 1 && root) {
        fs::create_directories(dir);
        planner::write_plan_file(dir / "plan.json", plan);  // each round's folder describes its run
      }
      std::FILE* steps = round == 1 ? progress : nullptr;
      if (steps && several)
        std::fprintf(steps, "\n== %s (%zu of %zu), round 1 of %d: %s\n", job.strategy.c_str(), i + 1, jobs.size(), rounds,
                     shown_path(dir).c_str());
      // A failure names the run it ended, keeping its kind (peftplan-exec's exit code).
      const std::string where = fmt::format("{} (round {} of {})", shown_path(job.plan_path), round, rounds);
      Measurement m;
      try {
        m = run_plan(plan, backend, dir, steps, comm, options);
      } catch (const NonFiniteError& e) {
        throw NonFiniteError(fmt::format("{}: {}", where, e.what()));
      } catch (const InputError& e) {
        throw InputError(fmt::format("{}: {}", where, e.what()));
      } catch (const std::exception&) {
        std::fprintf(stderr, "peftplan-exec: rank %d: failed in %s\n", comm ? comm->rank() : 0, where.c_str());
        throw;
      }
      if (steps) std::fprintf(steps, "wrote %s and %s\n", shown_path(dir / "measurement.json").c_str(), shown_path(dir / "trace.json").c_str());
      line += fmt::format("{}{} {:.3f} ms", line.empty() ? "" : ", ", job.strategy, planner::steady_step_s(m.step_times_s) * 1e3);
    }
    if (progress) {
      std::fprintf(progress, "%sround %d/%d: %s\n", round == 1 ? "\n" : "", round, rounds, line.c_str());
      std::fflush(progress);
    }
  }
}

}  // namespace peftplan::executor
