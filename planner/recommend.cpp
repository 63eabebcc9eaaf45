// The recommender (see recommend.h): families × checkpointing × GPU counts, the largest
// micro-batch that fits found on memory alone, the micro-batches up to it planned in full, then
// ranked, with reasons that name the numbers.
#include "peftplan/planner/recommend.h"

#include <algorithm>
#include <atomic>
#include <charconv>
#include <cmath>
#include <functional>
#include <map>
#include <mutex>
#include <thread>

#include <fmt/format.h>

#include "peftplan/common/error.h"
#include "peftplan/common/json_fields.h"
#include "peftplan/common/schemas.h"
#include "peftplan/common/units.h"
#include "peftplan/planner/launcher_config.h"
#include "peftplan/planner/series.h"

namespace peftplan::planner {

std::string_view name_of(Objective o) {
  switch (o) {
    case Objective::tokens_per_s: return "tokens-per-s";
    case Objective::gpus: return "gpus";
    case Objective::cost: return "cost";
    case Objective::memory: return "memory";
  }
  return "?";
}

std::string name_of(const CheckpointChoice& c) {
  if (c.kind == Checkpointing::every_k) return fmt::format("every-{}", c.every);
  return std::string(planner::name_of(c.kind));
}

std::optional<CheckpointChoice> checkpoint_choice_from_name(std::string_view word) {
  if (word == "none") return CheckpointChoice{Checkpointing::none, 1};
  if (word == "full") return CheckpointChoice{Checkpointing::full, 1};
  if (word.rfind("every-", 0) == 0) {
    std::int64_t k = 0;
    const std::string_view digits = word.substr(6);
    const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), k);
    if (!digits.empty() && ec == std::errc() && end == digits.data() + digits.size() && k > 0) return CheckpointChoice{Checkpointing::every_k, k};
  }
  return std::nullopt;
}

sim::Cluster cluster_for_gpus(const sim::Cluster& cluster, std::int32_t gpus) {
  if (gpus <= 0) throw KnobError({Knob::search_gpus}, fmt::format("space.gpus must list positive GPU counts, got {}", gpus));
  if (gpus <= sim::total_gpus(cluster)) return cluster;
  if (!cluster.inter_node_link)
    throw KnobError({Knob::search_gpus, Knob::gpu},
                    fmt::format("space.gpus must not exceed the cluster's {} GPUs: {} is one node with no network between nodes (spell a "
                                "network, e.g. 8x{}x{}-NDR), got {}", sim::total_gpus(cluster), cluster.name, cluster.gpus_per_node,
                                cluster.gpu.name, gpus));
  sim::Cluster c = cluster;
  c.nodes = (gpus + cluster.gpus_per_node - 1) / cluster.gpus_per_node;
  c.name = fmt::format("{}x{}x{}-{}", c.nodes, c.gpus_per_node, c.gpu.name, c.inter_node_link->name);
  return c;
}

