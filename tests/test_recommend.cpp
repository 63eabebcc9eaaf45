// The recommender: the seed's guidance (shared/seed/000_88f215ce6d2ee72f.txt, "Choosing a
// strategy") as orderings and reasons, not magic numbers; every row equal to make_plan of its
// input; the search's own rules (the largest micro-batch that fits, the global batch, the GPU
// list, the Pareto front); and the CLI around it (ranges, --emit, bad input).
#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <set>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "cli_run.h"
#include "peftplan/common/error.h"
#include "peftplan/models/config.h"
#include "peftplan/planner/ds_config.h"
#include "peftplan/planner/explain.h"
#include "peftplan/planner/plan_file.h"
#include "peftplan/planner/recommend.h"
#include "peftplan/sim/cluster.h"

namespace {

using namespace peftplan;
using namespace peftplan::planner;

PlanInput lora(const std::string& model, std::int64_t r, std::int64_t seq, const std::string& targets = "") {
  PlanInput in;
  in.model = models::load_model(model);
  models::AdapterSpec a;
  a.type = models::PeftType::lora;
  a.lora.r = r;
  a.lora.alpha = static_cast<double>(r);
  if (targets == "all-linear") a.lora.targets.kind = models::ModuleSelector::Kind::all_linear;
  in.peft.adapters.push_back(a);
  in.training.seq_len = seq;
  in.training.precision = Precision::bf16_mixed;
  in.training.attention = Attention::flash;
  in.profile = RuntimeProfile::deepspeed;
  return in;
}

Recommendation search(PlanInput in, const std::string& cluster, SearchSpace space = {}, Objective o = Objective::tokens_per_s) {
  const sim::Cluster c = sim::resolve_cluster(cluster);
  in.strategy.ranks = sim::total_gpus(c);
  return recommend(in, c, space, Constraints{}, o);
}

bool shards_base(const Candidate& c) { return shards_params(c.input.strategy.stage); }

const Rejection& rejected(const Recommendation& r, const std::string& family) {
  for (const auto& x : r.rejected)
    if (x.family == family) return x;
  throw std::runtime_error("no rejection for " + family);
}

// Seed: "If the base model fits comfortably on each GPU: ZeRO-1 or ZeRO-2 are often the best
// choices ... without the parameter-gathering communication overhead of ZeRO-3."
TEST(Recommend, SevenBillionLoraOnEightA100sPrefersAnUnshardedBase) {
  const Recommendation r = search(lora("llama-2-7b", 16, 4096), "8xA100-80GB");
  ASSERT_FALSE(r.ranked.empty());
  const Candidate& top = r.ranked.front();
  EXPECT_FALSE(shards_base(top)) << top.family;
  // The best ZeRO-3 row ranks below the best DDP / ZeRO-1 / ZeRO-2 row.
  const auto first = [&](auto pred) {
    return std::find_if(r.ranked.begin(), r.ranked.end(), pred) - r.ranked.begin();
  };
  const auto zero3 = first([](const Candidate& c) { return c.input.strategy.stage == Stage::zero3; });
  const auto light = first([](const Candidate& c) { return !shards_params(c.input.strategy.stage); });
  EXPECT_LT(light, zero3);
  EXPECT_NE(top.reason.find("base (12.6 GiB) fits on every GPU"), std::string::npos) << top.reason;
  EXPECT_NE(top.reason.find("zero3 would all-gather"), std::string::npos) << top.reason;
  EXPECT_NE(top.reason.find("you do not need"), std::string::npos) << top.reason;
}

// Seed: "If the base model does not fit on a single GPU: ZeRO-3 becomes necessary."
TEST(Recommend, SeventyBillionBf16NeedsZeroThree) {
  const Recommendation r = search(lora("llama-2-70b", 16, 4096), "8xA100-80GB");
  ASSERT_FALSE(r.ranked.empty());
  EXPECT_EQ(r.ranked.front().input.strategy.stage, Stage::zero3) << r.ranked.front().family;
  for (const char* f : {"ddp", "zero1", "zero2"}) {
    const Rejection& x = rejected(r, f);
    EXPECT_FALSE(x.fits) << f;
    EXPECT_NE(x.reason.find("does not fit"), std::string::npos) << x.reason;
    EXPECT_NE(x.reason.find("base_weights"), std::string::npos) << x.reason;
    EXPECT_NE(x.reason.find("short by"), std::string::npos) << x.reason;
    ASSERT_TRUE(x.best);
    EXPECT_LT(x.best->spare_bytes, 0);  // the shortfall the reason names
  }
  EXPECT_NE(r.ranked.front().reason.find("forced by memory: ddp"), std::string::npos) << r.ranked.front().reason;
}

// Seed: "Slower networks (e.g., Ethernet) make ZeRO-3 less appealing unless absolutely necessary"
// and ZeRO-3's "significant communication overhead ... especially on slower network interconnects".
TEST(Recommend, SeventyBillionOverTenGigabitEthernetNamesTheCommunication) {
  const Recommendation r = search(lora("llama-2-70b", 16, 4096), "2x8xA100-80GB-10GbE");
  ASSERT_FALSE(r.ranked.empty());
  const Candidate& top = r.ranked.front();
  EXPECT_EQ(top.input.strategy.stage, Stage::zero3);
  EXPECT_NE(top.reason.find("exposed communication is the dominant cost"), std::string::npos) << top.reason;
  EXPECT_GT(top.exposed_comm_s, top.compute_s);
  // Alternatives that move less over the slow link, each with its numbers.
  auto offered = [&](const std::string& what) {
    return std::any_of(r.alternatives.begin(), r.alternatives.end(), [&](const Alternative& a) { return a.what.find(what) != std::string::npos; });
  };
  EXPECT_TRUE(offered("a quantised base")) << r.summary;
  EXPECT_TRUE(offered("fewer nodes"));
  for (const auto& a : r.alternatives) EXPECT_NE(a.what.find("tokens/s"), std::string::npos) << a.what;
  // A quantised base gathers a quarter of the bytes or less.
  for (const auto& a : r.alternatives) {
    if (a.what.find("quantised") != std::string::npos) {
      EXPECT_LT(a.candidate.gathered_bytes, top.gathered_bytes / 3);
    }
  }
}

// Seed: "Limited memory favors ZeRO stages, potentially with CPU offloading."
TEST(Recommend, NineBillionOnFourRtx4090sSaysWhatForcedIt) {
  const Recommendation r = search(lora("gemma-2-9b", 16, 2048), "4xRTX4090-PCIe");
  ASSERT_FALSE(r.ranked.empty());
  const Candidate& top = r.ranked.front();
  const bool heavy = shards_base(top) || top.input.strategy.offload_optimizer == OffloadDevice::cpu ||
                     top.input.training.checkpointing != Checkpointing::none;
  EXPECT_TRUE(heavy) << top.family;
  EXPECT_NE(top.reason.find("forced by memory"), std::string::npos) << top.reason;
  EXPECT_FALSE(rejected(r, "ddp").fits);
}

// Seed: "ZeRO-1 ... reduce[s] memory from optimizer states"; with PEFT they are small, unless the
// adapter is large: a rank-1024 adapter on every Linear makes the saving what decides.
TEST(Recommend, LargeAdapterMakesOptimizerSharding) {
  const Recommendation big = search(lora("llama-2-7b", 1024, 2048, "all-linear"), "8xA100-80GB");
  ASSERT_FALSE(big.ranked.empty());
  const Candidate& top = big.ranked.front();
  EXPECT_NE(top.input.strategy.stage, Stage::ddp);
  EXPECT_NE(top.reason.find("optimizer_states"), std::string::npos) << top.reason;
  EXPECT_NE(rejected(big, "ddp").reason.find("optimizer_states"), std::string::npos) << rejected(big, "ddp").reason;
  // With a rank-16 adapter on q and v the states are small and nothing says so.
  const Recommendation small = search(lora("llama-2-7b", 16, 2048), "8xA100-80GB");
  EXPECT_EQ(small.ranked.front().reason.find("optimizer_states"), std::string::npos) << small.ranked.front().reason;
}

// Every row is what `plan` says for its input: the same bytes per category and the same time.
TEST(Recommend, RowsAreMakePlan) {
  const sim::Cluster c = sim::resolve_cluster("8xA100-80GB");
  PlanInput in = lora("llama-2-13b", 16, 2048);
  in.strategy.ranks = 8;
  const Recommendation r = recommend(in, c, {}, Constraints{}, Objective::tokens_per_s);
  ASSERT_GT(r.ranked.size(), 10u);
  for (std::size_t i = 0; i < r.ranked.size(); i += 7) {
    const Candidate& row = r.ranked[i];
    const Plan p = make_plan(row.input, c);
    EXPECT_EQ(row.used_peak_bytes, p.used_peak_bytes) << row.family;
    EXPECT_EQ(row.allocated_peak_bytes, p.memory.device_peak_bytes);
    EXPECT_EQ(row.at_peak_bytes, p.memory.at_peak_bytes);
    ASSERT_TRUE(p.time);
    EXPECT_DOUBLE_EQ(row.step_s, p.time->step_s);
    EXPECT_TRUE(p.fits);
  }
}

// The micro-batch search finds the largest that fits: one more does not.
TEST(Recommend, LargestMicroBatchIsTheLargestThatFits) {
  const sim::Cluster c = sim::resolve_cluster("8xA100-80GB");
  PlanInput in = lora("llama-2-7b", 16, 4096);
  in.strategy.ranks = 8;
  SearchSpace s;
  s.stages = {Stage::ddp};
  s.checkpointing = {{Checkpointing::none, 1}};
  const Recommendation r = recommend(in, c, s, Constraints{}, Objective::tokens_per_s);
  std::int64_t largest = 0;
  for (const auto& row : r.ranked) largest = std::max(largest, row.input.training.micro_batch);
  ASSERT_GT(largest, 0);
  PlanInput more = r.ranked.front().input;
  more.training.micro_batch = largest + 1;
  EXPECT_FALSE(make_plan(more, c).fits);
  // 1, 2, 4, ... up to it, and it.
  std::vector<std::int64_t> mbs;
  for (const auto& row : r.ranked) mbs.push_back(row.input.training.micro_batch);
  std::sort(mbs.begin(), mbs.end());
  EXPECT_EQ(mbs.front(), 1);
  EXPECT_EQ(mbs.back(), largest);
}

TEST(Recommend, GlobalBatchSetsTheAccumulation) {
  const sim::Cluster c = sim::resolve_cluster("8xA100-80GB");
  PlanInput in = lora("llama-2-7b", 16, 2048);
  in.strategy.ranks = 8;
  SearchSpace s;
  s.global_batch = 64;
  s.gpus = {4, 8};
  const Recommendation r = recommend(in, c, s, Constraints{}, Objective::tokens_per_s);
  ASSERT_FALSE(r.ranked.empty());
  for (const auto& row : r.ranked)
    EXPECT_EQ(row.input.training.micro_batch * row.input.training.grad_accum * row.input.strategy.ranks, 64) << row.family;
}

TEST(Recommend, GpuListGrowsTheClusterByNodes) {
  const sim::Cluster c = sim::resolve_cluster("2x8xH100-SXM-NDR");
  EXPECT_EQ(cluster_for_gpus(c, 8).nodes, 2);  // fits in the cluster as it is
  const sim::Cluster big = cluster_for_gpus(c, 64);
  EXPECT_EQ(big.nodes, 8);
  EXPECT_EQ(big.gpus_per_node, 8);
  EXPECT_THROW(cluster_for_gpus(sim::resolve_cluster("8xA100-80GB"), 16), InputError);  // one node, no network
}

TEST(Recommend, ParetoFrontIsNotDominated) {
  const Recommendation r = search(lora("llama-2-13b", 16, 2048), "8xA100-80GB");
  std::size_t front = 0;
  for (const auto& a : r.ranked) {
    bool dominated = false;
    for (const auto& b : r.ranked)
      dominated |= b.used_peak_bytes <= a.used_peak_bytes && b.tokens_per_s >= a.tokens_per_s &&
                   (b.used_peak_bytes < a.used_peak_bytes || b.tokens_per_s > a.tokens_per_s);
    EXPECT_EQ(a.pareto, !dominated) << a.family << " mb " << a.input.training.micro_batch;
    front += a.pareto;
  }
  EXPECT_GE(front, 2u);
}

TEST(Recommend, ObjectivesOrderTheRows) {
  SearchSpace s;
  s.gpus = {2, 4, 8};
  const Recommendation g = search(lora("llama-2-7b", 16, 2048), "8xA100-80GB", s, Objective::gpus);
  ASSERT_FALSE(g.ranked.empty());
  EXPECT_EQ(g.ranked.front().input.strategy.ranks, 2);
  const Recommendation m = search(lora("llama-2-7b", 16, 2048), "8xA100-80GB", s, Objective::memory);
  for (std::size_t i = 1; i < m.ranked.size(); ++i) EXPECT_LE(m.ranked[i - 1].used_peak_bytes, m.ranked[i].used_peak_bytes);
  // Cost per million tokens: the catalog's A100-80GB price, GPU-hours per token.
  const Recommendation c = search(lora("llama-2-7b", 16, 2048), "8xA100-80GB", s, Objective::cost);
  ASSERT_TRUE(c.ranked.front().cost_per_mtok_usd);
  const Candidate& top = c.ranked.front();
  EXPECT_NEAR(*top.cost_per_mtok_usd, 2.45 * top.input.strategy.ranks / 3600.0 / top.tokens_per_s * 1e6, 1e-9);
  for (std::size_t i = 1; i < c.ranked.size(); ++i) EXPECT_LE(*c.ranked[i - 1].cost_per_mtok_usd, *c.ranked[i].cost_per_mtok_usd);
}

// A row or strategy that loses under another objective says so in that objective's terms: a
// cost search compares dollars per million tokens (GPU-seconds per token), not the cluster's
// tokens/s, which a row on fewer GPUs loses while it costs as much (it read "-100.0% fewer").
TEST(Recommend, ReasonsSpeakTheObjective) {
  SearchSpace s;
  s.gpus = {1, 2, 4, 8};
  const std::regex negative_fewer(R"(-[0-9.]+% fewer)");
  auto check_about_the_same = [](const std::string& reason) {  // "for about the same speed, +x%" only within the 1% tie
    const auto at = reason.find("for about the same speed, ");
    if (at == std::string::npos) return;
    EXPECT_LE(std::abs(std::stod(reason.substr(at + 26))), 1.0) << reason;
  };
  const Recommendation c = search(lora("llama-2-7b", 16, 2048), "8xA100-80GB", s, Objective::cost);
  ASSERT_GT(c.ranked.size(), 5u);
  check_about_the_same(c.ranked.front().reason);
  for (std::size_t i = 1; i < c.ranked.size(); ++i) {
    const std::string& why = c.ranked[i].reason;
    EXPECT_FALSE(std::regex_search(why, negative_fewer)) << why;
    if (*c.ranked[i].cost_per_mtok_usd > *c.ranked.front().cost_per_mtok_usd)
      EXPECT_NE(why.find("per million tokens"), std::string::npos) << why;
    else
      EXPECT_EQ(why.rfind("as good as #1 on cost, then ", 0), 0u) << why;
  }
  std::size_t fitting = 0;
  for (const auto& rj : c.rejected) {
    if (!rj.fits) continue;
    ++fitting;
    EXPECT_FALSE(std::regex_search(rj.reason, negative_fewer)) << rj.reason;
    ASSERT_TRUE(rj.best);
    if (*rj.best->cost_per_mtok_usd <= *c.ranked.front().cost_per_mtok_usd * 1.01)  // a tie as the time model resolves it
      EXPECT_EQ(rj.reason.rfind("as cheap as #1 at best (", 0), 0u) << rj.reason;
    else
      EXPECT_EQ(rj.reason.rfind("dominated: ", 0), 0u) << rj.reason;
    EXPECT_TRUE(rj.reason.find("per million tokens") != std::string::npos || rj.reason.find("as good as #1 on cost") != std::string::npos) << rj.reason;
  }
  EXPECT_GT(fitting, 0u);
  // Fewest GPUs: a row on more GPUs says how many; memory: how much more it holds.
  const Recommendation g = search(lora("llama-2-7b", 16, 2048), "8xA100-80GB", s, Objective::gpus);
  const std::int32_t fewest = g.ranked.front().input.strategy.ranks;
  for (std::size_t i = 1; i < g.ranked.size(); ++i) {
    if (g.ranked[i].input.strategy.ranks == fewest) continue;
    EXPECT_EQ(g.ranked[i].reason.rfind(fmt::format("needs {} GPUs where #1 needs {}", g.ranked[i].input.strategy.ranks, fewest), 0), 0u)
        << g.ranked[i].reason;
  }
  const Recommendation m = search(lora("llama-2-7b", 16, 2048), "8xA100-80GB", s, Objective::memory);
  for (const Recommendation* r : {&c, &g, &m}) EXPECT_FALSE(std::regex_search(r->ranked.front().reason, negative_fewer)) << r->ranked.front().reason;
  for (std::size_t i = 1; i < m.ranked.size(); ++i) {
    if (m.ranked[i].used_peak_bytes == m.ranked.front().used_peak_bytes) continue;
    EXPECT_NE(m.ranked[i].reason.find("more than #1 (at the peak: "), std::string::npos) << m.ranked[i].reason;
  }
}

// A global batch fixes each micro-batch's accumulation (up to 64 micro-steps here); the search
// plans those from the accumulation series (plan_candidate). It ranks the same rows, in the same
// order, with the same figures as when every plan is made in full.
TEST(Recommend, GlobalBatchRanksAsWithEveryPlanInFull) {
  SearchSpace s;
  s.gpus = {1, 2};
  s.global_batch = 64;
  s.threads = 2;
  const Recommendation fast = search(lora("pythia-160m", 16, 1024), "8xA100-80GB", s);
  s.accumulation_series = false;
  const Recommendation full = search(lora("pythia-160m", 16, 1024), "8xA100-80GB", s);
  ASSERT_EQ(fast.ranked.size(), full.ranked.size());
  ASSERT_GT(fast.ranked.size(), 10u);
  std::size_t long_accumulations = 0;
  for (std::size_t i = 0; i < fast.ranked.size(); ++i) {
    const Candidate& a = fast.ranked[i];
    const Candidate& b = full.ranked[i];
    SCOPED_TRACE(fmt::format("row {}: {}", i + 1, b.reason));
    EXPECT_EQ(a.family, b.family);
    EXPECT_EQ(a.input.training.micro_batch, b.input.training.micro_batch);
    EXPECT_EQ(a.input.training.grad_accum, b.input.training.grad_accum);
    EXPECT_EQ(a.input.strategy.ranks, b.input.strategy.ranks);
    EXPECT_EQ(a.used_peak_bytes, b.used_peak_bytes);
    EXPECT_NEAR(a.tokens_per_s, b.tokens_per_s, 1e-6 * b.tokens_per_s);
    EXPECT_EQ(a.reason, b.reason);
    long_accumulations += b.input.training.grad_accum >= kAccumulationSeriesFrom;
  }
  EXPECT_GT(long_accumulations, 0u);
  EXPECT_EQ(fast.summary, full.summary);
}

TEST(Recommend, NothingFitsNamesTheSmallestShortfall) {
  SearchSpace s;
  s.gpus = {1};
  s.offload = false;
  const Recommendation r = search(lora("llama-2-70b", 16, 4096), "8xA100-80GB", s);
  EXPECT_TRUE(r.ranked.empty());
  EXPECT_NE(r.summary.find("nothing fits: the closest is"), std::string::npos) << r.summary;
  EXPECT_NE(r.summary.find("short by"), std::string::npos);
  // What to try outside the search, as knobs (the CLI spells them as flags).
  const std::vector<Suggestion> want = {{Knob::search_gpus, Change::larger, "", ""},
                                        {Knob::quantization, Change::set, "nf4", "a quantised base, QLoRA"},
                                        {Knob::search_offload, Change::set, "", ""},
                                        {Knob::seq_len, Change::smaller, "", ""}};
  EXPECT_EQ(r.suggestions, want);
  EXPECT_EQ(suggestion_text(std::span<const Suggestion>(r.suggestions).first(2)),
            "try a larger space.gpus or peft.quantization nf4 (a quantised base, QLoRA)");
}

TEST(Recommend, ContradictionsAreInputErrors) {
  const sim::Cluster c = sim::resolve_cluster("8xA100-80GB");
  PlanInput in = lora("llama-2-7b", 16, 2048);
  in.strategy.ranks = 8;
  SearchSpace s;
  s.gpus = {8};
  Constraints k;
  k.max_gpus = 4;
  EXPECT_THROW(recommend(in, c, s, k, Objective::tokens_per_s), InputError);  // --max-gpus below every count
  SearchSpace g;
  g.global_batch = 4;  // below one sequence per GPU on 8 GPUs
  EXPECT_THROW(recommend(in, c, g, Constraints{}, Objective::tokens_per_s), InputError);
  SearchSpace st;
  st.stages = {Stage::fsdp_full_shard};  // the deepspeed profile plans no FSDP
  EXPECT_THROW(recommend(in, c, st, Constraints{}, Objective::tokens_per_s), InputError);
  sim::Cluster nop = c;
  nop.gpu.cost_per_hour_usd.reset();
  EXPECT_THROW(recommend(in, nop, {}, Constraints{}, Objective::cost), InputError);
}

// --- the command ------------------------------------------------------------------------------

using peftplan::testing::run_cli;

TEST(RecommendCli, RangesAndBadInput) {
  struct Case {
    std::string args, expect;
  };
  const std::string base = "recommend --model llama-2-7b --lora-r 16 --cluster 8xA100-80GB ";
  const Case cases[] = {
      {base + "--gpus 8..2", "--gpus: range 8..2 runs backwards"},
      {base + "--gpus 1..8:x1", "--gpus: a range's factor xF must be at least 2"},
      {base + "--gpus 2,,4", "--gpus: must be a comma list with no empty entries"},
      {base + "--gpus abc", "--gpus: must be a comma list of positive integers or ranges"},
      {base + "--gpus 16", "space.gpus must not exceed the cluster's 8 GPUs"},
      {base + "--strategy zero4", "--strategy: must be a comma list of ddp, zero1"},
      {base + "--checkpointing every-0", "--checkpointing: must be a comma list of none, full and every-K"},
      {base + "--objective speed", "--objective: must be one of tokens-per-s, gpus, cost, memory"},
      {base + "--max-gpus 4", "constraints.max_gpus 4 leaves no GPU count of space.gpus to search"},
      {base + "--global-batch 4", "space.global_batch 4 with space.min_micro_batch 1: even 8 GPU(s) need at least 8 sequences per step (space.global_batch is --global-batch; space.min_micro_batch is --min-micro-batch)"},
      {base + "--profile deepspeed --strategy fsdp-full-shard", "the search space is empty"},
  };
  for (const auto& c : cases) {
    const auto r = run_cli(c.args);
    EXPECT_EQ(r.code, 2) << c.args << "\n" << r.out;
    EXPECT_NE(r.out.find(c.expect), std::string::npos) << c.args << "\n" << r.out;
    EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 1) << r.out;
  }
}

