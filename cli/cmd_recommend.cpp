// `peftplan recommend`: the plan inputs minus what it searches (strategy, offload, checkpointing,
// micro-batch, accumulation, GPU count), a ranked table with a reason per row, the strategies that
// lost and why, alternatives outside the space, and with --emit the files to launch the winner.
// Exit code 1 when nothing fits.
#include <cmath>
#include <chrono>
#include <memory>

#include <fmt/format.h>

#include "commands.h"
#include "plan_flags.h"
#include "peftplan/reports/launch_files.h"
#include "ranges.h"
#include "peftplan/common/error.h"
#include "peftplan/common/units.h"
#include "peftplan/planner/launcher_config.h"
#include "peftplan/planner/recommend.h"

namespace peftplan::cli {
namespace {

// recommend's own spelling of a knob: it searches the micro-batch, offload and the strategy, so a
// suggestion to change them points at the flag that bounds the search (plan's spelling otherwise).
std::string search_flag_of(planner::Knob k) {
  using planner::Knob;
  switch (k) {
    case Knob::micro_batch: return "--max-micro-batch";
    case Knob::offload_optimizer:
    case Knob::offload_param: return flag_of(Knob::search_offload);
    case Knob::ranks: return flag_of(Knob::search_gpus);
    default: return flag_of(k);
  }
}

struct Options {
  PlanFlags plan;
  std::string gpus;           // list or range; empty: the cluster's GPUs
  std::string strategies;     // comma list; empty: every strategy of the profile
  std::string checkpointing;  // comma list; empty: none, every-4, every-2, full
  bool no_offload = false;
  std::string objective = "tokens-per-s";
  std::size_t top = 10;
  std::optional<std::int32_t> max_gpus;
  std::optional<double> host_ram_gib;
  std::optional<std::int64_t> global_batch;
  std::int64_t min_micro_batch = 1;
  std::int64_t max_micro_batch = 1024;
  bool json = false;
  std::string emit;
};

planner::CheckpointChoice parse_checkpoint(std::string_view word) {
  if (const auto c = planner::checkpoint_choice_from_name(word)) return *c;
  throw input_error("--checkpointing", "", "must be a comma list of none, full and every-K (K a positive integer)", fmt::format("\"{}\"", word));
}

// Dollars per million tokens: three decimals below $10 (rows on one GPU type differ in the third).
std::string price(const std::optional<double>& v) {
  if (!v) return "-";
  return *v < 10 ? fmt::format("{:.3f}", *v) : fmt::format("{:.2f}", *v);
}

void print_text(const planner::Recommendation& r, const ResolvedPlan& rp, const Options& o, double seconds) {
  const auto& in = rp.input;
  fmt::print("peftplan recommend: {} · {} · seq {} · {} on {} · objective {}\n", in.model.name,
             in.peft.adapters.empty() ? std::string("full fine-tuning")
                                      : fmt::format("{} adapter(s){}", in.peft.adapters.size(),
                                                    in.peft.quantization ? fmt::format(", base {}", name_of(in.peft.quantization->dtype)) : ""),
             in.training.seq_len, name_of(in.training.precision), rp.cluster.name, name_of(r.objective));
  fmt::print("searched {} plans ({} timed) in {:.2f} s: {} fit\n\n", r.evaluated, r.timed, seconds, r.ranked.size());
  if (!r.ranked.empty()) {
    std::size_t w = 8;
    for (std::size_t i = 0; i < r.ranked.size() && i < o.top; ++i) w = std::max(w, r.ranked[i].family.size());
    fmt::print("{:>3}  {:<{}} {:>4} {:>5} {:<8} {:>4} {:>8} {:>7} {:>8} {:>10} {:>8} {:>5} {:>7}\n", "#", "strategy", w, "mb", "accum", "ckpt", "GPUs",
               "GiB use", "spare", "step s", "tokens/s", "exposed", "MFU", "$/Mtok");
    for (std::size_t i = 0; i < r.ranked.size() && i < o.top; ++i) {
      const auto& c = r.ranked[i];
      const auto& t = c.input.training;
      fmt::print("{:>3}{} {:<{}} {:>4} {:>5} {:<8} {:>4} {:>8.1f} {:>7.1f} {:>8.3f} {:>10} {:>8.3f} {:>4.0f}% {:>7}\n", i + 1, c.pareto ? "*" : " ",
                 c.family, w, t.micro_batch, t.grad_accum, planner::name_of(planner::CheckpointChoice{t.checkpointing, t.checkpoint_every}),
                 c.input.strategy.ranks, to_gib(c.used_peak_bytes), static_cast<double>(c.spare_bytes) / static_cast<double>(1ull << 30), c.step_s,
                 with_commas(static_cast<std::int64_t>(c.tokens_per_s + 0.5)), c.exposed_comm_s, 100 * c.mfu, price(c.cost_per_mtok_usd));
    }
    fmt::print("(* on the Pareto front: no other row is both smaller in use and faster; GiB use: what nvidia-smi would show per GPU; spare: after the headroom)\n");
    fmt::print("\nwhy #1: {}\n", r.ranked[0].reason);
    if (r.ranked.size() > 1) {
      fmt::print("the next rows:\n");
      for (std::size_t i = 1; i < r.ranked.size() && i < std::min<std::size_t>(o.top, 5); ++i) fmt::print("  #{}: {}\n", i + 1, r.ranked[i].reason);
    }
  }
  if (!r.rejected.empty()) {
    fmt::print("\n{}:\n", r.ranked.empty() ? "every strategy" : "the other strategies");
    // Families that do not fit for the same reason (the same category at the peak, shortfalls
    // within 1 GiB) share one line; --json keeps one entry each.
    std::vector<bool> done(r.rejected.size(), false);
    for (std::size_t i = 0; i < r.rejected.size(); ++i) {
      if (done[i]) continue;
      const auto& x = r.rejected[i];
      std::vector<std::string> names = {x.family};
      if (!x.fits && x.best)
        for (std::size_t j = i + 1; j < r.rejected.size(); ++j) {
          const auto& y = r.rejected[j];
          if (done[j] || y.fits || !y.best || y.best->binding != x.best->binding) continue;
          if (std::abs(static_cast<double>(y.best->spare_bytes - x.best->spare_bytes)) > static_cast<double>(1ull << 30)) continue;
          names.push_back(y.family);
          done[j] = true;
        }
      std::string reason = x.reason;
      if (names.size() > 1 && reason.rfind("does not fit: ", 0) == 0)
        reason = fmt::format("none fits ({}'s figures): {}", x.family, reason.substr(14));
      if (!x.suggestions.empty()) reason += "; " + planner::suggestion_text(x.suggestions, search_flag_of);
      fmt::print("  {}: {}\n", fmt::format("{}", fmt::join(names, ", ")), reason);
    }
  }
  if (!r.alternatives.empty()) {
    fmt::print("\noutside the search:\n");
    for (const auto& a : r.alternatives) fmt::print("  - {}\n", a.what);
  }
  fmt::print("\n{}{}\n", r.summary, r.suggestions.empty() ? std::string() : "; " + planner::suggestion_text(r.suggestions, search_flag_of));
}

}  // namespace

void add_recommend_command(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand("recommend", "search strategies, offload, checkpointing, micro-batch and GPU count; rank them with reasons");
  cmd->footer(
      "example: peftplan recommend --model llama-2-70b --lora-r 16 --seq-len 4096 --cluster 8xA100-80GB\n"
      "         peftplan recommend --model llama-2-70b --lora-r 16 --cluster 8x8xH100-SXM-NDR --gpus 8..64:x2 --global-batch 512 --emit out/");
  auto o = std::make_shared<Options>();
  add_plan_flags(cmd, o->plan, PlanFlagSet::search);
  cmd->add_option("--gpus", o->gpus, "GPU counts to search: N, a list 8,16,32 or a range 8..64:8 / 8..64:x2 (default: the cluster's GPUs)");
  cmd->add_option("--strategy", o->strategies, "strategies to search, a comma list (default: every one the profile plans)");
  cmd->add_option("--checkpointing", o->checkpointing, "checkpointing choices, a comma list of none, every-K and full (default: none,every-4,every-2,full)");
  cmd->add_flag("--no-offload", o->no_offload, "do not search optimizer or parameter offload");
  cmd->add_option("--objective", o->objective, "tokens-per-s, gpus, cost (per million tokens) or memory")->capture_default_str();
  cmd->add_option("--top", o->top, "rows to show")->capture_default_str()->check(CLI::Range(1, 1000000));
  cmd->add_option("--max-gpus", o->max_gpus, "at most this many GPUs");
  cmd->add_option("--host-ram", o->host_ram_gib, "host RAM per node in GiB (overrides the cluster's)");
  cmd->add_option("--global-batch", o->global_batch, "sequences per optimizer step over all GPUs (accumulation reaches it)");
  cmd->add_option("--min-micro-batch", o->min_micro_batch, "smallest micro-batch to consider")->capture_default_str();
  cmd->add_option("--max-micro-batch", o->max_micro_batch, "largest micro-batch to consider")->capture_default_str();
  cmd->add_flag("--json", o->json, "machine-readable output");
  cmd->add_option("--emit", o->emit, "write the top row's launch files to this folder (ds_config.json, accelerate config, train.py, launch.sh, plan.json)")
      ->check(kNonEmpty);
  cmd->callback([&exit_code, o] {
    PlanFlags flags = o->plan;
    planner::SearchSpace space;
    const bool all = flags.profile == "all";
    if (all) flags.profile = "deepspeed";
    if (o->max_micro_batch < o->min_micro_batch)
      throw InputError(fmt::format("--max-micro-batch {} is below --min-micro-batch {}", o->max_micro_batch, o->min_micro_batch));
    ResolvedPlan rp = resolve_plan_flags(flags);
    print_warnings(rp.warnings);  // a target the model lacks, a launcher config's ignored keys, a checkpoint saved quantised
    space.profiles = all ? std::vector{planner::RuntimeProfile::deepspeed, planner::RuntimeProfile::hf} : std::vector{rp.input.profile};
    if (!o->strategies.empty())
      for (auto w : split_commas("--strategy", o->strategies)) {
        const auto s = planner::from_name(w, planner::kStages);
        if (!s) throw input_error("--strategy", "", "must be a comma list of " + planner::names_of(planner::kStages), fmt::format("\"{}\"", w));
        space.stages.push_back(*s);
      }
    // A listed FSDP strategy without --profile is searched under the profile that runs it (hf), as
    // plan plans it (planner::profile_that_runs). FSDP only: the searched profile lists the
    // stages it plans, and families_of already plans a DDP family DeepSpeed cannot run under hf.
    if (o->plan.profile.empty())
      for (planner::Stage st : space.stages) {
        planner::Strategy listed;
        listed.stage = st;
        const planner::RuntimeProfile runs = planner::profile_that_runs(rp.input.profile, listed, rp.input.training);
        if (planner::is_fsdp(st) && std::find(space.profiles.begin(), space.profiles.end(), runs) == space.profiles.end())
          space.profiles.push_back(runs);
      }
    if (!o->checkpointing.empty())
      for (auto w : split_commas("--checkpointing", o->checkpointing)) space.checkpointing.push_back(parse_checkpoint(w));
    if (!o->gpus.empty()) {
      for (std::int64_t g : parse_int_list("--gpus", o->gpus)) {
        if (g > planner::kMaxRanks)
          throw input_error("--gpus", "", fmt::format("lists a GPU count above {}", with_commas(planner::kMaxRanks)), std::to_string(g));
        space.gpus.push_back(static_cast<std::int32_t>(g));
      }
      for (std::int32_t g : space.gpus) (void)planner::cluster_for_gpus(rp.cluster, g);  // refuse a count the cluster cannot grow to
    }
    space.offload = !o->no_offload;
    space.global_batch = o->global_batch;
    space.min_micro_batch = o->min_micro_batch;
    space.max_micro_batch = o->max_micro_batch;
    const auto objective = planner::from_name(o->objective, planner::kObjectives);
    if (!objective) throw input_error("--objective", "", "must be one of " + planner::names_of(planner::kObjectives), fmt::format("\"{}\"", o->objective));
    planner::Constraints constraints;
    constraints.headroom_fraction = rp.headroom_fraction;
    constraints.max_gpus = o->max_gpus;
    if (o->host_ram_gib) {
      if (!(*o->host_ram_gib > 0)) throw input_error("--host-ram", "", "must be a positive number of GiB", fmt::format("{}", *o->host_ram_gib));
      constraints.host_ram_bytes_per_node = static_cast<std::uint64_t>(*o->host_ram_gib * static_cast<double>(1ull << 30));
    }
    const auto t0 = std::chrono::steady_clock::now();
    const planner::Recommendation r = planner::recommend(rp.input, rp.cluster, space, constraints, *objective);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::vector<std::string> stale;  // an earlier plan's launch files this one does not write
    if (!o->emit.empty() && !r.ranked.empty())
      stale = reports::emit_launch_files(o->emit, r.ranked.front(), rp.cluster, rp.input.training.eval_batch, flags.model);
    if (o->json) fmt::print("{}\n", planner::recommendation_to_json(r, o->top).dump(2));
    else print_text(r, rp, *o, seconds);
    if (!o->emit.empty() && !o->json) {
      if (r.ranked.empty()) fmt::print("nothing fits: no launch files written to {}\n", o->emit);
      else fmt::print("launch files for #1 written to {} (launch.sh, train.py, plan.json and the launcher's config)\n", as_folder(o->emit));
    }
    if (!stale.empty()) fmt::print(stderr, "{}\n", reports::stale_launch_files_note(o->emit, stale));
    exit_code = r.ranked.empty() ? 1 : 0;
  });
}

}  // namespace peftplan::cli