namespace {

using sim::MemCategory;

struct Family {
  RuntimeProfile profile = RuntimeProfile::deepspeed;
  Stage stage = Stage::ddp;
  OffloadDevice offload_optimizer = OffloadDevice::none;
  OffloadDevice offload_param = OffloadDevice::none;
  std::string label;
};

std::vector<Stage> stages_of(RuntimeProfile p) {
  if (p == RuntimeProfile::hf)
    return {Stage::ddp, Stage::fsdp_no_shard, Stage::fsdp_shard_grad_op, Stage::fsdp_full_shard, Stage::fsdp_hybrid_shard};
  return {Stage::ddp, Stage::zero1, Stage::zero2, Stage::zero3};
}

bool profile_plans(RuntimeProfile p, Stage s) {
  if (p == RuntimeProfile::hf) return s == Stage::ddp || is_fsdp(s);
  return !is_fsdp(s);
}

std::string family_label(const Family& f, bool several_profiles) {
  std::string s(name_of(f.stage));
  if (f.offload_optimizer == OffloadDevice::cpu) s += " + offload optimizer";
  if (f.offload_param == OffloadDevice::cpu) s += is_fsdp(f.stage) ? " + offload params" : " + offload param";
  if (several_profiles) s += fmt::format(" ({})", name_of(f.profile));
  return s;
}

// Families of the space. With one rank a sharding strategy without offload plans what DDP plans.
// A family that validate() refuses for the base's settings (8-bit AdamW stepped on the host,
// Liger's fused loss under ZeRO-3) is not planned: it goes to `excluded` with validate's reason,
// and when every family is refused the first refusal is thrown (it is the input's, not a
// family's). A DDP family DeepSpeed cannot run (pure bf16) is planned with the hf profile, the
// Trainer's own DDP that runs it.
std::vector<Family> families_of(const SearchSpace& space, const PlanInput& base, std::int32_t max_ranks, bool multi_node,
                                std::vector<Rejection>& excluded) {
  const TrainingSpec& training = base.training;
  std::exception_ptr first_refusal;
  std::vector<Family> out;
  const bool several = space.profiles.size() > 1;
  const bool searches_hf = std::find(space.profiles.begin(), space.profiles.end(), RuntimeProfile::hf) != space.profiles.end();
  for (RuntimeProfile listed : space.profiles) {
    for (Stage s : space.stages.empty() ? stages_of(listed) : space.stages) {
      if (!profile_plans(listed, s)) continue;
      Strategy stage_only;
      stage_only.stage = s;
      const RuntimeProfile p = profile_that_runs(listed, stage_only, training);
      if (p != listed && searches_hf) continue;  // the hf profile's own family plans it
      if (s == Stage::fsdp_hybrid_shard && !multi_node) continue;  // one node: FULL_SHARD
      std::vector<std::pair<OffloadDevice, OffloadDevice>> offloads = {{OffloadDevice::none, OffloadDevice::none}};
      if (space.offload) {
        if (can_offload_optimizer(s)) offloads.push_back({OffloadDevice::cpu, OffloadDevice::none});
        // DeepSpeed's parameter offload rides with optimizer offload (ZeRO-Infinity's usual
        // pairing); FSDP's CPUOffload moves parameters, gradients and the step together.
        if (can_offload_params(s)) offloads.push_back({is_fsdp(s) ? OffloadDevice::none : OffloadDevice::cpu, OffloadDevice::cpu});
      }
      for (auto [o, q] : offloads) {
        if (max_ranks <= 1 && s != Stage::ddp && o == OffloadDevice::none && q == OffloadDevice::none) continue;
        Family f{p, s, o, q, ""};
        f.label = family_label(f, several || p != listed);
        PlanInput probe_in = base;
        probe_in.profile = p;
        probe_in.strategy.stage = s;
        probe_in.strategy.offload_optimizer = o;
        probe_in.strategy.offload_param = q;
        try {
          (void)validate(probe_in);
        } catch (const KnobError& e) {
          if (!first_refusal) first_refusal = std::current_exception();
          excluded.push_back({f.label, false, fmt::format("not planned: {}", e.what()), {}, std::nullopt});
          continue;
        }
        out.push_back(std::move(f));
      }
    }
  }
  if (out.empty() && first_refusal) std::rethrow_exception(first_refusal);
  return out;
}

std::uint64_t at_peak(const Candidate& c, MemCategory m) { return c.at_peak_bytes[static_cast<std::size_t>(m)]; }

// The two largest device categories at the peak: "base_weights 64.2 GiB, activations 9.1 GiB".
std::string top_categories(const Candidate& c) { return largest_categories(c.at_peak_bytes); }

// GiB to one decimal; below 0.05 GiB, where that would print "0.0 GiB" (a small model's base, a
// few MiB of all-gathers), in the unit that shows the size (human_bytes: "3.1 MiB").
std::string gib(double bytes) {
  if (bytes >= 0.0 && bytes < 0.05 * kGiB) return human_bytes(static_cast<std::uint64_t>(bytes));
  return fmt::format("{:.1f} GiB", bytes / kGiB);
}
std::string gib(std::uint64_t bytes) { return gib(static_cast<double>(bytes)); }
std::string gib_signed(std::int64_t bytes) { return gib(static_cast<double>(bytes < 0 ? -bytes : bytes)); }

std::string where(const Candidate& c) {
  const auto& t = c.input.training;
  CheckpointChoice ck{t.checkpointing, t.checkpoint_every};
  return fmt::format("micro-batch {} × accum {}, checkpointing {}, {} GPU{}", t.micro_batch, t.grad_accum, name_of(ck),
                     c.input.strategy.ranks, c.input.strategy.ranks == 1 ? "" : "s");
}

// Cost per million tokens: GPU-hours per token × the price per GPU-hour.
void price(Candidate& c, const sim::Cluster& cl) {
  c.cost_per_mtok_usd.reset();
  if (cl.gpu.cost_per_hour_usd && c.tokens_per_s > 0)
    c.cost_per_mtok_usd = *cl.gpu.cost_per_hour_usd * c.input.strategy.ranks / 3600.0 / c.tokens_per_s * 1e6;
}

// The plan options a search's candidates are made with.
PlanOptions search_plan_options(bool timed, double headroom_fraction, bool yes_no) {
  PlanOptions o;
  o.simulate_time = timed;
  o.headroom_fraction = headroom_fraction;
  o.explain = false;
  o.names = false;
  o.skip_replay_when_allocated_overflows = yes_no;
  return o;
}

// A Candidate from its plan, priced.
Candidate candidate_of(const Plan& p, const PlanInput& in, const sim::Cluster& cl) {
  Candidate c;
  c.input = in;
  c.fits = p.fits;
  c.allocated_peak_bytes = p.memory.device_peak_bytes;
  c.reserved_peak_bytes = p.reserved_peak_bytes;
  c.used_peak_bytes = p.used_peak_bytes;
  c.spare_bytes = spare_bytes(p);
  c.host_peak_bytes = p.memory.host_peak_bytes;
  c.host_capacity_bytes = p.host_capacity_bytes;
  c.at_peak_bytes = p.memory.at_peak_bytes;
  c.model_base_bytes = p.facts.base_bytes;
  c.base_dtype = p.facts.base_dtype;
  std::uint64_t best = 0;
  for (int i = 0; i < sim::kNumDeviceCategories; ++i)
    if (p.memory.at_peak_bytes[static_cast<std::size_t>(i)] > best) {
      best = p.memory.at_peak_bytes[static_cast<std::size_t>(i)];
      c.binding = static_cast<MemCategory>(i);
    }
  if (p.time) {
    const auto& t = *p.time;
    c.step_s = t.step_s;
    c.compute_s = t.compute_s;
    c.exposed_comm_s = t.exposed_comm_s;
    c.offload_s = t.offload_s;
    c.optimizer_s = t.optimizer_s;
    c.host_floor_s = t.host_floor_s;
    c.device_step_s = t.device_step_s;
    c.host_bound = t.host_bound;
    c.tokens_per_s = t.tokens_per_s;
    c.mfu = t.mfu;
    c.gathered_bytes = t.collective_bytes[static_cast<std::size_t>(sim::Collective::all_gather)];
    for (auto b : t.collective_bytes) c.comm_bytes += b;
    c.inter_node_bytes = t.inter_node_bytes;
  }
  price(c, cl);
  return c;
}

// The memory figures a candidate holds, which do not depend on the accumulation.
bool same_memory(const Candidate& a, const Candidate& b) {
  return a.fits == b.fits && a.allocated_peak_bytes == b.allocated_peak_bytes && a.reserved_peak_bytes == b.reserved_peak_bytes &&
         a.used_peak_bytes == b.used_peak_bytes && a.spare_bytes == b.spare_bytes && a.host_peak_bytes == b.host_peak_bytes &&
         a.host_capacity_bytes == b.host_capacity_bytes && a.at_peak_bytes == b.at_peak_bytes && a.binding == b.binding &&
         a.model_base_bytes == b.model_base_bytes && a.base_dtype == b.base_dtype;
}

// x at `n`, from its values at three consecutive points k, k+1, k+2 (nullopt: not one line).
std::optional<double> on_line(double x0, double x1, double x2, std::int64_t k, std::int64_t n) {
  const double d1 = x1 - x0, d2 = x2 - x1;
  const double scale = std::max({std::abs(x0), std::abs(x1), std::abs(x2)});
  if (std::abs(d2 - d1) > 1e-9 * scale) return std::nullopt;
  return x2 + d2 * static_cast<double>(n - (k + 2));
}
std::optional<std::uint64_t> on_line(std::uint64_t x0, std::uint64_t x1, std::uint64_t x2, std::int64_t k, std::int64_t n) {
  const auto i0 = static_cast<std::int64_t>(x0), i1 = static_cast<std::int64_t>(x1), i2 = static_cast<std::int64_t>(x2);
  if (i2 - i1 != i1 - i0) return std::nullopt;
  const std::int64_t v = i2 + (i2 - i1) * (n - (k + 2));
  if (v < 0) return std::nullopt;
  return static_cast<std::uint64_t>(v);
}

// The candidate at accumulation n from its plans at k, k+1, k+2 (plan_candidate's series), priced.
// Ratios to the step (tokens/s, MFU) are carried as their products with it, which are linear.
std::optional<Candidate> extend_accumulation(const std::array<Candidate, 3>& at, std::int64_t k, std::int64_t n, const sim::Cluster& cl) {
  for (int i = 1; i < 3; ++i)
    if (!same_memory(at[0], at[static_cast<std::size_t>(i)])) return std::nullopt;
  Candidate c = at[2];
  c.input.training.grad_accum = n;
  bool ok = true;
  auto line = [&](auto get) {
    auto v = on_line(get(at[0]), get(at[1]), get(at[2]), k, n);
    if (!v) ok = false;
    return v.value_or(decltype(get(at[0])){});
  };
  // The device's step and the host's floor are each a line; the step is the larger (the
  // timeline's rule, sim/timeline.cpp), which a long accumulation can move from one to the other.
  c.device_step_s = line([](const Candidate& x) { return x.device_step_s; });
  c.host_floor_s = line([](const Candidate& x) { return x.host_floor_s; });
  c.host_bound = c.host_floor_s > c.device_step_s;
  c.step_s = c.host_bound ? c.host_floor_s : c.device_step_s;
  c.compute_s = line([](const Candidate& x) { return x.compute_s; });
  c.exposed_comm_s = line([](const Candidate& x) { return x.exposed_comm_s; });
  c.offload_s = line([](const Candidate& x) { return x.offload_s; });
  c.optimizer_s = line([](const Candidate& x) { return x.optimizer_s; });
  const double tokens = line([](const Candidate& x) { return x.tokens_per_s * x.step_s; });
  const double flops_share = line([](const Candidate& x) { return x.mfu * x.step_s; });
  c.gathered_bytes = line([](const Candidate& x) { return x.gathered_bytes; });
  c.comm_bytes = line([](const Candidate& x) { return x.comm_bytes; });
  c.inter_node_bytes = line([](const Candidate& x) { return x.inter_node_bytes; });
  if (!ok || !(c.step_s > 0)) return std::nullopt;
  c.tokens_per_s = tokens / c.step_s;
  c.mfu = flops_share / c.step_s;
  price(c, cl);
  return c;
}

}  // namespace

Candidate plan_candidate(const PlanInput& in, const sim::Cluster& cl, const CandidateOptions& o, std::int64_t* plans) {
  const PlanOptions po = search_plan_options(o.timed, o.headroom_fraction, o.skip_replay_when_allocated_overflows);
  auto one = [&](std::int64_t accum) {
    PlanInput x = in;
    x.training.grad_accum = accum;
    if (plans) ++*plans;
    return candidate_of(make_plan(x, cl, po), x, cl);
  };
  const std::int64_t n = in.training.grad_accum;
  if (o.accumulation_series) {
    constexpr std::int64_t k = 3;  // the series' first point: two micro-steps after the first
    if (o.timed && n >= kAccumulationSeriesFrom) {
      if (auto c = extend_accumulation({one(k), one(k + 1), one(k + 2)}, k, n, cl)) return *c;
    } else if (!o.timed && n >= kAccumulationMemorySeriesFrom) {
      Candidate a = one(k), b = one(k + 1);
      if (same_memory(a, b)) {
        b.input.training.grad_accum = n;
        return b;
      }
    }
  }
  return one(n);
}

namespace {

class Search {
 public:
  Search(const PlanInput& base, const sim::Cluster& cluster, const SearchSpace& space, const Constraints& constraints)
      : base_(base), cluster_(cluster), space_(space), constraints_(constraints) {
    if (constraints.host_ram_bytes_per_node) cluster_.host_ram_bytes_per_node = *constraints.host_ram_bytes_per_node;
  }

  // One plan, as make_plan makes it; `timed` adds the simulated timeline. With a series, its
  // program at the input's micro-batch instead of a build (the same program: series.h); without
  // one, plan_candidate (a long accumulation from a few short ones). A probe that only asks
  // whether the micro-batch fits (`yes_no`) skips the allocator replay when the allocated peak
  // alone overflows.
  Candidate evaluate(const PlanInput& in, const sim::Cluster& cl, const std::string& family, bool timed, MicroBatchSeries* series = nullptr,
                     bool yes_no = false) {
    Candidate c;
    if (series) {
      Plan p = make_plan_with(in, series->take(in.training.micro_batch), cl,
                              search_plan_options(timed, constraints_.headroom_fraction, yes_no));
      series->give_back(std::move(p.program));
      ++evaluated_;
      c = candidate_of(p, in, cl);
    } else {
      CandidateOptions o;
      o.timed = timed;
      o.headroom_fraction = constraints_.headroom_fraction;
      o.skip_replay_when_allocated_overflows = yes_no;
      o.accumulation_series = space_.accumulation_series;
      std::int64_t plans = 0;
      c = plan_candidate(in, cl, o, &plans);
      evaluated_ += plans;
    }
    if (timed) ++timed_;
    c.family = family;
    return c;
  }