// A listed FSDP strategy without --profile is searched under hf, the profile that runs it, beside
// the deepspeed families of the others (as plan plans --strategy fsdp-* without --profile).
TEST(Recommend, ListedFsdpWithoutAProfileIsSearchedUnderHf) {
  const auto r = run_cli("recommend --model llama-2-7b --lora-r 16 --cluster 8xA100-80GB --strategy zero2,fsdp-full-shard --json");
  ASSERT_EQ(r.code, 0) << r.out;
  const nlohmann::json j = nlohmann::json::parse(r.out.substr(r.out.find('{')));
  std::set<std::string> profiles;
  for (const auto& row : j["ranked"]) profiles.insert(row["profile"].get<std::string>());
  EXPECT_EQ(profiles, (std::set<std::string>{"deepspeed", "hf"})) << r.out.substr(0, 2000);
}

// recommend --json read back: a file of another kind, or one with a field of the wrong type, is
// refused naming the file and the field.
TEST(Recommend, JsonReaderNamesTheFieldItRefuses) {
  auto message = [](const nlohmann::json& j) {
    try {
      peftplan::planner::recommendation_from_json(j, "rec.json");
    } catch (const peftplan::InputError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(message(nlohmann::json{{"schema", "peftplan.validation/2"}}),
            "rec.json: schema must be \"peftplan.recommendation/3\" (peftplan recommend --json), got \"peftplan.validation/2\"");
  auto j = nlohmann::json::parse(run_cli("recommend --model llama-2-7b --lora-r 16 --cluster 8xA100-80GB --top 2 --json").out);
  j["ranked"][1]["micro_batch"] = "4";
  EXPECT_EQ(message(j), "rec.json: ranked[1].micro_batch must be a positive integer, got \"4\"");
  j["ranked"][1]["micro_batch"] = 4;
  j["ranked"][0]["checkpointing"] = "every-0";
  EXPECT_EQ(message(j), "rec.json: ranked[0].checkpointing must be none, full or every-K, got \"every-0\"");
  j["ranked"][0]["checkpointing"] = "none";
  j["rejected"][0]["suggestions"] = nlohmann::json::array({{{"knob", "nonsense"}, {"change", "set"}}});
  EXPECT_EQ(message(j), "rec.json: rejected[0].suggestions[0].knob must name a knob (a PlanInput field, such as strategy.stage), got \"nonsense\"");
}

TEST(RecommendCli, JsonAndExitCodes) {
  auto r = run_cli("recommend --model llama-2-7b --lora-r 16 --cluster 8xA100-80GB --gpus 2,4..8:x2 --top 3 --json");
  ASSERT_EQ(r.code, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["schema"], "peftplan.recommendation/3");
  EXPECT_EQ(j["ranked"].size(), 3u);
  for (const char* k : {"strategy", "micro_batch", "grad_accum", "checkpointing", "gpus", "used_peak_bytes", "spare_bytes", "step_s", "tokens_per_s",
                        "exposed_comm_s", "mfu", "cost_per_million_tokens_usd", "pareto", "reason"})
    EXPECT_TRUE(j["ranked"][0].contains(k)) << k;
  EXPECT_FALSE(j["rejected"].empty());
  // What the search was of, for a report read back from the file (8 x A100-80GB: 80 GiB each).
  EXPECT_EQ(j["model"], "llama-2-7b");
  EXPECT_EQ(j["capacity_bytes"], 80ull << 30);
  EXPECT_DOUBLE_EQ(j["headroom_fraction"].get<double>(), 0.05);
  // Read back, it writes itself again field for field (the report's source is the file).
  const auto back = peftplan::planner::recommendation_from_json(j, "rec.json");
  EXPECT_EQ(peftplan::planner::recommendation_to_json(back, 3), j);
  // Nothing fits: exit code 1.
  r = run_cli("recommend --model llama-2-70b --lora-r 16 --seq-len 4096 --cluster 8xA100-80GB --gpus 1 --no-offload");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.out.find("nothing fits"), std::string::npos) << r.out;
  // What to try, in recommend's own flags: the search's GPU counts and offload, not plan's.
  EXPECT_NE(r.out.find("try a larger --gpus or --quant nf4 (a quantised base, QLoRA) or offload in the search (drop --no-offload) or a "
                       "smaller --seq-len"),
            std::string::npos)
      << r.out;
}

// --emit: the files a user launches, consistent with the row.
TEST(RecommendCli, EmitWritesLaunchFilesThatReadBack) {
  const auto dir = std::filesystem::temp_directory_path() / ("peftplan-emit-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  auto r = run_cli("recommend --model llama-2-70b --lora-r 16 --seq-len 4096 --cluster 8xA100-80GB --emit " + dir.string());
  ASSERT_EQ(r.code, 0) << r.out;
  for (const char* f : {"plan.json", "ds_config.json", "accelerate_config.yaml", "adapter_config.json", "train.py", "launch.sh"})
    EXPECT_TRUE(std::filesystem::exists(dir / f)) << f;
  for (const auto& e : std::filesystem::directory_iterator(dir)) EXPECT_EQ(e.path().string().find(".tmp."), std::string::npos) << e.path();
  // train.py compiles.
  EXPECT_EQ(std::system(("python3 -m py_compile " + (dir / "train.py").string()).c_str()), 0);
  // The ds_config reads back into the same plan: `plan --ds-config` gives #1's numbers.
  auto j = nlohmann::json::parse(run_cli("recommend --model llama-2-70b --lora-r 16 --seq-len 4096 --cluster 8xA100-80GB --top 1 --json").out);
  const auto& top = j["ranked"][0];
  auto p = run_cli("plan --model llama-2-70b --lora-r 16 --seq-len 4096 --cluster 8xA100-80GB --eval-batch 0 --checkpointing " +
                   top["checkpointing"].get<std::string>() + " --ds-config " + (dir / "ds_config.json").string() + " --json");
  ASSERT_EQ(p.code, 0) << p.out;
  const auto pj = nlohmann::json::parse(p.out);
  EXPECT_EQ(pj["strategy"], top["strategy"]);
  EXPECT_EQ(pj["memory"]["device"]["used_peak_bytes"], top["used_peak_bytes"]);
  // Every key is one of DeepSpeed's own (the reader's key lists are DeepSpeed's config models:
  // deepspeed/runtime/config.py, runtime/zero/config.py), none set away from what the plan says.
  for (const auto& w : pj["warnings"]) EXPECT_EQ(w.get<std::string>().find("ds_config"), std::string::npos) << w;
  EXPECT_DOUBLE_EQ(pj["time"]["step_s"].get<double>(), top["step_s"].get<double>());
  // adapter_config.json is PEFT's format, ready to train from.
  std::ifstream a(dir / "adapter_config.json");
  const auto aj = nlohmann::json::parse(a);
  EXPECT_EQ(aj["peft_type"], "LORA");
  EXPECT_EQ(aj["r"], 16);
  EXPECT_EQ(aj["inference_mode"], false);
  EXPECT_EQ(aj["base_model_name_or_path"], "meta-llama/Llama-2-70b-hf");
  // launch.sh: a shell script with the three launchers and the twin.
  std::ifstream l(dir / "launch.sh");
  const std::string sh((std::istreambuf_iterator<char>(l)), std::istreambuf_iterator<char>());
  for (const char* s : {"accelerate launch --config_file accelerate_config.yaml", "deepspeed --num_nodes 1 --num_gpus 8", "torchrun --nnodes 1",
                        "peftplan run --model tiny-llama-4l --strategy zero3"})
    EXPECT_NE(sh.find(s), std::string::npos) << s;
  EXPECT_EQ(std::system(("sh -n " + (dir / "launch.sh").string()).c_str()), 0);
  std::filesystem::remove_all(dir);
}

// An FSDP row (--profile hf) emits accelerate's FSDP YAML, which reads back as the same strategy.
TEST(RecommendCli, EmitFsdpWritesTheAccelerateYaml) {
  const auto dir = std::filesystem::temp_directory_path() / ("peftplan-emit-fsdp-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  auto r = run_cli("recommend --profile hf --model llama-2-70b --lora-r 16 --seq-len 4096 --cluster 8xA100-80GB --strategy fsdp-full-shard "
                   "--no-offload --emit " + dir.string() + " --json");
  ASSERT_EQ(r.code, 0) << r.out;
  const auto top = nlohmann::json::parse(r.out)["ranked"][0];
  EXPECT_FALSE(std::filesystem::exists(dir / "ds_config.json"));
  auto p = run_cli("plan --model llama-2-70b --lora-r 16 --seq-len 4096 --cluster 8xA100-80GB --eval-batch 0 --micro-batch " +
                   std::to_string(top["micro_batch"].get<int>()) + " --checkpointing " + top["checkpointing"].get<std::string>() +
                   " --accelerate-config " + (dir / "accelerate_config.yaml").string() + " --json");
  ASSERT_EQ(p.code, 0) << p.out;
  const auto pj = nlohmann::json::parse(p.out);
  EXPECT_EQ(pj["strategy"], "fsdp-full-shard");
  EXPECT_EQ(pj["memory"]["device"]["used_peak_bytes"], top["used_peak_bytes"]);
  EXPECT_EQ(std::system(("python3 -m py_compile " + (dir / "train.py").string()).c_str()), 0);
  std::filesystem::remove_all(dir);
}

// The launch files are one output: one that cannot be written (launch.sh a link into a folder
// that does not exist) leaves none of the others; an earlier plan's file that this plan does not
// write (ds_config.json beside an FSDP plan) is pointed out, not removed.
TEST(RecommendCli, EmitWritesAllTheFilesOrNone) {
  const auto dir = std::filesystem::temp_directory_path() / ("peftplan-emit-together-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  std::filesystem::create_symlink(dir / "no-such-folder" / "launch.sh", dir / "launch.sh");
  const std::string flags = "recommend --profile hf --model llama-2-7b --lora-r 16 --cluster 8xA100-80GB --strategy fsdp-full-shard "
                            "--no-offload --top 1 --emit " + dir.string();
  auto r = run_cli(flags);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("(nothing was written)"), std::string::npos) << r.out;
  for (const char* f : {"plan.json", "accelerate_config.yaml", "adapter_config.json", "train.py"}) EXPECT_FALSE(std::filesystem::exists(dir / f)) << f;
  for (const auto& e : std::filesystem::directory_iterator(dir)) EXPECT_EQ(e.path().string().find(".tmp."), std::string::npos) << e.path();
  std::filesystem::remove(dir / "launch.sh");
  std::ofstream(dir / "ds_config.json") << "{}\n";  // an earlier DeepSpeed plan's
  r = run_cli(flags);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("note: " + dir.string() + " still holds ds_config.json from an earlier plan, which this one does not use"), std::string::npos)
      << r.out;
  EXPECT_TRUE(std::filesystem::exists(dir / "ds_config.json"));
  EXPECT_TRUE(std::filesystem::exists(dir / "plan.json"));
  std::filesystem::remove_all(dir);
}

// A DDP row under the hf profile is launched by accelerate (its MULTI_GPU YAML, as --emit writes):
// plan.json says so with accelerate's YAML, not a ds_config.json nobody runs, and reads back into
// the same plan.
TEST(PlanFile, HfDdpIsWrittenAsTheAccelerateYamlAndReadsBack) {
  const auto dir = std::filesystem::temp_directory_path() / ("peftplan-planfile-hf-ddp-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "plan.json").string();
  auto r = run_cli("plan --profile hf --gpus 2 --cluster 2xA100-80GB --micro-batch 2 --write-plan " + path + " --json");
  ASSERT_EQ(r.code, 0) << r.out;
  const auto planned = nlohmann::json::parse(r.out);
  const nlohmann::json file = models::read_json_file(path);
  EXPECT_FALSE(file.contains("ds_config")) << file.dump();
  ASSERT_TRUE(file.contains("accelerate_config")) << file.dump();
  EXPECT_NE(file["accelerate_config"].get<std::string>().find("distributed_type: MULTI_GPU"), std::string::npos);
  const PlanFile back = read_plan_file(path);
  EXPECT_EQ(back.input.profile, RuntimeProfile::hf);
  EXPECT_EQ(back.input.strategy.stage, Stage::ddp);
  EXPECT_EQ(back.input.strategy.ranks, 2);
  EXPECT_EQ(back.input.training.micro_batch, 2);
  const Plan p = make_plan(back.input, *back.cluster);
  EXPECT_EQ(p.used_peak_bytes, planned["memory"]["device"]["used_peak_bytes"].get<std::uint64_t>());
  std::filesystem::remove_all(dir);
}

// --- sweep ------------------------------------------------------------------------------------

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> out;
  std::size_t at = 0;
  for (std::size_t nl; (nl = text.find('\n', at)) != std::string::npos; at = nl + 1) out.push_back(text.substr(at, nl - at));
  return out;
}

TEST(SweepCli, GridRowsAreThePlans) {
  const auto r = run_cli("sweep --model llama-2-7b --lora-r 16 --strategy ddp,zero3 --micro-batch 1..4:x2 --offload-param none,cpu --format jsonl");
  ASSERT_EQ(r.code, 0) << r.out;
  const auto lines = lines_of(r.out);
  ASSERT_EQ(lines.size(), 2u * 3u * 2u);  // strategy x micro-batch x offload-param, the last varying fastest
  const auto first = nlohmann::json::parse(lines[0]);
  EXPECT_EQ(first["schema"], "peftplan.sweep/2");
  EXPECT_EQ(first["--strategy"], "ddp");
  EXPECT_EQ(first["--micro-batch"], "1");
  EXPECT_EQ(first["--offload-param"], "none");
  EXPECT_EQ(nlohmann::json::parse(lines[1])["--offload-param"], "cpu");
  // ddp with parameter offload is refused by the planner: a row with its error, not a failed sweep.
  EXPECT_NE(nlohmann::json::parse(lines[1])["error"].get<std::string>().find("strategy.offload_param cpu: parameter offload needs sharded parameters"),
            std::string::npos);
  EXPECT_TRUE(nlohmann::json::parse(lines[1])["used_peak_bytes"].is_null());
  // A row holds what plan --json says for the same flags.
  const auto row = nlohmann::json::parse(lines[2 * 3 + 2 * 1 + 1]);  // zero3, micro-batch 2, offload cpu
  EXPECT_EQ(row["--strategy"], "zero3");
  EXPECT_EQ(row["--micro-batch"], "2");
  const auto p = nlohmann::json::parse(run_cli("plan --model llama-2-7b --lora-r 16 --strategy zero3 --micro-batch 2 --offload-param cpu --json").out);
  EXPECT_EQ(row["used_peak_bytes"], p["memory"]["device"]["used_peak_bytes"]);
  EXPECT_EQ(row["activations_bytes"], p["memory"]["device"]["activations_bytes"]);
  EXPECT_EQ(row["all_gather_bytes"], p["comm"]["all_gather_bytes"]);
  EXPECT_DOUBLE_EQ(row["step_s"].get<double>(), p["time"]["step_s"].get<double>());
}

TEST(SweepCli, CsvHasASchemaCommentAndStableColumns) {
  const auto dir = std::filesystem::temp_directory_path() / ("peftplan-sweep-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const auto out = dir / "grid.csv";
  auto r = run_cli("sweep --model llama-2-7b --lora-r 8,16 --seq-len 1024..4096:x2 --out " + out.string());
  ASSERT_EQ(r.code, 0) << r.out;
  std::ifstream f(out);
  const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const auto lines = lines_of(text);
  ASSERT_EQ(lines.size(), 2u + 2u * 3u);
  EXPECT_EQ(lines[0].rfind("# peftplan.sweep/2: ", 0), 0u) << lines[0];
  EXPECT_EQ(lines[1].rfind("--lora-r,--seq-len,model,strategy,ranks,profile,cluster,fits,base_weights_bytes,", 0), 0u) << lines[1];
  EXPECT_EQ(lines[2].rfind("8,1024,llama-2-7b,ddp,8,", 0), 0u) << lines[2];
  EXPECT_EQ(lines.back().rfind("16,4096,", 0), 0u) << lines.back();
  for (const auto& e : std::filesystem::directory_iterator(dir)) EXPECT_EQ(e.path().string().find(".tmp."), std::string::npos);
  std::filesystem::remove_all(dir);
  // The same header whatever the values.
  const auto again = lines_of(run_cli("sweep --model llama-2-13b --lora-r 4,32 --seq-len 512,8192").out);
  EXPECT_EQ(again[1], lines[1]);
}

// A combination the planner refuses is a row with its error, the sweep goes on (exit 0):
// parameter offload needs ZeRO-3, so the ddp rows carry the refusal and the zero3 rows plan.
TEST(SweepCli, RefusedCombinationsAreRowsWithTheirError) {
  const auto r = run_cli("sweep --model llama-2-7b --strategy ddp,zero3 --offload-param cpu --format jsonl");
  ASSERT_EQ(r.code, 0) << r.out;
  const auto lines = lines_of(r.out);
  ASSERT_EQ(lines.size(), 2u) << r.out;
  const auto ddp = nlohmann::json::parse(lines[0]), z3 = nlohmann::json::parse(lines[1]);
  EXPECT_TRUE(ddp["error"].is_string()) << lines[0];
  EXPECT_TRUE(z3["error"].is_null()) << lines[1];
  EXPECT_TRUE(z3["fits"].is_boolean());
}

// --quant none is the default spelled out, so a grid compares a base with and without QLoRA.
TEST(SweepCli, QuantNoneIsTheUnquantisedBase) {
  const auto r = run_cli("sweep --model llama-2-7b --lora-r 16 --quant none,nf4 --format jsonl");
  ASSERT_EQ(r.code, 0) << r.out;
  const auto lines = lines_of(r.out);
  ASSERT_EQ(lines.size(), 2u) << r.out;
  const auto none = nlohmann::json::parse(lines[0]), nf4 = nlohmann::json::parse(lines[1]);
  const auto p = nlohmann::json::parse(run_cli("plan --model llama-2-7b --lora-r 16 --json").out);
  EXPECT_EQ(none["base_weights_bytes"], p["memory"]["device"]["base_weights_bytes"]);
  EXPECT_EQ(none["used_peak_bytes"], p["memory"]["device"]["used_peak_bytes"]);
  EXPECT_LT(nf4["base_weights_bytes"].get<std::uint64_t>(), none["base_weights_bytes"].get<std::uint64_t>() / 3);
  const auto dq = run_cli("plan --quant none --double-quant");
  EXPECT_EQ(dq.code, 2) << dq.out;
  EXPECT_NE(dq.out.find("--double-quant needs --quant nf4 or --quant fp4"), std::string::npos) << dq.out;
  const auto bad = run_cli("plan --quant nf5");
  EXPECT_EQ(bad.code, 2) << bad.out;
  EXPECT_NE(bad.out.find("--quant: must be nf4, fp4, int8 or none, got \"nf5\""), std::string::npos) << bad.out;
}

TEST(SweepCli, BadGridsAreInputErrors) {
  struct Case {
    std::string args, expect;
  };
  const Case cases[] = {
      {"sweep --micro-batch 4..1", "--micro-batch: range 4..1 runs backwards"},
      {"sweep --micro-batch 1..2:x", "--micro-batch: must be a comma list of positive integers or ranges"},
      {"sweep --no-such-flag 3", "sweep: --no-such-flag is not a plan flag"},
      {"sweep --strategy ddp,,zero3", "--strategy: must be a comma list with no empty entries"},
      {"sweep --format xml", "--format: must be csv or jsonl"},
      {"sweep --seq-len 1..2000000", "--seq-len: lists more than 4096 values"},
      {"sweep --micro-batch", "sweep: --micro-batch needs a value"},
      // A value the planner refuses for itself wherever it appears, not a combination.
      {"sweep --strategy ddp,zero9 --micro-batch 1,2", "--strategy: must be one of ddp, zero1"},
      {"sweep --micro-batch 1,2 --precision bf16,fp9", "--precision: "},
      // Every configuration refused (combinations, not a value of one flag): no table at all.
      {"sweep --strategy ddp,zero1 --offload-param cpu", "sweep: the planner refused every configuration (2); the first: strategy.offload_param cpu"},
  };
  for (const auto& c : cases) {
    const auto r = run_cli(c.args);
    EXPECT_EQ(r.code, 2) << c.args << "\n" << r.out;
    EXPECT_NE(r.out.find(c.expect), std::string::npos) << c.args << "\n" << r.out;
  }
}

}  // namespace

// --- explain ----------------------------------------------------------------------------------

using sim::MemCategory;

namespace {

// The formula's numbers, multiplied out: "3 × 2·4,096 × 8 B" -> 196,608.
std::uint64_t evaluate(std::string numbers) {
  std::uint64_t product = 1;
  std::string digits;
  auto flush = [&] {
    if (!digits.empty()) product *= std::stoull(digits);
    digits.clear();
  };
  for (char c : numbers) {
    if (std::isdigit(static_cast<unsigned char>(c))) digits += c;
    else if (c != ',') flush();
  }
  flush();
  return product;
}

// Every line of explain adds up to the walk, category by category, and every formula shown
// evaluates to its buffers' size, across profiles, strategies, checkpointing and quantisation.
TEST(Explain, LinesAreTheWalk) {
  struct Case {
    std::string model;
    Stage stage;
    RuntimeProfile profile;
    Checkpointing ckpt;
    bool nf4;
  };
  const Case cases[] = {
      {"llama-2-7b", Stage::ddp, RuntimeProfile::deepspeed, Checkpointing::none, false},
      {"llama-2-7b", Stage::zero3, RuntimeProfile::deepspeed, Checkpointing::none, false},
      {"llama-2-13b", Stage::zero2, RuntimeProfile::deepspeed, Checkpointing::full, false},
      {"mistral-7b", Stage::fsdp_full_shard, RuntimeProfile::hf, Checkpointing::full, true},
      {"mixtral-8x7b", Stage::zero3, RuntimeProfile::deepspeed, Checkpointing::full, false},
      {"tiny-llama-4l", Stage::zero3, RuntimeProfile::executor, Checkpointing::none, false},
  };
  const sim::Cluster c = sim::resolve_cluster("8xA100-80GB");
  for (const auto& k : cases) {
    PlanInput in = lora(k.model, 16, 2048);
    in.strategy.ranks = 8;
    in.strategy.stage = k.stage;
    in.profile = k.profile;
    in.training.checkpointing = k.ckpt;
    in.training.micro_batch = 2;
    if (k.profile == RuntimeProfile::executor) in.training.attention = Attention::eager;
    if (k.nf4) {
      models::Quantization q;
      q.dtype = DType::nf4;
      q.double_quant = true;
      in.peft.quantization = q;
    }
    const Plan p = make_plan(in, c);
    const Explanation e = explain_plan(p);
    std::uint64_t total = 0;
    std::size_t with_formula = 0, terms = 0;
    for (const auto& cat : e.categories) {
      std::uint64_t sum = 0;
      for (const auto& t : cat.terms) {
        sum += t.bytes;
        ++terms;
        if (t.formula.empty()) continue;
        ++with_formula;
        EXPECT_EQ(evaluate(t.numbers), t.bytes_each) << k.model << " " << t.what << ": " << t.numbers;
        EXPECT_EQ(t.bytes, t.bytes_each * static_cast<std::uint64_t>(t.count)) << t.what;
      }
      EXPECT_EQ(sum, cat.at_peak_bytes) << k.model << " " << sim::name_of(cat.category);
      EXPECT_EQ(cat.at_peak_bytes, p.memory.at_peak_bytes[static_cast<std::size_t>(cat.category)]);
      total += sum;
    }
    EXPECT_EQ(total, p.memory.device_peak_bytes) << k.model;
    EXPECT_GT(with_formula * 2, terms) << k.model << ": most kinds of buffer get a formula";
  }
}

TEST(Explain, NamesTheShapesAndTheirSources) {
  const sim::Cluster c = sim::resolve_cluster("8xA100-80GB");
  PlanInput in = lora("llama-2-7b", 16, 4096);
  in.strategy.ranks = 8;
  in.strategy.stage = Stage::zero3;
  in.training.micro_batch = 2;
  const Explanation e = explain_plan(make_plan(in, c));
  auto term = [&](MemCategory cat, const std::string& what) -> const ExplainTerm& {
    for (const auto& ec : e.categories)
      if (ec.category == cat)
        for (const auto& t : ec.terms)
          if (t.what == what) return t;
    throw std::runtime_error("no " + what);
  };
  // SwiGLU's saved SiLU: B·S·I in bf16 per layer, 32 layers (Llama-2-7B: I = 11,008).
  const auto& silu = term(MemCategory::activations, "layers.N.mb0.mlp.silu");
  EXPECT_EQ(silu.count, 32);
  EXPECT_EQ(silu.formula, "B·S·I × 2 B (bf16)");
  EXPECT_EQ(silu.numbers, "2·4,096·11,008 × 2 B");
  EXPECT_NE(silu.source.find("SiLU"), std::string::npos);
  // The fp32 logits of the loss: B·S·V × 4 B.
  EXPECT_EQ(term(MemCategory::workspace, "loss.mb0.logits_fp32").formula, "B·S·V × 4 B (fp32)");
  // ZeRO-3's optimizer states: K = 12 over 8 ranks, the paper's formula, equal to the walk.
  for (const auto& ec : e.categories)
    if (ec.category == MemCategory::optimizer_states) {
      EXPECT_NE(ec.closed_form.find("12 B × 8,388,608 / 8 ranks = 12.0 MiB"), std::string::npos) << ec.closed_form;
      EXPECT_NE(ec.closed_form.find("ZeRO paper §3.1"), std::string::npos);
      EXPECT_NE(ec.closed_form.find("the walk holds exactly this"), std::string::npos);
    }
}

// A frozen weight is named by its own shape even where its size is a multiple of the trainable
// count: Llama-2-7B's q_proj is H·H = 16,777,216 = 2 × Ψt at r 16 on q and v (it read
// "2 × Ψt × 2 B").
TEST(Explain, FrozenWeightsAreTheirShapesNotMultiplesOfTheTrainableCount) {
  const sim::Cluster c = sim::resolve_cluster("8xA100-80GB");
  PlanInput in = lora("llama-2-7b", 16, 2048);
  in.strategy.ranks = 8;
  in.strategy.stage = Stage::zero2;
  const Explanation e = explain_plan(make_plan(in, c));
  ASSERT_EQ(in.model.hidden * in.model.hidden, 2 * make_plan(in, c).facts.trainable_params);  // the coincidence this guards
  std::size_t seen = 0;
  for (const auto& ec : e.categories) {
    if (ec.category != MemCategory::base_weights) continue;
    for (const auto& t : ec.terms) {
      EXPECT_EQ(t.formula.find("Ψt"), std::string::npos) << t.what << ": " << t.formula;
      if (t.what == "model.layers.N.self_attn.q_proj.weight" || t.what == "model.layers.N.self_attn.k_proj.weight") {
        EXPECT_EQ(t.formula, "H·H × 2 B (bf16)") << t.what;
        ++seen;
      }
    }
  }
  EXPECT_EQ(seen, 2u);
}

TEST(ExplainCli, PrintsAndJson) {
  auto r = run_cli("explain --model llama-2-7b --lora-r 16 --micro-batch 2 --seq-len 4096 --strategy zero3");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("optimizer_states = 12.0 MiB at the peak"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("32 × 172.0 MiB, each B·S·I × 2 B (bf16) = 2·4,096·11,008 × 2 B"), std::string::npos) << r.out;
  r = run_cli("explain --model llama-2-7b --lora-r 16 --json");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_FALSE(nlohmann::json::parse(r.out)["categories"].empty());
  r = run_cli("explain --model llama-2-70b --lora-r 16 --seq-len 4096");  // does not fit: exit 1, as plan
  EXPECT_EQ(r.code, 1);
}

}  // namespace

// bitsandbytes' 8-bit AdamW is a GPU kernel (functional.py optimizer_update_8bit_blockwise
// checks is_on_gpu): no family that steps the optimizer on the host is planned, each says why,
// and a plan that does not fit is not told to offload its optimizer.
TEST(Recommend, EightBitAdamWIsNeverSteppedOnTheHost) {
  PlanInput in = lora("llama-2-7b", 16, 1024);
  in.training.optimizer = Optimizer::adamw_8bit;
  SearchSpace space;
  space.checkpointing = {CheckpointChoice{Checkpointing::full, 1}};
  for (RuntimeProfile p : {RuntimeProfile::deepspeed, RuntimeProfile::hf}) {
    space.profiles = {p};
    const Recommendation r = search(in, "2xA100-80GB", space);
    ASSERT_FALSE(r.ranked.empty());
    for (const Candidate& c : r.ranked) EXPECT_FALSE(steps_on_host(c.input.strategy)) << c.family;
    const std::string family = p == RuntimeProfile::hf ? "fsdp-full-shard + offload params" : "zero3 + offload optimizer + offload param";
    EXPECT_NE(rejected(r, family).reason.find("not planned: training.optimizer adamw-8bit with strategy."), std::string::npos)
        << rejected(r, family).reason;
    EXPECT_NE(rejected(r, family).reason.find("bitsandbytes' 8-bit AdamW runs only on the GPU"), std::string::npos);
  }
  in.strategy.stage = Stage::zero2;
  const auto with_8bit = fit_suggestions(sim::MemCategory::optimizer_states, in);
  for (const Suggestion& s : with_8bit) EXPECT_NE(s.knob, Knob::offload_optimizer);
  EXPECT_TRUE(std::any_of(with_8bit.begin(), with_8bit.end(), [](const Suggestion& s) { return s.knob == Knob::ranks; }));
  in.training.optimizer = Optimizer::adamw;
  const auto with_adamw = fit_suggestions(sim::MemCategory::optimizer_states, in);
  EXPECT_TRUE(std::any_of(with_adamw.begin(), with_adamw.end(), [](const Suggestion& s) { return s.knob == Knob::offload_optimizer; }));
}

// Liger's fused loss under ZeRO-3 never sees the untied head gathered (Liger-Kernel#1048): a
// chunked cross-entropy search leaves ZeRO-3 out with the reason, unless the head is tied to the
// embedding (gathered with it); a refusal of the input itself (a trainable head) is still an error.
TEST(Recommend, ChunkedCrossEntropyLeavesZeroThreeOutForAnUntiedHead) {
  PlanInput in = lora("llama-2-7b", 16, 1024);
  in.training.cross_entropy = CrossEntropy::chunked;
  SearchSpace space;
  space.checkpointing = {CheckpointChoice{Checkpointing::full, 1}};
  const Recommendation r = search(in, "2xA100-80GB", space);
  ASSERT_FALSE(r.ranked.empty());
  for (const Candidate& c : r.ranked) EXPECT_NE(c.input.strategy.stage, Stage::zero3) << c.family;
  EXPECT_NE(rejected(r, "zero3").reason.find("not planned: training.cross_entropy chunked with strategy.stage zero3"), std::string::npos)
      << rejected(r, "zero3").reason;
  PlanInput tied = lora("tiny-llama-tied", 4, 128);
  ASSERT_TRUE(tied.model.tie_embeddings);
  tied.training.cross_entropy = CrossEntropy::chunked;
  space.stages = {Stage::zero3};
  EXPECT_FALSE(search(tied, "2xA100-80GB", space).ranked.empty());
  PlanInput full = in;
  full.peft.adapters.clear();
  EXPECT_THROW(search(full, "2xA100-80GB", space), KnobError);
}

// Pure bf16: DeepSpeed runs it under ZeRO only, so a deepspeed search plans its DDP family as the
// Trainer's own DDP (the hf profile) and labels it so; searching both profiles plans DDP once.
TEST(Recommend, PureBf16DdpIsPlannedAsTheTrainersDdp) {
  PlanInput in = lora("llama-2-7b", 16, 1024);
  in.training.precision = Precision::bf16_pure;
  SearchSpace space;
  space.checkpointing = {CheckpointChoice{Checkpointing::none, 1}};
  space.offload = false;
  const Recommendation r = search(in, "2xA100-80GB", space);
  std::size_t ddp_rows = 0;
  for (const Candidate& c : r.ranked) {
    if (c.input.strategy.stage != Stage::ddp) {
      EXPECT_EQ(c.input.profile, RuntimeProfile::deepspeed) << c.family;
      continue;
    }
    ++ddp_rows;
    EXPECT_EQ(c.family, "ddp (hf)");
    EXPECT_EQ(c.input.profile, RuntimeProfile::hf);
  }
  EXPECT_GT(ddp_rows, 0u);
  space.profiles = {RuntimeProfile::deepspeed, RuntimeProfile::hf};
  const Recommendation both = search(in, "2xA100-80GB", space);
  std::set<std::string> ddp_families;
  for (const Candidate& c : both.ranked)
    if (c.input.strategy.stage == Stage::ddp) ddp_families.insert(c.family);
  EXPECT_EQ(ddp_families, std::set<std::string>{"ddp (hf)"});
}

// A reason names a small model's sizes in a unit that shows them: tiny-llama-4l's fp32 base is
// 3,215,872 B (its base_weights in `plan --profile executor`), which one decimal of GiB would
// print as "0.0 GiB".
TEST(Recommend, SmallSizesReadInTheirOwnUnit) {
  PlanInput in = lora("tiny-llama-4l", 8, 256);
  in.profile = RuntimeProfile::executor;
  in.training.precision = Precision::fp32;
  const Recommendation r = search(in, "1xA100-80GB");
  ASSERT_FALSE(r.ranked.empty());
  const std::string& why = r.ranked.front().reason;
  EXPECT_NE(why.find("base (3.1 MiB) fits"), std::string::npos) << why;
  EXPECT_FALSE(std::regex_search(why, std::regex("[^0-9.]0\\.0 GiB"))) << why;  // "80.0 GiB" is the GPU
}
