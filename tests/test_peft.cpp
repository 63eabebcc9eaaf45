// PeftSpec parsing and trainable inventories against PEFT's own printed counts.
#include <gtest/gtest.h>

#include "peftplan/common/error.h"
#include "peftplan/models/config.h"
#include "peftplan/models/peft.h"

using namespace peftplan;
using namespace peftplan::models;

namespace {

PeftSpec lora(std::int64_t r, double alpha, nlohmann::json targets, nlohmann::json extra = nlohmann::json::object()) {
  nlohmann::json c = {{"peft_type", "LORA"}, {"r", r}, {"lora_alpha", alpha}, {"target_modules", targets}};
  c.update(extra);
  return PeftSpec{{adapter_from_config(c, "test")}, std::nullopt};
}

}  // namespace

// PEFT README / print_trainable_parameters examples for Llama-2-7b, q_proj + v_proj:
// r=16: "trainable params: 8,388,608 || all params: 6,746,804,224 || trainable%: 0.1243";
// r=8:  "trainable params: 4,194,304 || all params: 6,742,609,920 || trainable%: 0.0622".
TEST(Peft, Llama2QvMatchesPeftPrintout) {
  const ModelSpec m = load_model("llama-2-7b");
  const ParamCounts c16 = count_params(m, lora(16, 32, {"q_proj", "v_proj"}));
  EXPECT_EQ(c16.trainable_params, 8'388'608);
  EXPECT_EQ(c16.all_params, 6'746'804'224);
  EXPECT_EQ(peft_summary_line(c16),
            "trainable params: 8,388,608 || all params: 6,746,804,224 || trainable%: 0.1243");
  const ParamCounts c8 = count_params(m, lora(8, 16, {"q_proj", "v_proj"}));
  EXPECT_EQ(peft_summary_line(c8), "trainable params: 4,194,304 || all params: 6,742,609,920 || trainable%: 0.0622");
}

// Llama-3-8B r=16 all-linear: 41,943,040 (PEFT printouts; r*(in+out) over q,k,v,o,gate,up,down).
TEST(Peft, AllLinearExcludesTheHead) {
  const ModelSpec m = load_model("llama-3-8b");
  EXPECT_EQ(count_params(m, lora(16, 32, "all-linear")).trainable_params, 41'943'040);
  for (const auto& t : trainable_tensors(m, lora(16, 32, "all-linear"))) EXPECT_EQ(t.name.find("lm_head"), std::string::npos);
  // Mistral-7B has the same shapes as Llama-3-8B apart from vocab: same adapter size.
  EXPECT_EQ(count_params(load_model("mistral-7b"), lora(16, 32, "all-linear")).trainable_params, 41'943'040);
}

TEST(Peft, SavedNamesAndShapes) {
  const auto rows = trainable_tensors(load_model("llama-2-7b"), lora(16, 32, {"q_proj", "v_proj"}));
  ASSERT_EQ(rows.size(), 128u);  // 32 layers x 2 modules x (A, B)
  EXPECT_EQ(rows[0].name, "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight");
  EXPECT_EQ(rows[0].shape, (std::vector<std::int64_t>{16, 4096}));
  EXPECT_EQ(rows[1].name, "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight");
  EXPECT_EQ(rows[1].shape, (std::vector<std::int64_t>{4096, 16}));
}

// GPT-2 default target c_attn (Conv1D 768 -> 2304), r=8: 12 * 8 * (768 + 2304) = 294,912.
TEST(Peft, Gpt2DefaultTargetIsCAttn) {
  const ModelSpec m = load_model("gpt2");
  PeftSpec spec{{adapter_from_config({{"peft_type", "LORA"}, {"r", 8}}, "test")}, std::nullopt};
  EXPECT_EQ(count_params(m, spec).trainable_params, 294'912);
}

TEST(Peft, RankPatternLayersAndRegex) {
  const ModelSpec m = load_model("llama-2-7b");
  // rank_pattern {"v_proj": 4}: q keeps r=16 (16*8192*32), v gets 4 (4*8192*32).
  auto spec = lora(16, 32, {"q_proj", "v_proj"}, {{"rank_pattern", {{"v_proj", 4}}}});
  EXPECT_EQ(count_params(m, spec).trainable_params, 16 * 8192 * 32 + 4 * 8192 * 32);
  // layers_to_transform [0, 1]: two layers only.
  spec = lora(16, 32, {"q_proj", "v_proj"}, {{"layers_to_transform", {0, 1}}});
  EXPECT_EQ(count_params(m, spec).trainable_params, 2 * 2 * 16 * 8192);
  // A regex is matched with re.fullmatch against the module path.
  spec = lora(8, 16, R"(.*\.layers\.(0|1)\.self_attn\.(q|v)_proj)");
  EXPECT_EQ(count_params(m, spec).trainable_params, 2 * 2 * 8 * 8192);
  // alpha_pattern and rsLoRA change scale, not size.
  spec = lora(16, 32, {"q_proj"}, {{"use_rslora", true}, {"alpha_pattern", {{"q_proj", 64}}}});
  const auto mods = lora_modules(m, spec);
  ASSERT_FALSE(mods.empty());
  EXPECT_DOUBLE_EQ(mods[0].scale, 64.0 / 4.0);
}

// Nested stars before a literal send a backtracking engine into time exponential in the module
// path: with std::regex, planning tiny-llama-4l with target_modules "(.*.*)*xq" ran past a minute.
// RE2 matches in time linear in the path (github.com/google/re2/wiki/WhyRE2), so every one of
// Llama-2-7B's module paths is matched at once (ctest's timeout is the check).
TEST(Peft, NestedStarPatternsMatchInLinearTime) {
  const ModelSpec m = load_model("llama-2-7b");
  // q_proj in each of the 32 layers: r x (4096 in + 4096 out), as in Llama2QvMatchesPeftPrintout.
  EXPECT_EQ(count_params(m, lora(8, 16, "(.*.*)*q_proj")).trainable_params, 8 * 8192 * 32);
  try {
    count_params(m, lora(8, 16, "(.*.*)*xq"));
    FAIL();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("(.*.*)*xq"), std::string::npos) << e.what();
  }
}

TEST(Peft, DoraBiasAndModulesToSave) {
  const ModelSpec m = load_model("llama-2-7b");
  // DoRA adds one magnitude per output feature: 64 modules x 4096.
  EXPECT_EQ(count_params(m, lora(16, 32, {"q_proj", "v_proj"}, {{"use_dora", true}})).trainable_params,
            8'388'608 + 64 * 4096);
  // modules_to_save ["lm_head"]: a trainable copy [32000, 4096] that also adds to all params.
  const ParamCounts c = count_params(m, lora(16, 32, {"q_proj", "v_proj"}, {{"modules_to_save", {"lm_head"}}}));
  EXPECT_EQ(c.trainable_params, 8'388'608 + 32000LL * 4096);
  EXPECT_EQ(c.all_params, 6'746'804'224 + 32000LL * 4096);
  // bias="all" on GPT-2 trains every existing bias without adding parameters.
  const ModelSpec g = load_model("gpt2");
  const ParamCounts b = count_params(g, lora(8, 16, {"c_attn"}, {{"bias", "all"}}));
  const ParamCounts n = count_params(g, lora(8, 16, {"c_attn"}));
  EXPECT_EQ(b.all_params, n.all_params);
  // GPT-2 biases: per layer 3H + H + 4H + H (linears) + 2H (norms) = 11H; plus ln_f bias H.
  EXPECT_EQ(b.trainable_params - n.trainable_params, 12 * 11 * 768 + 768);
}

// IA3 on Llama-2-7b with PEFT's defaults (k_proj, v_proj, down_proj; down_proj feed-forward):
// 32 * (4096 + 4096 + 11008) = 614,400. Prompt tuning with 20 virtual tokens: 20 * 4096 = 81,920;
// prefix tuning without projection: 20 * 32 * 2 * 4096 = 5,242,880.
TEST(Peft, Ia3AndPromptLearning) {
  const ModelSpec m = load_model("llama-2-7b");
  PeftSpec ia3{{adapter_from_config({{"peft_type", "IA3"}}, "test")}, std::nullopt};
  EXPECT_EQ(count_params(m, ia3).trainable_params, 614'400);
  PeftSpec prompt{{adapter_from_config({{"peft_type", "PROMPT_TUNING"}, {"num_virtual_tokens", 20}}, "t")}, std::nullopt};
  EXPECT_EQ(count_params(m, prompt).trainable_params, 81'920);
  PeftSpec prefix{{adapter_from_config({{"peft_type", "PREFIX_TUNING"}, {"num_virtual_tokens", 20}}, "t")}, std::nullopt};
  EXPECT_EQ(count_params(m, prefix).trainable_params, 5'242'880);
}

TEST(Peft, SeveralAdaptersAtOnce) {
  const ModelSpec m = load_model("llama-2-7b");
  AdapterSpec a = adapter_from_config({{"peft_type", "LORA"}, {"r", 16}, {"target_modules", {"q_proj", "v_proj"}}}, "a");
  AdapterSpec b = adapter_from_config({{"peft_type", "LORA"}, {"r", 8}, {"target_modules", {"q_proj", "v_proj"}}}, "b");
  a.name = "first";
  b.name = "second";
  PeftSpec spec{{a, b}, std::nullopt};
  EXPECT_EQ(count_params(m, spec).trainable_params, 8'388'608 + 4'194'304);
  const auto rows = trainable_tensors(m, spec);
  EXPECT_EQ(rows[0].name, "base_model.model.model.layers.0.self_attn.q_proj.lora_A.first.weight");
}

// PEFT's BaseTuner.inject_adapter raises only when no module was targeted ("Target modules
// {...} not found in the base model"): a list written for several architectures adapts what its
// names match on this one. A name that matches nothing is a warning; a list that matches nothing
// is an error that lists what the model has.
TEST(PeftErrors, ATargetListMatchingNothingListsWhatTheModelHas) {
  const ModelSpec m = load_model("llama-2-7b");
  // "query_key_value" is GPT-NeoX's: on Llama-2 only q_proj is adapted, r 8 × (4,096 + 4,096) × 32 layers.
  const PeftSpec mixed = lora(8, 16, {"q_proj", "query_key_value"});
  EXPECT_EQ(count_params(m, mixed).trainable_params, 2'097'152);
  EXPECT_EQ(count_params(m, mixed).trainable_params, count_params(m, lora(8, 16, {"q_proj"})).trainable_params);
  const std::vector<std::string> w = unmatched_target_warnings(m, mixed);
  ASSERT_EQ(w.size(), 1u);
  EXPECT_NE(w[0].find("test (adapter \"default\"): target_modules names \"query_key_value\", which llama-2-7b does not have"), std::string::npos) << w[0];
  EXPECT_NE(w[0].find("down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj"), std::string::npos) << w[0];
  EXPECT_TRUE(unmatched_target_warnings(m, lora(8, 16, {"q_proj", "v_proj"})).empty());
  try {
    count_params(m, lora(8, 16, {"query_key_value", "c_attn"}));
    FAIL();
  } catch (const InputError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("target_modules"), std::string::npos) << msg;
    EXPECT_NE(msg.find("match no module of llama-2-7b"), std::string::npos) << msg;
    EXPECT_NE(msg.find("down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj"), std::string::npos) << msg;
  }
}

// Python's re has lookarounds and backreferences, RE2 has neither: such a pattern is refused with
// the file, the field and what to do, never matched differently from PEFT.
TEST(PeftErrors, PatternsRe2CannotMatchAreRefusedByField) {
  try {
    adapter_from_config({{"peft_type", "LORA"}, {"r", 8}, {"target_modules", "^(?!.*vision).*q_proj"}}, "adapter_config.json");
    FAIL();
  } catch (const InputError& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.rfind("adapter_config.json: target_modules is not a regular expression peftplan can match (", 0), 0u) << msg;
    EXPECT_NE(msg.find("lookarounds and backreferences are not supported: list the modules instead"), std::string::npos) << msg;
    EXPECT_NE(msg.find("\"^(?!.*vision).*q_proj\""), std::string::npos) << msg;
  }
  try {
    adapter_from_config({{"peft_type", "LORA"}, {"r", 8}, {"rank_pattern", {{"q_proj(", 4}}}}, "adapter_config.json");
    FAIL();
  } catch (const InputError& e) {
    EXPECT_EQ(std::string(e.what()).rfind("adapter_config.json: rank_pattern.q_proj( is not a regular expression", 0), 0u) << e.what();
  }
  EXPECT_THROW(adapter_from_config({{"peft_type", "LORA"}, {"r", 8}, {"alpha_pattern", {{"(?<=x)v_proj", 4}}}}, "adapter_config.json"),
               InputError);
}

TEST(PeftErrors, NonPositiveRankAndUnknownType) {
  try {
    adapter_from_config({{"peft_type", "LORA"}, {"r", -4}}, "adapter_config.json");
    FAIL();
  } catch (const InputError& e) {
    EXPECT_STREQ(e.what(), "adapter_config.json: r must be an integer in [1, 1,048,576], got -4");
  }
  EXPECT_THROW(adapter_from_config({{"peft_type", "LOHA"}}, "adapter_config.json"), InputError);
  EXPECT_THROW(adapter_from_config({{"peft_type", "LORA"}, {"bias", "some"}}, "adapter_config.json"), InputError);
}