  struct Cell {  // one family × checkpointing × GPU count
    std::size_t family = 0;
    CheckpointChoice ckpt;
    std::int32_t gpus = 1;
    std::vector<Candidate> timed;          // fitting, planned in full
    std::optional<Candidate> closest;      // the smallest micro-batch's plan when it does not fit
    std::string skipped;                   // why the cell was not planned (global batch)
    std::int64_t largest_fit = 0;          // the largest micro-batch that fits (0: none)
  };

  PlanInput input_for(const Family& f, const CheckpointChoice& ck, std::int32_t gpus, std::int64_t mb, std::int64_t accum) const {
    PlanInput in = base_;
    in.profile = f.profile;
    in.strategy.stage = f.stage;
    in.strategy.offload_optimizer = f.offload_optimizer;
    in.strategy.offload_param = f.offload_param;
    in.strategy.ranks = gpus;
    in.strategy.shard_group = f.stage == Stage::fsdp_hybrid_shard ? std::min(cluster_.gpus_per_node, gpus) : 0;
    if (!is_fsdp(f.stage)) in.strategy.fsdp = FsdpKnobs{};
    in.training.checkpointing = ck.kind;
    in.training.checkpoint_every = ck.kind == Checkpointing::every_k ? ck.every : 1;
    in.training.micro_batch = mb;
    in.training.grad_accum = accum;
    in.training.eval_batch = 0;  // the evaluation peak is not what the search ranks; re-planned in full
    return in;
  }

  void run_cell(const std::vector<Family>& families, Cell& cell) {
    const Family& f = families[cell.family];
    const sim::Cluster cl = cluster_for_gpus(cluster_, cell.gpus);
    auto accum_for = [&](std::int64_t mb) -> std::optional<std::int64_t> {
      if (!space_.global_batch) return base_.training.grad_accum;
      const std::int64_t per_step = mb * cell.gpus;
      if (*space_.global_batch % per_step != 0) return std::nullopt;
      return *space_.global_batch / per_step;
    };
    std::int64_t cap = space_.max_micro_batch;
    if (space_.global_batch) cap = std::min<std::int64_t>(cap, *space_.global_batch / cell.gpus);
    const std::int64_t lo0 = space_.min_micro_batch;
    if (cap < lo0) {
      cell.skipped = fmt::format("global batch {} over {} GPUs leaves less than micro-batch {}", *space_.global_batch, cell.gpus, lo0);
      return;
    }
    // Without a global batch the accumulation is fixed, so once the smallest micro-batch fits,
    // one series gives the cell's program at every micro-batch (series.h; nullopt: each is built
    // in full) and bounds the search from above.
    std::optional<MicroBatchSeries> series;
    MicroBatchSeries* s = nullptr;
    // Memory only: the accumulation of a micro-batch that does not divide the global batch is
    // the user's, which changes no category the step's peak holds.
    auto fits = [&](std::int64_t mb, std::optional<Candidate>* keep) {
      Candidate c = evaluate(input_for(f, cell.ckpt, cell.gpus, mb, accum_for(mb).value_or(1)), cl, f.label, false, s, keep == nullptr);
      const bool ok = c.fits;
      if (keep) *keep = std::move(c);
      return ok;
    };
    std::optional<Candidate> first;
    if (!fits(lo0, &first)) {
      cell.closest = std::move(first);
      return;
    }
    if (!space_.global_batch) {
      series = MicroBatchSeries::make(input_on(input_for(f, cell.ckpt, cell.gpus, 1, base_.training.grad_accum), cl));
      s = series ? &*series : nullptr;
    }
    std::int64_t lo = lo0, hi = 0;  // lo fits; hi does not (0: not found yet)
    if (s) {
      // The series bounds the search from above: above `top` the allocated peak alone (with what
      // lives outside the allocator and the headroom, which the first plan's spare memory already
      // took off) is more than the GPU holds, so those micro-batches do not fit whatever the
      // allocator reserves. Usually `top` itself fits and the search ends there.
      const std::uint64_t device_budget = static_cast<std::uint64_t>(first->spare_bytes) + first->reserved_peak_bytes;
      const std::int64_t top = std::min(cap, s->largest_within(device_budget, first->host_capacity_bytes));
      if (top > lo) {
        if (fits(top, nullptr)) lo = top;
        else hi = top;
      }
      if (hi == 0 && top < cap) hi = top + 1;
    }
    while (hi == 0) {
      const std::int64_t next = std::min(cap, lo * 2);
      if (next == lo) break;
      if (fits(next, nullptr)) lo = next;
      else hi = next;
    }
    while (hi != 0 && hi - lo > 1) {
      const std::int64_t mid = lo + (hi - lo) / 2;
      if (fits(mid, nullptr)) lo = mid;
      else hi = mid;
    }
    cell.largest_fit = lo;
    std::vector<std::int64_t> mbs;
    for (std::int64_t mb = lo0; mb <= lo; mb *= 2) mbs.push_back(mb);
    if (mbs.back() != lo) mbs.push_back(lo);
    for (std::int64_t mb : mbs) {
      const auto accum = accum_for(mb);
      if (!accum) continue;
      Candidate c = evaluate(input_for(f, cell.ckpt, cell.gpus, mb, *accum), cl, f.label, true, s);
      if (c.fits) cell.timed.push_back(std::move(c));
    }
    if (cell.timed.empty() && space_.global_batch)
      cell.skipped = fmt::format("no micro-batch from {} to {} divides the global batch {} over {} GPUs", lo0, lo, *space_.global_batch, cell.gpus);
  }

  std::vector<Cell> run_all(const std::vector<Family>& families, const std::vector<CheckpointChoice>& ckpts, const std::vector<std::int32_t>& gpus) {
    std::vector<Cell> cells;
    for (std::size_t f = 0; f < families.size(); ++f)
      for (const auto& ck : ckpts)
        for (std::int32_t g : gpus) {
          // With one GPU, DeepSpeed's ZeRO stages differ from DDP only by offload.
          Cell c;
          c.family = f;
          c.ckpt = ck;
          c.gpus = g;
          if (g == 1 && families[f].stage != Stage::ddp && families[f].offload_optimizer == OffloadDevice::none &&
              families[f].offload_param == OffloadDevice::none)
            continue;
          cells.push_back(std::move(c));
        }
    // Cells are independent: spread them over the cores (make_plan is a pure function).
    std::atomic<std::size_t> next{0};
    std::exception_ptr error;
    std::mutex error_mu;
    auto worker = [&] {
      for (std::size_t i; (i = next.fetch_add(1)) < cells.size();) {
        try {
          run_cell(families, cells[i]);
        } catch (...) {
          std::lock_guard<std::mutex> lock(error_mu);
          if (!error) error = std::current_exception();
        }
      }
    };
    const unsigned cores = space_.threads > 0 ? space_.threads : std::thread::hardware_concurrency();
    const unsigned n = std::max(1u, std::min<unsigned>(cores, static_cast<unsigned>(cells.size())));
    std::vector<std::thread> threads;
    for (unsigned t = 1; t < n; ++t) threads.emplace_back(worker);
    worker();
    for (auto& t : threads) t.join();
    if (error) std::rethrow_exception(error);
    return cells;
  }

  std::int64_t evaluated() const { return evaluated_.load(); }
  std::int64_t timed() const { return timed_.load(); }
  const sim::Cluster& cluster() const { return cluster_; }

