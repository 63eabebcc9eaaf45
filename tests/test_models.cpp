// ModelSpec parsing and the parameter inventory against published parameter counts.
// Every expected total comes from tests/data/zoo_expected.json, whose "source" field (and
// models/zoo/SOURCES.md) says where the number was published.
#include <fstream>
#include <limits>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "peftplan/common/error.h"
#include "peftplan/common/json_fields.h"
#include "peftplan/common/units.h"
#include "peftplan/models/config.h"
#include "peftplan/models/parameters.h"
#include "peftplan/models/peft.h"

using namespace peftplan;
using namespace peftplan::models;

namespace {

nlohmann::json expected_counts() {
  std::ifstream in(std::string(PEFTPLAN_TEST_DATA) + "/zoo_expected.json");
  return nlohmann::json::parse(in);
}

}  // namespace

// The four counts the issue pins, with their public sources:
// Llama-2-7b 6,738,415,616 (PEFT README output: all params 6,742,609,920 minus 4,194,304 LoRA);
// GPT-2 124,439,808 (GPT2LMHeadModel.num_parameters()); Mistral-7B-v0.1 7,241,732,096 and
// Llama-3-8B 8,030,261,248 (Hub safetensors metadata).
TEST(Models, PinnedCounts) {
  EXPECT_EQ(count_base(load_model("llama-2-7b")).total, 6'738'415'616);
  EXPECT_EQ(count_base(load_model("gpt2")).total, 124'439'808);
  EXPECT_EQ(count_base(load_model("mistral-7b")).total, 7'241'732'096);
  EXPECT_EQ(count_base(load_model("llama-3-8b")).total, 8'030'261'248);
}

TEST(Models, EveryZooModelMatchesItsPublishedCount) {
  const auto expected = expected_counts();
  ASSERT_EQ(expected.size(), zoo().size()) << "every zoo model needs an expected count with a source";
  for (const auto& z : zoo()) {
    SCOPED_TRACE(z.name);
    ASSERT_TRUE(expected.contains(z.name));
    const auto& e = expected[z.name];
    const BaseCounts c = count_base(load_model(z.name));
    EXPECT_EQ(c.total, e["total_params"].get<std::int64_t>()) << e["source"];
    if (e.contains("active_params")) EXPECT_EQ(c.active, e["active_params"].get<std::int64_t>());
    else EXPECT_EQ(c.active, c.total);
  }
}

// Mixtral-8x7B: the model card rounds to 46.7B total and 12.9B active (top-2 of 8 experts).
TEST(Models, MixtralActiveIsTopTwoOfEight) {
  const ModelSpec m = load_model("mixtral-8x7b");
  EXPECT_EQ(m.experts, 8);
  EXPECT_EQ(m.experts_per_token, 2);
  const BaseCounts c = count_base(m);
  const std::int64_t expert = 3 * m.hidden * m.intermediate;  // w1, w2, w3
  EXPECT_EQ(c.total - c.active, 6 * expert * m.layers);
}

TEST(Models, TiedWeightsCountOnce) {
  // GPT-2 ties lm_head to wte (tie_word_embeddings absent => true in PretrainedConfig).
  const auto tensors = parameter_tensors(load_model("gpt2"));
  for (const auto& t : tensors) EXPECT_NE(t.name, "lm_head.weight");
  const ModelSpec untied = load_model("llama-2-7b");
  const auto rows = parameter_tensors(untied);
  EXPECT_EQ(rows.back().name, "lm_head.weight");
  EXPECT_EQ(rows.back().shape, (std::vector<std::int64_t>{32000, 4096}));
}

TEST(Models, HuggingFaceNamesAndShapes) {
  const ModelSpec m = load_model("llama-3-8b");
  const auto rows = parameter_tensors(m);
  auto find = [&](const std::string& name) {
    for (const auto& t : rows)
      if (t.name == name) return t;
    ADD_FAILURE() << "missing " << name;
    return TensorInfo{};
  };
  // GQA: 8 kv heads of 128 => k_proj is [1024, 4096] (Meta-Llama-3-8B config.json).
  EXPECT_EQ(find("model.layers.0.self_attn.k_proj.weight").shape, (std::vector<std::int64_t>{1024, 4096}));
  EXPECT_EQ(find("model.layers.31.mlp.down_proj.weight").shape, (std::vector<std::int64_t>{4096, 14336}));
  EXPECT_EQ(find("model.embed_tokens.weight").shape, (std::vector<std::int64_t>{128256, 4096}));
  // Qwen2 has q/k/v bias and no o_proj bias (modeling_qwen2.py).
  const auto q = parameter_tensors(load_model("qwen2.5-7b"));
  int biases = 0;
  for (const auto& t : q)
    if (t.layer == 0 && t.role == ParamRole::linear_bias) ++biases;
  EXPECT_EQ(biases, 3);
  // Gemma-2: explicit head_dim 256 != 3584/16, four norms per layer.
  const ModelSpec g = load_model("gemma-2-9b");
  EXPECT_EQ(g.head_dim, 256);
  int norms = 0;
  for (const auto& t : parameter_tensors(g))
    if (t.layer == 0 && t.role == ParamRole::norm_weight) ++norms;
  EXPECT_EQ(norms, 4);
  // Phi-3: fused qkv_proj [(32+2*32)*96, 3072] and gate_up_proj [2*8192, 3072].
  const ModelSpec p = load_model("phi-3-mini");
  bool fused = false;
  for (const auto& t : parameter_tensors(p))
    if (t.name == "model.layers.0.self_attn.qkv_proj.weight") {
      fused = true;
      EXPECT_EQ(t.shape, (std::vector<std::int64_t>{9216, 3072}));
    }
  EXPECT_TRUE(fused);
}

TEST(Models, FalconMultiQueryAndNewArchitecture) {
  // falcon-7b: multi_query => fused qkv out = H + 2d = 4544 + 128 (modeling_falcon.py).
  const ModelSpec f7 = load_model("falcon-7b");
  EXPECT_EQ(f7.kv_heads, 1);
  for (const auto& t : parameter_tensors(f7))
    if (t.name == "transformer.h.0.self_attention.query_key_value.weight") {
      EXPECT_EQ(t.shape, (std::vector<std::int64_t>{4672, 4544}));
    }
  // falcon-40b: new_decoder_architecture, 8 kv groups => (128 + 16) * 64 rows, ln_attn + ln_mlp.
  const ModelSpec f40 = load_model("falcon-40b");
  EXPECT_TRUE(f40.falcon_new_arch);
  int norms = 0;
  for (const auto& t : parameter_tensors(f40)) {
    if (t.name == "transformer.h.0.self_attention.query_key_value.weight") {
      EXPECT_EQ(t.shape, (std::vector<std::int64_t>{9216, 8192}));
    }
    if (t.layer == 0 && t.role == ParamRole::norm_weight) ++norms;
  }
  EXPECT_EQ(norms, 2);
}

TEST(Models, OptLearnedPositionsHaveTwoExtraRows) {
  const ModelSpec m = load_model("opt-125m");
  for (const auto& t : parameter_tensors(m))
    if (t.name == "model.decoder.embed_positions.weight") {
      EXPECT_EQ(t.shape, (std::vector<std::int64_t>{2050, 768}));
    }
}

TEST(Models, LargestLayerIsTheEmbeddingForLlama) {
  // DeepSpeed's largest_layer_params: max over modules of their own parameters.
  EXPECT_EQ(count_base(load_model("llama-2-7b")).largest_layer, 32000LL * 4096);
}

// A checkpoint saved quantised: config.json's quantization_config as transformers writes it
// (BitsAndBytesConfig.to_dict, transformers utils/quantization_config.py), read with
// BitsAndBytesConfig's defaults: bnb_4bit_quant_type "fp4", no double quantisation.
TEST(Models, QuantizationConfigOfACheckpointSavedQuantised) {
  const ModelSpec nf4 = load_model(std::string(PEFTPLAN_TEST_DATA) + "/quantised/llama-3-8b-bnb-4bit");
  ASSERT_TRUE(nf4.checkpoint_quantization.has_value());
  EXPECT_EQ(nf4.checkpoint_quantization->dtype, DType::nf4);
  EXPECT_TRUE(nf4.checkpoint_quantization->double_quant);
  EXPECT_EQ(nf4.checkpoint_quantization->block_size, 64);
  EXPECT_FALSE(load_model("llama-3-8b").checkpoint_quantization.has_value());
  EXPECT_FALSE(nf4.checkpoint_quant_storage.has_value());  // uint8, as unsloth's uploads store it
  nlohmann::json c = nlohmann::json::parse(zoo_config_text("tiny-llama-2l"));
  c["quantization_config"] = {{"quant_method", "bitsandbytes"}, {"load_in_4bit", true}, {"bnb_4bit_quant_storage", "bfloat16"}};
  ModelSpec m = model_from_config(c, "cfg.json", "x");
  ASSERT_TRUE(m.checkpoint_quantization.has_value());
  EXPECT_EQ(m.checkpoint_quantization->dtype, DType::fp4);
  EXPECT_FALSE(m.checkpoint_quantization->double_quant);
  EXPECT_EQ(m.checkpoint_quant_storage, DType::bf16);
  // A truthy load flag makes it bitsandbytes whatever quant_method says; the private attribute
  // alone does not (from_dict reads load_in_4bit, and transformers refuses "bitsandbytes" alone).
  c["quantization_config"] = {{"quant_method", "gptq"}, {"load_in_4bit", true}};
  EXPECT_EQ(model_from_config(c, "cfg.json", "x").checkpoint_quantization->dtype, DType::fp4);
  c["quantization_config"] = {{"quant_method", "bitsandbytes"}, {"_load_in_4bit", true}};
  EXPECT_THROW(model_from_config(c, "cfg.json", "x"), InputError);
  // bitsandbytes keeps a Linear whole when an entry is its name or path, or an entry and a "."
  // occur in its path: "gate" is not gate_proj (Llama has no router), "mlp" is every MLP Linear.
  c["quantization_config"] = {{"load_in_4bit", true}, {"llm_int8_skip_modules", {"lm_head", "gate", "mlp.gate"}}};
  EXPECT_TRUE(model_from_config(c, "cfg.json", "x").checkpoint_quantization.has_value());
  c["quantization_config"] = {{"load_in_4bit", true}, {"llm_int8_skip_modules", {"lm_head", "mlp"}}};
  EXPECT_THROW(model_from_config(c, "cfg.json", "x"), InputError);
  // A key is a module's name, its whole path, or a part of its path before a ".".
  c["quantization_config"] = {{"load_in_4bit", true}, {"llm_int8_skip_modules", {"lm_head", "model.layers.1.mlp.down_proj"}}};
  EXPECT_THROW(model_from_config(c, "cfg.json", "x"), InputError);
  c["quantization_config"] = {{"load_in_4bit", true}, {"llm_int8_skip_modules", {"lm_head", "layers.1"}}};
  EXPECT_THROW(model_from_config(c, "cfg.json", "x"), InputError);
  c["quantization_config"] = {{"load_in_4bit", true}, {"bnb_4bit_quant_storage", "banana"}};
  EXPECT_THROW(model_from_config(c, "cfg.json", "x"), InputError);
  // GPT-NeoX's head is embed_out, tied or not.
  nlohmann::json neox = nlohmann::json::parse(zoo_config_text("pythia-70m"));
  neox["tie_word_embeddings"] = true;
  neox["quantization_config"] = {{"load_in_4bit", true}, {"llm_int8_skip_modules", {"embed_out"}}};
  EXPECT_TRUE(model_from_config(neox, "cfg.json", "x").checkpoint_quantization.has_value());
  neox["quantization_config"] = {{"load_in_4bit", true}, {"llm_int8_skip_modules", {"lm_head"}}};
  EXPECT_THROW(model_from_config(neox, "cfg.json", "x"), InputError);
  // A list given replaces the default one: without lm_head, bitsandbytes quantises the head too.
  c["quantization_config"] = {{"load_in_4bit", true}, {"llm_int8_skip_modules", nlohmann::json::array()}};
  try {
    model_from_config(c, "cfg.json", "x");
    ADD_FAILURE() << "a list without lm_head was accepted";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("leaves out lm_head, so bitsandbytes quantises the LM head too"), std::string::npos) << e.what();
  }
  // Without quant_method, load_in_8bit makes it bitsandbytes (AutoQuantizationConfig.from_dict).
  c["quantization_config"] = {{"load_in_8bit", true}, {"llm_int8_skip_modules", {"lm_head"}}};
  m = model_from_config(c, "cfg.json", "x");
  ASSERT_TRUE(m.checkpoint_quantization.has_value());
  EXPECT_EQ(m.checkpoint_quantization->dtype, DType::int8);
  c["quantization_config"] = nullptr;
  EXPECT_FALSE(model_from_config(c, "cfg.json", "x").checkpoint_quantization.has_value());
  // Kept unquantised in part (bitsandbytes matches the name inside each module's dotted path):
  // refused, naming the first Linear it keeps whole.
  c["quantization_config"] = {{"load_in_4bit", true}, {"llm_int8_skip_modules", {"lm_head", "o_proj"}}};
  try {
    model_from_config(c, "cfg.json", "x");
    ADD_FAILURE() << "a partly quantised base was accepted";
  } catch (const InputError& e) {
    EXPECT_EQ(std::string(e.what()),
              "cfg.json: quantization_config.llm_int8_skip_modules keeps model.layers.0.self_attn.o_proj unquantised: a base quantised "
              "in part is not modelled (peftplan quantises every Linear but the LM head), got \"o_proj\"");
  }
}

// The rule every planning command applies (models::apply_checkpoint_quantization): the
// checkpoint's quantisation wins, a different request is a warning, full fine-tuning is refused.
TEST(Models, ACheckpointSavedQuantisedLoadsAsSaved) {
  const ModelSpec m = load_model(std::string(PEFTPLAN_TEST_DATA) + "/quantised/llama-3-8b-bnb-4bit");
  PeftSpec lora;
  lora.adapters.push_back(AdapterSpec{});
  PeftSpec p = lora;
  EXPECT_TRUE(apply_checkpoint_quantization(m, p, false).empty());
  EXPECT_EQ(p.quantization, m.checkpoint_quantization);
  p = lora;
  p.quantization = m.checkpoint_quantization;  // asked for what it is: no warning
  EXPECT_TRUE(apply_checkpoint_quantization(m, p, true).empty());
  p = lora;  // asked for no quantisation (--quant none)
  const auto w = apply_checkpoint_quantization(m, p, true);
  ASSERT_EQ(w.size(), 1u);
  EXPECT_NE(w[0].find("planned as bitsandbytes nf4 with double quantisation, not unquantised"), std::string::npos) << w[0];
  EXPECT_EQ(p.quantization, m.checkpoint_quantization);
  PeftSpec full;
  EXPECT_THROW(apply_checkpoint_quantization(m, full, false), InputError);
  PeftSpec plain = lora;  // an unquantised checkpoint: nothing changes
  EXPECT_TRUE(apply_checkpoint_quantization(load_model("llama-3-8b"), plain, true).empty());
  EXPECT_FALSE(plain.quantization.has_value());
}

TEST(ModelErrors, UnknownModelTypeNamesFieldAndValidList) {
  nlohmann::json c = {{"model_type", "bloom"}, {"hidden_size", 64}};
  try {
    model_from_config(c, "cfg.json", "x");
    FAIL();
  } catch (const InputError& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("cfg.json: model_type"), std::string::npos) << msg;
    EXPECT_NE(msg.find("\"bloom\""), std::string::npos) << msg;
    EXPECT_NE(msg.find("llama"), std::string::npos) << msg;
  }
}

TEST(ModelErrors, MissingAndBadFields) {
  nlohmann::json c = {{"model_type", "llama"}, {"hidden_size", 64}, {"num_hidden_layers", 2},
                      {"num_attention_heads", 4}, {"vocab_size", 256}};
  EXPECT_THROW(
      {
        try {
          model_from_config(c, "cfg.json", "x");
        } catch (const InputError& e) {
          EXPECT_STREQ(e.what(), "cfg.json: intermediate_size is required but missing");
          throw;
        }
      },
      InputError);
  c["intermediate_size"] = -5;
  EXPECT_THROW(model_from_config(c, "cfg.json", "x"), InputError);
  c["intermediate_size"] = 128;
  c["num_key_value_heads"] = 3;  // does not divide 4 heads
  EXPECT_THROW(model_from_config(c, "cfg.json", "x"), InputError);
}

TEST(ModelErrors, MalformedJsonFile) {
  const std::string path = std::string(PEFTPLAN_TEST_DATA) + "/bad/malformed_config.json";
  try {
    read_json_file(path);
    FAIL();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("malformed_config.json: is not valid JSON"), std::string::npos) << e.what();
  }
}