 private:
  const PlanInput& base_;
  sim::Cluster cluster_;
  const SearchSpace& space_;
  const Constraints& constraints_;
  std::atomic<std::int64_t> evaluated_{0}, timed_{0};
};

// How much a family shards and moves: DDP 0, ZeRO-1 4, ZeRO-2 / SHARD_GRAD_OP 8, ZeRO-3 /
// FULL_SHARD 12, plus one per offload.
int complexity(const Candidate& c) {
  const auto& s = c.input.strategy;
  // FSDP's NO_SHARD is DDP's placement behind FSDP's hooks: one more moving part than DDP.
  return 4 * sharding_level(s.stage) + (s.stage == Stage::fsdp_no_shard) + (s.offload_optimizer == OffloadDevice::cpu) +
         (s.offload_param == OffloadDevice::cpu);
}

// The objective's value, larger is better.
double objective_value(const Candidate& c, Objective o) {
  switch (o) {
    case Objective::tokens_per_s: return c.tokens_per_s;
    case Objective::gpus: return -static_cast<double>(c.input.strategy.ranks);
    case Objective::cost: return c.cost_per_mtok_usd ? -*c.cost_per_mtok_usd : -INFINITY;
    case Objective::memory: return -static_cast<double>(c.used_peak_bytes);
  }
  return 0;
}

// a before b under the objective alone (ties: tokens/s, fewer GPUs, less memory in use).
bool better(const Candidate& a, const Candidate& b, Objective o) {
  const double va = objective_value(a, o), vb = objective_value(b, o);
  if (va != vb) return va > vb;
  if (a.tokens_per_s != b.tokens_per_s) return a.tokens_per_s > b.tokens_per_s;
  if (a.input.strategy.ranks != b.input.strategy.ranks) return a.input.strategy.ranks < b.input.strategy.ranks;
  return a.used_peak_bytes < b.used_peak_bytes;
}

// Rows within this share of the fastest row's tokens/s count as equally fast: the time model's
// own resolution is coarser (README, "Published measurements"), so among them the simpler
// strategy (less sharded, nothing offloaded: fewer moving parts for the same speed) ranks first.
constexpr double kSpeedTie = 0.01;

// The ranking: by the objective; with tokens/s, the rows within kSpeedTie of the fastest first,
// simplest first, then the rest by tokens/s.
void rank(std::vector<Candidate>& rows, Objective o) {
  std::stable_sort(rows.begin(), rows.end(), [&](const Candidate& a, const Candidate& b) { return better(a, b, o); });
  if (o != Objective::tokens_per_s || rows.empty()) return;
  const double fastest = rows.front().tokens_per_s;
  const auto tied_end = std::find_if(rows.begin(), rows.end(), [&](const Candidate& c) { return c.tokens_per_s < fastest * (1 - kSpeedTie); });
  std::stable_sort(rows.begin(), tied_end, [](const Candidate& a, const Candidate& b) {
    if (complexity(a) != complexity(b)) return complexity(a) < complexity(b);
    return a.tokens_per_s > b.tokens_per_s;
  });
}

// Within kSpeedTie of #1's cost per million tokens (the same tokens/s per GPU, as the time model
// resolves it).
bool cost_tied(const Candidate& c, const Candidate& top) {
  return c.cost_per_mtok_usd && top.cost_per_mtok_usd && *c.cost_per_mtok_usd <= *top.cost_per_mtok_usd * (1 + kSpeedTie);
}

bool tied(const Candidate& c, const Candidate& top, double fastest) { return c.tokens_per_s >= fastest * (1 - kSpeedTie) && top.tokens_per_s >= fastest * (1 - kSpeedTie); }

// Per-token time of a row split into the terms a reason names: seconds per token over the
// cluster, or with `gpu_seconds` GPU-seconds per token (what a price per GPU-hour pays for).
struct Terms {
  double compute = 0, exposed = 0, rest = 0;  // rest: offload copies, CPU optimizer, host floor
};
Terms per_token(const Candidate& c, bool gpu_seconds = false) {
  const double tokens = c.tokens_per_s * c.step_s;  // tokens per step over the cluster
  if (tokens <= 0) return {};
  const double rest = std::max(0.0, c.step_s - c.compute_s - c.exposed_comm_s);
  const double g = gpu_seconds ? static_cast<double>(c.input.strategy.ranks) : 1.0;
  return {g * c.compute_s / tokens, g * c.exposed_comm_s / tokens, g * rest / tokens};
}

std::string rest_name(const Candidate& c) {
  if (c.host_bound) return "FSDP's per-unit hooks on the host (the step waits for them)";
  if (c.input.strategy.offload_optimizer == OffloadDevice::cpu || c.input.strategy.offload_param == OffloadDevice::cpu)
    return "offload copies and the optimizer step on the CPU";
  return "the optimizer step";
}

// Why `c` is slower than `top` per token (with `gpu_seconds`, per token per GPU: rows on
// different GPU counts compared as a price per GPU-hour compares them): the term that grew most,
// in seconds of c's step.
std::string slower_because(const Candidate& c, const Candidate& top, bool gpu_seconds = false) {
  const Terms a = per_token(c, gpu_seconds), b = per_token(top, gpu_seconds);
  const double dc = a.compute - b.compute, de = a.exposed - b.exposed, dr = a.rest - b.rest;
  const double step_tokens = c.tokens_per_s * c.step_s / (gpu_seconds ? static_cast<double>(c.input.strategy.ranks) : 1.0);
  const auto& ct = c.input.training;
  const auto& tt = top.input.training;
  auto per_step = [&](double per_tok) { return per_tok * step_tokens; };
  if (de >= dc && de >= dr)
    return fmt::format("exposed communication, {:.3f} s per step where #1 spends {:.3f} s on as many tokens{} (it all-gathers {} per step per rank)",
                       c.exposed_comm_s, per_step(b.exposed), gpu_seconds ? " per GPU" : "", gib(c.gathered_bytes));
  if (dr >= dc) return fmt::format("{} (+{:.3f} s per step)", rest_name(c), per_step(dr));
  const bool more_recompute = ct.checkpointing != Checkpointing::none &&
                              (tt.checkpointing == Checkpointing::none ||
                               (ct.checkpointing == Checkpointing::full && tt.checkpointing == Checkpointing::every_k) ||
                               (ct.checkpointing == Checkpointing::every_k && tt.checkpointing == Checkpointing::every_k &&
                                ct.checkpoint_every < tt.checkpoint_every));
  if (more_recompute) return fmt::format("recompute: checkpointing {} runs the forward again in backward (+{:.3f} s per step)",
                                         name_of(CheckpointChoice{ct.checkpointing, ct.checkpoint_every}), per_step(dc));
  if (ct.micro_batch < tt.micro_batch)
    return fmt::format("a smaller micro-batch ({} against {}) keeps the GPU less busy per token (+{:.3f} s of compute per step)", ct.micro_batch,
                       tt.micro_batch, per_step(dc));
  return fmt::format("compute (+{:.3f} s per step)", per_step(dc));
}

std::string step_split(const Candidate& c) {
  std::string s = fmt::format("step {:.3f} s = compute {:.3f} s + exposed communication {:.3f} s", c.step_s, c.compute_s, c.exposed_comm_s);
  const double rest = c.step_s - c.compute_s - c.exposed_comm_s;
  if (rest > 0.0005 * c.step_s) s += fmt::format(" + {} {:.3f} s", rest_name(c), rest);
  return s;
}

// Why `c` ranks below `top` (which it does not beat), in the objective's own terms; when the two
// tie on the objective, by the tie-breaks of better(): tokens/s, then memory in use.
std::string behind_top(const Candidate& c, const Candidate& top, Objective o) {
  const auto& cs = c.input.strategy;
  const auto& ts = top.input.strategy;
  switch (o) {
    case Objective::tokens_per_s: break;
    case Objective::cost:
      if (c.cost_per_mtok_usd && top.cost_per_mtok_usd && *c.cost_per_mtok_usd != *top.cost_per_mtok_usd) {
        const double more = *c.cost_per_mtok_usd / *top.cost_per_mtok_usd - 1;
        if (cost_tied(c, top))
          return fmt::format("as cheap as #1 per million tokens (${:.3f}, {:+.2f}%, within the 1% the time model resolves) on {} GPU{}", *c.cost_per_mtok_usd,
                             100 * more, cs.ranks, cs.ranks == 1 ? "" : "s");
        const double per_gpu = c.tokens_per_s / cs.ranks, top_per_gpu = top.tokens_per_s / ts.ranks;
        return fmt::format("${:.3f} per million tokens, {:.1f}% more than #1's ${:.3f}: {:.0f} tokens/s per GPU against #1's {:.0f}{}",
                           *c.cost_per_mtok_usd, 100 * more, *top.cost_per_mtok_usd, per_gpu,
                           top_per_gpu, per_gpu < top_per_gpu ? ", " + slower_because(c, top, true) : std::string());
      }
      break;
    case Objective::gpus:
      if (cs.ranks != ts.ranks) return fmt::format("needs {} GPUs where #1 needs {}", cs.ranks, ts.ranks);
      break;
    case Objective::memory:
      if (c.used_peak_bytes != top.used_peak_bytes)
        return fmt::format("{} in use per GPU, {} more than #1 (at the peak: {})", gib(c.used_peak_bytes), gib(c.used_peak_bytes - top.used_peak_bytes),
                           top_categories(c));
      break;
  }
  const std::string tie = o == Objective::tokens_per_s ? "" : fmt::format("as good as #1 on {}, then ", name_of(o));
  if (c.tokens_per_s < top.tokens_per_s)
    return fmt::format("{}{:.1f}% fewer tokens/s than #1: {}", tie, 100 * (1 - c.tokens_per_s / top.tokens_per_s), slower_because(c, top));
  return fmt::format("{}as fast as #1 and {} in use per GPU against #1's {}", tie, gib(c.used_peak_bytes), gib(top.used_peak_bytes));
}

bool lighter_stage(Stage a, Stage b) { return sharding_level(a) < sharding_level(b); }  // a keeps more on each GPU

// The same input with QLoRA's base: bitsandbytes nf4 with double quantisation (what the
// alternatives offer).
PlanInput with_nf4_base(const PlanInput& in) {
  PlanInput q = in;
  models::Quantization qz;
  qz.dtype = DType::nf4;
  qz.double_quant = true;
  q.peft.quantization = qz;
  q.inventory.reset();
  return q;
}

std::string shortfall_text(const Candidate& c, double headroom) {
  return fmt::format("needs {} in use plus {:.0f}% headroom, short by {} even at {} (at the peak: {})", gib(c.used_peak_bytes),
                     100 * headroom, gib_signed(c.spare_bytes), where(c), top_categories(c));
}

}  // namespace

Recommendation recommend(const PlanInput& base_in, const sim::Cluster& cluster, const SearchSpace& space_in, const Constraints& constraints,
                         Objective objective) {
  SearchSpace space = space_in;
  if (space.profiles.empty()) space.profiles = {base_in.profile};
  if (space.checkpointing.empty())
    space.checkpointing = {{Checkpointing::none, 1}, {Checkpointing::every_k, 4}, {Checkpointing::every_k, 2}, {Checkpointing::full, 1}};
  if (space.gpus.empty()) space.gpus = {base_in.strategy.ranks};
  if (constraints.max_gpus) {
    std::erase_if(space.gpus, [&](std::int32_t g) { return g > *constraints.max_gpus; });
    if (space.gpus.empty())
      throw KnobError({Knob::max_gpus, Knob::search_gpus},
                      fmt::format("constraints.max_gpus {} leaves no GPU count of space.gpus to search (it is below all of them)", *constraints.max_gpus));
  }
  if (space.min_micro_batch <= 0)
    throw KnobError({Knob::min_micro_batch}, fmt::format("space.min_micro_batch must be a positive integer, got {}", space.min_micro_batch));
  if (space.global_batch) {
    if (*space.global_batch <= 0)
      throw KnobError({Knob::global_batch}, fmt::format("space.global_batch must be a positive integer, got {}", *space.global_batch));
    const std::int32_t fewest = *std::min_element(space.gpus.begin(), space.gpus.end());
    if (*space.global_batch < space.min_micro_batch * fewest)
      throw KnobError({Knob::global_batch, Knob::min_micro_batch},
                      fmt::format("space.global_batch {} with space.min_micro_batch {}: even {} GPU(s) need at least {} sequences per step",
                                  *space.global_batch, space.min_micro_batch, fewest, space.min_micro_batch * fewest));
  }
  if (objective == Objective::cost && !cluster.gpu.cost_per_hour_usd)
    throw KnobError({Knob::objective},
                    fmt::format("objective cost: the catalog has no price per GPU-hour for {}; give gpu.cost_per_hour_USD in a cluster file",
                                cluster.gpu.name));
  PlanInput base = base_in;
  if (!base.inventory) base.inventory = std::make_shared<const ModelInventory>(make_inventory(base.model, base.peft));
  if (base.device_sm == 0) base.device_sm = cluster.gpu.compute_capability;
  std::int32_t max_ranks = 0;
  bool multi_node = false;
  for (std::int32_t g : space.gpus) {
    max_ranks = std::max(max_ranks, g);
    multi_node |= cluster_for_gpus(cluster, g).nodes > 1 && g > cluster.gpus_per_node;
  }
  std::vector<Rejection> excluded;
  const std::vector<Family> families = families_of(space, base, max_ranks, multi_node, excluded);
  if (families.empty())
    throw KnobError({Knob::search_stages, Knob::profile}, "recommend: the search space is empty (no strategy of space.stages is planned by profile)");

  Search search(base, cluster, space, constraints);
  std::vector<Search::Cell> cells = search.run_all(families, space.checkpointing, space.gpus);

  Recommendation r;
  r.objective = objective;
  r.model = base_in.model.name;
  r.cluster = cluster.name;
  r.capacity_bytes = cluster.gpu.memory_bytes;
  r.headroom_fraction = constraints.headroom_fraction;
  for (auto& cell : cells)
    for (auto& c : cell.timed) r.ranked.push_back(c);
  rank(r.ranked, objective);
  r.fitting = static_cast<std::int64_t>(r.ranked.size());
  // The Pareto front of memory in use against tokens/s.
  {
    std::vector<std::size_t> idx(r.ranked.size());
    for (std::size_t i = 0; i < idx.size(); ++i) idx[i] = i;
    std::sort(idx.begin(), idx.end(), [&](std::size_t a, std::size_t b) {
      if (r.ranked[a].used_peak_bytes != r.ranked[b].used_peak_bytes) return r.ranked[a].used_peak_bytes < r.ranked[b].used_peak_bytes;
      return r.ranked[a].tokens_per_s > r.ranked[b].tokens_per_s;
    });
    double best = -1;
    for (std::size_t i : idx)
      if (r.ranked[i].tokens_per_s > best) {
        r.ranked[i].pareto = true;
        best = r.ranked[i].tokens_per_s;
      }
  }

  // Per family: its best fitting row, or its row closest to fitting.
  struct FamilyResult {
    const Candidate* best = nullptr;
    const Candidate* closest = nullptr;
    std::vector<std::string> skipped;
  };
  std::vector<FamilyResult> by_family(families.size());
  for (const auto& c : r.ranked)
    for (std::size_t f = 0; f < families.size(); ++f)
      if (families[f].label == c.family && !by_family[f].best) by_family[f].best = &c;
  for (const auto& cell : cells) {
    auto& fr = by_family[cell.family];
    if (cell.closest && (!fr.closest || cell.closest->spare_bytes > fr.closest->spare_bytes)) fr.closest = &*cell.closest;
    if (!cell.skipped.empty()) fr.skipped.push_back(cell.skipped);
  }
  const double headroom = constraints.headroom_fraction;
  const bool peft = !base.peft.adapters.empty();

  if (r.ranked.empty()) {
    const Candidate* closest = nullptr;
    for (const auto& fr : by_family)
      if (fr.closest && (!closest || fr.closest->spare_bytes > closest->spare_bytes)) closest = fr.closest;
    for (std::size_t f = 0; f < families.size(); ++f) {
      Rejection rj{families[f].label, false, "", {}, std::nullopt};
      if (by_family[f].closest) {
        rj.best = *by_family[f].closest;
        rj.reason = "does not fit: " + shortfall_text(*by_family[f].closest, headroom);
        rj.suggestions = fit_suggestions(by_family[f].closest->binding, by_family[f].closest->input);
      } else {
        rj.reason = by_family[f].skipped.empty() ? "not planned" : by_family[f].skipped.front();
      }
      r.rejected.push_back(std::move(rj));
    }
    r.rejected.insert(r.rejected.end(), excluded.begin(), excluded.end());
    if (closest) {
      if (closest->input.strategy.ranks == max_ranks) r.suggestions.push_back({Knob::search_gpus, Change::larger, "", ""});
      if (peft && !base.peft.quantization) r.suggestions.push_back({Knob::quantization, Change::set, "nf4", "a quantised base, QLoRA"});
      if (!space.offload) {
        r.suggestions.push_back({Knob::search_offload, Change::set, "", ""});
      }
      r.suggestions.push_back({Knob::seq_len, Change::smaller, "", ""});
      r.summary = fmt::format("nothing fits: the closest is {} at {}, {} in use, short by {}", closest->family, where(*closest),
                              gib(closest->used_peak_bytes), gib_signed(closest->spare_bytes));
      // The alternative a user asks for first when nothing fits: QLoRA on the closest family.
      if (peft && !base.peft.quantization) {
        const PlanInput q = with_nf4_base(base);
        SearchSpace qs = space;
        qs.profiles = {closest->input.profile};
        qs.stages = {closest->input.strategy.stage};
        Recommendation qr = recommend(q, cluster, qs, constraints, objective);
        if (!qr.ranked.empty())
          r.alternatives.push_back({fmt::format("a quantised base (nf4, QLoRA) fits: {} at {}, {} in use, {:.0f} tokens/s", qr.ranked[0].family,
                                                where(qr.ranked[0]), gib(qr.ranked[0].used_peak_bytes), qr.ranked[0].tokens_per_s),
                                    qr.ranked[0]});
      }
    } else {
      r.summary = "nothing was planned: " + (by_family.front().skipped.empty() ? std::string("empty space") : by_family.front().skipped.front());
    }
    r.evaluated = search.evaluated();
    r.timed = search.timed();
    return r;
  }

  Candidate& top = r.ranked.front();
  double fastest = 0;
  for (const auto& c : r.ranked) fastest = std::max(fastest, c.tokens_per_s);
  std::size_t top_family = 0;
  for (std::size_t f = 0; f < families.size(); ++f)
    if (families[f].label == top.family) top_family = f;

  // --- the top row's reason ---
  {
    std::vector<std::string> parts;
    parts.push_back(fmt::format("{}: fits with {} to spare ({} in use of {}, {:.0f}% headroom kept); {:.0f} tokens/s, {}", top.family,
                                gib_signed(top.spare_bytes), gib(top.used_peak_bytes), gib(search.cluster().gpu.memory_bytes), 100 * headroom,
                                top.tokens_per_s, step_split(top)));
    const Stage ts = top.input.strategy.stage;
    if (!shards_params(ts) && peft)
      parts.push_back(fmt::format("the {} base ({}) fits on every GPU", name_of(top.base_dtype), gib(top.model_base_bytes)));
    // A more sharded family that also fits, and what it would cost.
    for (std::size_t f = 0; f < families.size(); ++f) {
      const auto* b = by_family[f].best;
      if (!b || f == top_family || !lighter_stage(ts, families[f].stage) || families[f].profile != top.input.profile) continue;
      if (families[f].offload_optimizer != OffloadDevice::none || families[f].offload_param != OffloadDevice::none) continue;
      if (!shards_params(families[f].stage)) continue;
      // Speed compared per GPU when the two rows run on different GPU counts.
      const bool same_gpus = b->input.strategy.ranks == top.input.strategy.ranks;
      const double gain = same_gpus ? b->tokens_per_s / top.tokens_per_s - 1
                                    : (b->tokens_per_s / b->input.strategy.ranks) / (top.tokens_per_s / top.input.strategy.ranks) - 1;
      const char* speed = same_gpus ? "tokens/s" : "tokens/s per GPU";
      parts.push_back(fmt::format("{} would all-gather {} per step per rank to save {} you do not need ({})", families[f].label,
                                  gib(b->gathered_bytes), gib_signed(static_cast<std::int64_t>(top.used_peak_bytes) - static_cast<std::int64_t>(b->used_peak_bytes)),
                                  gain < -kSpeedTie  ? fmt::format("and {:.1f}% fewer {}", -100 * gain, speed)
                                  : gain > kSpeedTie ? fmt::format("{:.1f}% more {}, but #1 is ahead on {}", 100 * gain, speed, name_of(objective))
                                                     : fmt::format("for about the same speed, {:+.1f}% {}", 100 * gain, speed)));
      break;
    }
    // What forced a heavier choice: the lighter families that do not fit at all, in one sentence.
    {
      std::vector<std::string> names;
      const Candidate* closest = nullptr;
      std::int64_t worst = 0;
      for (std::size_t f = 0; f < families.size(); ++f) {
        if (f == top_family || by_family[f].best || !by_family[f].closest || families[f].profile != top.input.profile) continue;
        const bool lighter = lighter_stage(families[f].stage, ts) ||
                             (families[f].stage == ts && families[f].offload_optimizer == OffloadDevice::none && families[f].offload_param == OffloadDevice::none);
        if (!lighter) continue;
        const Candidate& c = *by_family[f].closest;
        names.push_back(families[f].label);
        if (!closest || c.spare_bytes > closest->spare_bytes) closest = &c;
        worst = std::min(worst, c.spare_bytes);
      }
      if (closest) {
        const std::string by = gib_signed(closest->spare_bytes) == gib_signed(worst)
                                   ? gib_signed(worst)
                                   : fmt::format("{} to {}", gib_signed(closest->spare_bytes), gib_signed(worst));
        parts.push_back(fmt::format("forced by memory: {} {} not fit, short by {} even at {} (at the peak: {})", fmt::join(names, ", "),
                                    names.size() == 1 ? "does" : "do", by, where(*closest), top_categories(*closest)));
      }
    }
    // Sharding the optimizer states, when that is what makes the difference.
    for (std::size_t f = 0; f < families.size(); ++f) {
      if (families[f].stage != (top.input.profile == RuntimeProfile::hf ? Stage::fsdp_no_shard : Stage::ddp) || f == top_family ||
          families[f].profile != top.input.profile)
        continue;
      const Candidate* d = by_family[f].best ? by_family[f].best : by_family[f].closest;
      if (!d) continue;
      const std::uint64_t od = at_peak(*d, MemCategory::optimizer_states) + at_peak(*d, MemCategory::gradients);
      const std::uint64_t ot = at_peak(top, MemCategory::optimizer_states) + at_peak(top, MemCategory::gradients);
      if (od > ot && od - ot > search.cluster().gpu.memory_bytes / 20)
        parts.push_back(fmt::format("sharding saves {} per GPU of optimizer_states and gradients against {} ({} there, {} here){}", gib(od - ot),
                                    families[f].label, gib(od), gib(ot),
                                    by_family[f].best ? fmt::format(", which lets micro-batch {} fit where {} fits {}", top.input.training.micro_batch,
                                                                    families[f].label, by_family[f].best->input.training.micro_batch)
                                                      : std::string()));
    }
    // Checkpointing: what the lighter choices (fewer layers recomputed) fit, and how fast.
    const auto& tt = top.input.training;
    auto recomputes = [](const CheckpointChoice& c) {  // a share of the layers, for ordering
      return c.kind == Checkpointing::none ? 0.0 : c.kind == Checkpointing::full ? 1.0 : 1.0 / static_cast<double>(c.every);
    };
    const CheckpointChoice top_ck{tt.checkpointing, tt.checkpoint_every};
    if (tt.checkpointing != Checkpointing::none) {
      std::vector<std::string> lighter;
      for (const auto& ck : space.checkpointing) {
        if (recomputes(ck) >= recomputes(top_ck)) continue;
        const Candidate* fit = nullptr;
        const Candidate* closest = nullptr;
        for (const auto& cell : cells) {
          if (cell.family != top_family || !(cell.ckpt == ck) || cell.gpus != top.input.strategy.ranks) continue;
          for (const auto& c : cell.timed)
            if (!fit || better(c, *fit, objective)) fit = &c;
          if (cell.closest) closest = &*cell.closest;
        }
        if (fit && fit->tokens_per_s <= top.tokens_per_s)
          lighter.push_back(fmt::format("with {} at most micro-batch {} fits, {:.1f}% fewer tokens/s", name_of(ck), fit->input.training.micro_batch,
                                        100 * (1 - fit->tokens_per_s / top.tokens_per_s)));
        else if (fit)  // faster, and behind #1 on another objective
          lighter.push_back(fmt::format("with {} micro-batch {} fits with {:.1f}% more tokens/s and {} in use per GPU, behind #1 on {}", name_of(ck),
                                        fit->input.training.micro_batch, 100 * (fit->tokens_per_s / top.tokens_per_s - 1), gib(fit->used_peak_bytes),
                                        name_of(objective)));
        else if (closest)
          lighter.push_back(fmt::format("with {} even micro-batch {} is short by {} (activations {} at the peak)", name_of(ck),
                                        closest->input.training.micro_batch, gib_signed(closest->spare_bytes), gib(at_peak(*closest, MemCategory::activations))));
      }
      if (!lighter.empty())
        parts.push_back(fmt::format("checkpointing {} at micro-batch {}: {}", name_of(top_ck), tt.micro_batch, fmt::join(lighter, "; ")));
    }
    const Terms terms = per_token(top);
    if (terms.exposed > terms.compute && terms.exposed >= terms.rest)
      parts.push_back(fmt::format("exposed communication is the dominant cost: {:.3f} s of the {:.3f} s step ({:.0f}%), all-gathering {} per step "
                                  "per rank{}", top.exposed_comm_s, top.step_s, 100 * top.exposed_comm_s / top.step_s, gib(top.gathered_bytes),
                                  top.inter_node_bytes > 0 ? fmt::format(", {} of it over {}", gib(top.inter_node_bytes),
                                                                         cluster_for_gpus(cluster, top.input.strategy.ranks).inter_node_link->name)
                                                           : std::string()));
    if (top.host_bound) parts.push_back(fmt::format("host-bound: {:.3f} s of FSDP1 hook time per step sets the floor", top.host_floor_s));
    // Optimizer-state sharding: visible when the optimizer states are a large share.
    top.reason = fmt::format("{}", fmt::join(parts, "; "));
  }

  // --- the other rows ---
  for (std::size_t i = 1; i < r.ranked.size(); ++i) {
    Candidate& c = r.ranked[i];
    if (objective == Objective::tokens_per_s && tied(c, top, fastest)) {
      c.reason = fmt::format("as fast as #1 ({:+.2f}%, within the 1% the time model resolves){}; {} to spare", 100 * (c.tokens_per_s / top.tokens_per_s - 1),
                             complexity(c) > complexity(top) ? " but shards or offloads more" : "", gib_signed(c.spare_bytes));
    } else {
      c.reason = fmt::format("{}{}; {} to spare", behind_top(c, top, objective),
                             objective == Objective::cost && cost_tied(c, top) && complexity(c) > complexity(top) ? " but shards or offloads more" : "",
                             gib_signed(c.spare_bytes));
    }
    const std::uint64_t os = at_peak(c, MemCategory::optimizer_states), ot = at_peak(top, MemCategory::optimizer_states);
    if (ot > os && ot - os > search.cluster().gpu.memory_bytes / 20)
      c.reason += fmt::format("; its optimizer_states are {} against #1's {} (sharded over {} ranks)", gib(os), gib(ot), c.input.strategy.ranks);
  }

  // --- every family but the winner's ---
  for (std::size_t f = 0; f < families.size(); ++f) {
    if (f == top_family) continue;
    Rejection rj{families[f].label, by_family[f].best != nullptr, "", {}, std::nullopt};
    if (const Candidate* b = by_family[f].best) {
      rj.best = *b;
      if (objective == Objective::tokens_per_s && tied(*b, top, fastest))
        rj.reason = fmt::format("as fast as #1 at best ({}: {:.0f} tokens/s, {:+.2f}%), {}", where(*b), b->tokens_per_s,
                                100 * (b->tokens_per_s / top.tokens_per_s - 1),
                                complexity(*b) > complexity(top) ? "but shards or offloads more for no gain"
                                                                 : "a tie, ranked below #1 by its tokens/s");
      else if (objective == Objective::cost && cost_tied(*b, top))
        rj.reason = fmt::format("as cheap as #1 at best ({}: ${:.3f} per million tokens, {:+.2f}%), {}", where(*b), *b->cost_per_mtok_usd,
                                100 * (*b->cost_per_mtok_usd / *top.cost_per_mtok_usd - 1),
                                complexity(*b) > complexity(top) ? "but shards or offloads more for no gain" : "a tie, ranked below #1 by its cost");
      else
        rj.reason = fmt::format("dominated: its best row ({}, {:.0f} tokens/s): {}", where(*b), b->tokens_per_s, behind_top(*b, top, objective));
      const std::uint64_t os = at_peak(*b, MemCategory::optimizer_states), ot = at_peak(top, MemCategory::optimizer_states);
      const std::uint64_t visible = search.cluster().gpu.memory_bytes / 20;  // 5% of the GPU: a saving worth a word
      if (ot > os && ot - os > visible)
        rj.reason += fmt::format("; it saves {} of optimizer_states per GPU ({} against #1's {})", gib(ot - os), gib(os), gib(ot));
      if (os > ot && os - ot > visible)
        rj.reason += fmt::format("; its optimizer_states take {} per GPU against #1's {}", gib(os), gib(ot));
    } else if (const Candidate* c = by_family[f].closest) {
      rj.best = *c;
      rj.reason = "does not fit: " + shortfall_text(*c, headroom);
      rj.suggestions = fit_suggestions(c->binding, c->input);
    } else {
      rj.reason = by_family[f].skipped.empty() ? "not planned" : by_family[f].skipped.front();
    }
    r.rejected.push_back(std::move(rj));
  }
  r.rejected.insert(r.rejected.end(), excluded.begin(), excluded.end());

  // --- alternatives outside the space when communication dominates the top row ---
  const Terms terms = per_token(top);
  if (terms.exposed > terms.compute && terms.exposed >= terms.rest) {
    auto describe = [&](const Candidate& c) {
      return fmt::format("{} at {}: {:.0f} tokens/s ({:+.0f}% against #1), all-gathers {} per step per rank, {} over the network", c.family, where(c),
                         c.tokens_per_s, 100 * (c.tokens_per_s / top.tokens_per_s - 1), gib(c.gathered_bytes), gib(c.inter_node_bytes));
    };
    SearchSpace same = space;
    same.profiles = {top.input.profile};
    same.stages = {top.input.strategy.stage};
    same.gpus = {top.input.strategy.ranks};
    if (peft && !base.peft.quantization) {
      Recommendation qr = recommend(with_nf4_base(base), cluster, same, constraints, objective);
      if (!qr.ranked.empty()) r.alternatives.push_back({"a quantised base (nf4, QLoRA: a quarter of the bytes to gather): " + describe(qr.ranked[0]), qr.ranked[0]});
    }
    const sim::Cluster cl = cluster_for_gpus(cluster, top.input.strategy.ranks);
    if (cl.nodes > 1 && top.input.strategy.ranks > cluster.gpus_per_node) {
      SearchSpace one = space;
      one.gpus = {cluster.gpus_per_node};
      one.global_batch.reset();
      Recommendation orr = recommend(base, cluster, one, constraints, objective);
      if (!orr.ranked.empty())
        r.alternatives.push_back({fmt::format("fewer nodes (one node of {} GPUs, nothing over the network): ", cluster.gpus_per_node) + describe(orr.ranked[0]),
                                  orr.ranked[0]});
      else if (!orr.rejected.empty())
        r.alternatives.push_back({fmt::format("fewer nodes: one node of {} GPUs does not fit ({})", cluster.gpus_per_node, orr.summary), top});
    }
    const Candidate* largest = nullptr;
    for (const auto& c : r.ranked)
      if (c.family == top.family && c.input.strategy.ranks == top.input.strategy.ranks &&
          (!largest || c.input.training.micro_batch > largest->input.training.micro_batch))
        largest = &c;
    if (largest && largest->input.training.micro_batch > top.input.training.micro_batch)
      r.alternatives.push_back({"a larger micro-batch (more tokens per gathered byte): " + describe(*largest), *largest});
  }

  r.summary = fmt::format("recommended: {} at {}, {:.0f} tokens/s, {} in use per GPU", top.family, where(top), top.tokens_per_s, gib(top.used_peak_bytes));
  r.evaluated = search.evaluated();
  r.timed = search.timed();
  return r;
}