// The shared JSON field reader (common/json_fields.h) every file parser uses: absent and null
// take the default; a wrong type, a float where an integer belongs, a value out of range or past
// 64 bits is an InputError naming the file, the field with its object path, what is valid and
// the value.
TEST(JsonFields, DefaultsTypesAndMessages) {
  namespace jf = peftplan::json_fields;
  const auto j = nlohmann::json::parse(R"({"r": 16, "alpha": 32.5, "on": true, "name": "x", "none": null, "f": 4.0,
                                           "neg": -3, "big": 18446744073709551615, "s": "7"})");
  EXPECT_EQ(jf::positive_integer(j, "r", "a.json", 8), 16);
  EXPECT_EQ(jf::positive_integer(j, "missing", "a.json", 8), 8);
  EXPECT_EQ(jf::positive_integer(j, "none", "a.json", 8), 8);
  EXPECT_DOUBLE_EQ(jf::number(j, "alpha", "a.json", 0.0), 32.5);
  EXPECT_DOUBLE_EQ(jf::number(j, "r", "a.json", 0.0), 16.0);  // an integer is a number
  EXPECT_TRUE(jf::boolean(j, "on", "a.json", false));
  EXPECT_EQ(jf::string(j, "name", "a.json", "d"), "x");
  EXPECT_EQ(jf::unsigned_integer(j, "big", "a.json", 0), 18446744073709551615ull);
  EXPECT_EQ(jf::integer(j, "neg", "a.json", 0), -3);
  EXPECT_EQ(jf::find(nlohmann::json::array(), "r"), nullptr);  // not an object: nothing to find
  auto message = [](auto&& f) {
    try {
      f();
    } catch (const peftplan::InputError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(message([&] { jf::positive_integer(j, "f", "a.json", 1, "training."); }),
            "a.json: training.f must be a positive integer, got 4.0");
  EXPECT_EQ(message([&] { jf::positive_integer(j, "neg", "a.json", 1); }), "a.json: neg must be a positive integer, got -3");
  EXPECT_EQ(message([&] { jf::integer(j, "big", "a.json", 1); }), "a.json: big must be an integer, got 18446744073709551615");
  EXPECT_EQ(message([&] { jf::integer(j, "r", "a.json", 1, {}, 0, 8); }), "a.json: r must be an integer in [0, 8], got 16");
  EXPECT_EQ(message([&] { jf::integer(j, "neg", "a.json", 1, {}, 0); }), "a.json: neg must be a non-negative integer, got -3");
  EXPECT_EQ(message([&] { jf::number(j, "s", "a.json", 0.0); }), "a.json: s must be a number, got \"7\"");
  EXPECT_EQ(message([&] { jf::boolean(j, "r", "a.json", false); }), "a.json: r must be true or false, got 16");
  EXPECT_EQ(message([&] { jf::string(j, "on", "a.json", ""); }), "a.json: on must be a string, got true");
  EXPECT_EQ(message([&] { jf::unsigned_integer(j, "neg", "a.json", 0); }), "a.json: neg must be a non-negative integer, got -3");
  // Ranges are written as counts are everywhere (PEFT's "{:,}"), so 1048576 reads as 1,048,576.
  EXPECT_EQ(message([&] { jf::integer(j, "neg", "a.json", 1, {}, 1, 1 << 20); }), "a.json: neg must be an integer in [1, 1,048,576], got -3");
  EXPECT_EQ(message([&] { jf::integer(j, "neg", "a.json", 1, {}, -1000, -10); }), "a.json: neg must be an integer in [-1,000, -10], got -3");
}

TEST(Units, WithCommasGroupsThreeDigitsAtAnyMagnitude) {
  using peftplan::with_commas;
  EXPECT_EQ(with_commas(0), "0");
  EXPECT_EQ(with_commas(999), "999");
  EXPECT_EQ(with_commas(1000), "1,000");
  EXPECT_EQ(with_commas(6'738'415'616), "6,738,415,616");  // llama-2-7b, as PEFT prints it
  EXPECT_EQ(with_commas(-4096), "-4,096");
  // The extremes: the magnitude of INT64_MIN does not fit a signed 64-bit integer.
  EXPECT_EQ(with_commas(std::numeric_limits<std::int64_t>::max()), "9,223,372,036,854,775,807");
  EXPECT_EQ(with_commas(std::numeric_limits<std::int64_t>::min()), "-9,223,372,036,854,775,808");
}