namespace {
nlohmann::json candidate_json(const Candidate& c) {
  const auto& t = c.input.training;
  nlohmann::json cats;
  for (int i = 0; i < sim::kNumCategories; ++i)
    cats[std::string(sim::name_of(static_cast<MemCategory>(i))) + "_bytes"] = c.at_peak_bytes[static_cast<std::size_t>(i)];
  nlohmann::json j = {
      {"family", c.family},
      {"profile", name_of(c.input.profile)},
      {"strategy", name_of(c.input.strategy.stage)},
      {"offload_optimizer", name_of(c.input.strategy.offload_optimizer)},
      {"offload_param", name_of(c.input.strategy.offload_param)},
      {"micro_batch", t.micro_batch},
      {"grad_accum", t.grad_accum},
      {"checkpointing", name_of(CheckpointChoice{t.checkpointing, t.checkpoint_every})},
      {"gpus", c.input.strategy.ranks},
      {"fits", c.fits},
      {"allocated_peak_bytes", c.allocated_peak_bytes},
      {"reserved_peak_bytes", c.reserved_peak_bytes},
      {"used_peak_bytes", c.used_peak_bytes},
      {"spare_bytes", c.spare_bytes},
      {"at_peak", cats},
      {"binding_category", sim::name_of(c.binding)},
      {"step_s", c.step_s},
      {"compute_s", c.compute_s},
      {"exposed_comm_s", c.exposed_comm_s},
      {"offload_s", c.offload_s},
      {"host_bound", c.host_bound},
      {"tokens_per_s", c.tokens_per_s},
      {"tokens_per_s_per_gpu", c.tokens_per_s / std::max(1, c.input.strategy.ranks)},
      {"mfu", c.mfu},
      {"all_gather_bytes", c.gathered_bytes},
      {"comm_bytes", c.comm_bytes},
      {"inter_node_bytes", c.inter_node_bytes},
      {"pareto", c.pareto},
      {"reason", c.reason},
  };
  j["cost_per_million_tokens_usd"] = c.cost_per_mtok_usd ? nlohmann::json(*c.cost_per_mtok_usd) : nlohmann::json(nullptr);
  return j;
}
}  // namespace

nlohmann::json recommendation_to_json(const Recommendation& r, std::size_t top) {
  nlohmann::json j;
  j["schema"] = schemas::kRecommendation;
  j["objective"] = name_of(r.objective);
  j["model"] = r.model;
  j["cluster"] = r.cluster;
  j["capacity_bytes"] = r.capacity_bytes;
  j["headroom_fraction"] = r.headroom_fraction;
  j["summary"] = r.summary;
  j["suggestions"] = suggestions_to_json(r.suggestions);
  j["evaluated"] = r.evaluated;
  j["timed"] = r.timed;
  j["fitting"] = r.fitting;
  j["ranked"] = nlohmann::json::array();
  for (std::size_t i = 0; i < r.ranked.size() && i < top; ++i) j["ranked"].push_back(candidate_json(r.ranked[i]));
  j["rejected"] = nlohmann::json::array();
  for (const auto& x : r.rejected) {
    nlohmann::json e = {{"family", x.family}, {"fits", x.fits}, {"reason", x.reason}, {"suggestions", suggestions_to_json(x.suggestions)}};
    e["best"] = x.best ? candidate_json(*x.best) : nlohmann::json(nullptr);
    j["rejected"].push_back(e);
  }
  j["alternatives"] = nlohmann::json::array();
  for (const auto& a : r.alternatives) j["alternatives"].push_back({{"what", a.what}, {"candidate", candidate_json(a.candidate)}});
  return j;
}

namespace {

// A enum field spelled by name_of, read back through from_name.
template <typename E, std::size_t N>
E enum_field(const nlohmann::json& o, const char* key, const std::string& source, const std::string& prefix, const std::array<E, N>& values) {
  const std::string v = json_fields::as_string(json_fields::required(o, key, source, prefix), source, prefix + key);
  const auto e = from_name(v, values);
  if (!e) throw input_error(source, prefix + key, fmt::format("must be one of {}", names_of(values)), fmt::format("\"{}\"", v));
  return *e;
}

std::vector<Suggestion> suggestions_from_json(const nlohmann::json& a, const std::string& source, const std::string& field) {
  if (!a.is_array()) throw input_error(source, field, "must be a list of suggestions", a.dump().substr(0, 60));
  std::vector<Suggestion> out;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const std::string at = fmt::format("{}[{}].", field, i);
    const nlohmann::json& e = a[i];
    Suggestion s;
    const std::string knob = json_fields::as_string(json_fields::required(e, "knob", source, at), source, at + "knob");
    bool found = false;
    for (int k = 0; k < kNumKnobs && !found; ++k)
      if (field_of(static_cast<Knob>(k)) == knob) {
        s.knob = static_cast<Knob>(k);
        found = true;
      }
    if (!found) throw input_error(source, at + "knob", "must name a knob (a PlanInput field, such as strategy.stage)", fmt::format("\"{}\"", knob));
    const std::string change = json_fields::as_string(json_fields::required(e, "change", source, at), source, at + "change");
    found = false;
    for (Change c : {Change::set, Change::smaller, Change::larger})
      if (name_of(c) == change) {
        s.change = c;
        found = true;
      }
    if (!found) throw input_error(source, at + "change", "must be set, smaller or larger", fmt::format("\"{}\"", change));
    s.value = json_fields::string(e, "value", source, "", at);
    s.why = json_fields::string(e, "why", source, "", at);
    out.push_back(std::move(s));
  }
  return out;
}

Candidate candidate_from_json(const nlohmann::json& c, const std::string& source, const std::string& prefix) {
  namespace jf = json_fields;
  if (!c.is_object()) throw input_error(source, prefix.empty() ? "row" : prefix.substr(0, prefix.size() - 1), "must be an object (a recommend row)");
  Candidate x;
  auto u64 = [&](const nlohmann::json& o, const char* key, const std::string& at) {
    return static_cast<std::uint64_t>(jf::required_integer(o, key, source, at, 0));
  };
  x.family = jf::as_string(jf::required(c, "family", source, prefix), source, prefix + "family");
  x.input.profile = enum_field(c, "profile", source, prefix, kRuntimeProfiles);
  x.input.strategy.stage = enum_field(c, "strategy", source, prefix, kStages);
  x.input.strategy.offload_optimizer = enum_field(c, "offload_optimizer", source, prefix, kOffloadDevices);
  x.input.strategy.offload_param = enum_field(c, "offload_param", source, prefix, kOffloadDevices);
  x.input.training.micro_batch = jf::required_integer(c, "micro_batch", source, prefix, 1);
  x.input.training.grad_accum = jf::required_integer(c, "grad_accum", source, prefix, 1);
  const std::string ck = jf::as_string(jf::required(c, "checkpointing", source, prefix), source, prefix + "checkpointing");
  const auto choice = checkpoint_choice_from_name(ck);
  if (!choice) throw input_error(source, prefix + "checkpointing", "must be none, full or every-K", fmt::format("\"{}\"", ck));
  x.input.training.checkpointing = choice->kind;
  x.input.training.checkpoint_every = choice->every;
  x.input.strategy.ranks = static_cast<std::int32_t>(jf::required_integer(c, "gpus", source, prefix, 1, 1 << 20));
  x.fits = jf::as_boolean(jf::required(c, "fits", source, prefix), source, prefix + "fits");
  x.allocated_peak_bytes = u64(c, "allocated_peak_bytes", prefix);
  x.reserved_peak_bytes = u64(c, "reserved_peak_bytes", prefix);
  x.used_peak_bytes = u64(c, "used_peak_bytes", prefix);
  x.spare_bytes = jf::required_integer(c, "spare_bytes", source, prefix);
  const nlohmann::json& cats = jf::required_object(c, "at_peak", source, prefix);
  for (int i = 0; i < sim::kNumCategories; ++i)
    x.at_peak_bytes[static_cast<std::size_t>(i)] = u64(cats, (std::string(sim::name_of(static_cast<MemCategory>(i))) + "_bytes").c_str(), prefix + "at_peak.");
  x.step_s = jf::required_number(c, "step_s", source, prefix, jf::Sign::non_negative);
  x.compute_s = jf::required_number(c, "compute_s", source, prefix, jf::Sign::non_negative);
  x.exposed_comm_s = jf::required_number(c, "exposed_comm_s", source, prefix, jf::Sign::non_negative);
  x.offload_s = jf::required_number(c, "offload_s", source, prefix, jf::Sign::non_negative);
  x.host_bound = jf::as_boolean(jf::required(c, "host_bound", source, prefix), source, prefix + "host_bound");
  x.tokens_per_s = jf::required_number(c, "tokens_per_s", source, prefix, jf::Sign::non_negative);
  x.mfu = jf::required_number(c, "mfu", source, prefix, jf::Sign::non_negative);
  x.gathered_bytes = u64(c, "all_gather_bytes", prefix);
  x.comm_bytes = u64(c, "comm_bytes", prefix);
  x.inter_node_bytes = u64(c, "inter_node_bytes", prefix);
  const std::string binding = jf::as_string(jf::required(c, "binding_category", source, prefix), source, prefix + "binding_category");
  bool known = false;
  for (int i = 0; i < sim::kNumCategories && !known; ++i)
    if (sim::name_of(static_cast<MemCategory>(i)) == binding) {
      x.binding = static_cast<MemCategory>(i);
      known = true;
    }
  if (!known) throw input_error(source, prefix + "binding_category", "must name a memory category (such as activations)", fmt::format("\"{}\"", binding));
  x.pareto = jf::boolean(c, "pareto", source, false, prefix);
  x.reason = jf::string(c, "reason", source, "", prefix);
  x.cost_per_mtok_usd = jf::nullable_number(c, "cost_per_million_tokens_usd", source, prefix);
  return x;
}

}  // namespace

Recommendation recommendation_from_json(const nlohmann::json& j, const std::string& source) {
  namespace jf = json_fields;
  if (!j.is_object()) throw input_error(source, "", "must hold a JSON object (the output of peftplan recommend --json)");
  if (!j.contains("schema") || j["schema"] != schemas::kRecommendation)
    throw input_error(source, "schema", fmt::format("must be \"{}\" (peftplan recommend --json)", schemas::kRecommendation),
                      j.contains("schema") ? j["schema"].dump() : std::string("none"));
  Recommendation r;
  r.objective = enum_field(j, "objective", source, "", kObjectives);
  r.summary = jf::as_string(jf::required(j, "summary", source), source, "summary");
  r.suggestions = suggestions_from_json(jf::required(j, "suggestions", source), source, "suggestions");
  r.evaluated = jf::required_integer(j, "evaluated", source, {}, 0);
  r.timed = jf::required_integer(j, "timed", source, {}, 0);
  r.fitting = jf::required_integer(j, "fitting", source, {}, 0);
  r.model = jf::as_string(jf::required(j, "model", source), source, "model");
  r.cluster = jf::as_string(jf::required(j, "cluster", source), source, "cluster");
  r.capacity_bytes = static_cast<std::uint64_t>(jf::required_integer(j, "capacity_bytes", source, {}, 1));
  r.headroom_fraction = jf::as_number(jf::required(j, "headroom_fraction", source), source, "headroom_fraction", jf::Sign::non_negative);
  if (!(r.headroom_fraction < 1)) throw input_error(source, "headroom_fraction", "must be in [0, 1)", jf::required(j, "headroom_fraction", source).dump());
  const nlohmann::json& ranked = jf::required(j, "ranked", source);
  if (!ranked.is_array()) throw input_error(source, "ranked", "must be a list of rows", ranked.dump().substr(0, 60));
  for (std::size_t i = 0; i < ranked.size(); ++i) r.ranked.push_back(candidate_from_json(ranked[i], source, fmt::format("ranked[{}].", i)));
  const nlohmann::json& rejected = jf::required(j, "rejected", source);
  if (!rejected.is_array()) throw input_error(source, "rejected", "must be a list", rejected.dump().substr(0, 60));
  for (std::size_t i = 0; i < rejected.size(); ++i) {
    const std::string at = fmt::format("rejected[{}].", i);
    const nlohmann::json& e = rejected[i];
    Rejection x;
    x.family = jf::as_string(jf::required(e, "family", source, at), source, at + "family");
    x.fits = jf::as_boolean(jf::required(e, "fits", source, at), source, at + "fits");
    x.reason = jf::as_string(jf::required(e, "reason", source, at), source, at + "reason");
    x.suggestions = suggestions_from_json(jf::required(e, "suggestions", source, at), source, at + "suggestions");
    if (const nlohmann::json* b = jf::find(e, "best")) x.best = candidate_from_json(*b, source, at + "best.");
    r.rejected.push_back(std::move(x));
  }
  const nlohmann::json& alternatives = jf::required(j, "alternatives", source);
  if (!alternatives.is_array()) throw input_error(source, "alternatives", "must be a list", alternatives.dump().substr(0, 60));
  for (std::size_t i = 0; i < alternatives.size(); ++i) {
    const std::string at = fmt::format("alternatives[{}].", i);
    Alternative a;
    a.what = jf::as_string(jf::required(alternatives[i], "what", source, at), source, at + "what");
    a.candidate = candidate_from_json(jf::required(alternatives[i], "candidate", source, at), source, at + "candidate.");
    r.alternatives.push_back(std::move(a));
  }
  return r;
}

}  // namespace peftplan::planner
