// End-to-end checks of the peftplan binary: output lines, JSON keys and exit codes for bad input.
#include <array>
#include <cstdio>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace {

struct Result {
  int code = 0;
  std::string out;  // stdout and stderr together
};

Result run(const std::string& args) {
  const std::string cmd = std::string(PEFTPLAN_CLI) + " " + args + " 2>&1";
  Result r;
  FILE* p = popen(cmd.c_str(), "r");
  std::array<char, 4096> buf{};
  while (std::fgets(buf.data(), buf.size(), p)) r.out += buf.data();
  int status = pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

const std::string kData = PEFTPLAN_TEST_DATA;

}  // namespace

TEST(Cli, ParamsPrintsPeftLine) {
  Result r = run("params --model llama-2-7b --lora-r 16 --lora-alpha 32 --lora-targets q_proj,v_proj");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(r.out, "trainable params: 8,388,608 || all params: 6,746,804,224 || trainable%: 0.1243\n");
  r = run("params --model llama-2-7b --peft " + kData + "/adapters/qv16/adapter_config.json");
  EXPECT_EQ(r.out, "trainable params: 8,388,608 || all params: 6,746,804,224 || trainable%: 0.1243\n");
}

TEST(Cli, ParamsJson) {
  Result r = run("params --model mixtral-8x7b --lora-r 8 --json");
  ASSERT_EQ(r.code, 0) << r.out;
  auto j = nlohmann::json::parse(r.out);
  for (const char* k : {"total_params", "active_params", "trainable_params", "all_params", "trainable_percent"})
    EXPECT_TRUE(j.contains(k)) << k;
  EXPECT_LT(j["active_params"].get<std::int64_t>(), j["total_params"].get<std::int64_t>());
}

TEST(Cli, ModelsListsTheZoo) {
  Result r = run("models");
  EXPECT_EQ(r.code, 0);
  EXPECT_NE(r.out.find("6,738,415,616"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("tiny-llama-2l"), std::string::npos);
}

// Bad input: one line naming the file/flag, field and value; exit code 2; no stack trace.
TEST(Cli, BadInputIsOneLineAndExitCodeTwo) {
  struct Case {
    std::string args, expect;
  };
  const Case cases[] = {
      {"params --model " + kData + "/bad/malformed_config.json", "malformed_config.json: is not valid JSON"},
      {"params --model " + kData + "/bad/unknown_type_config.json", "unknown_type_config.json: model_type is not supported"},
      {"params --model " + kData + "/bad/missing_field_config.json",
       "missing_field_config.json: intermediate_size is required but missing"},
      {"params --model llama-2-7b --peft " + kData + "/bad/bad_target_adapter_config.json", "query_key_value"},
      {"params --model llama-2-7b --peft " + kData + "/bad/negative_rank_adapter_config.json",
       "negative_rank_adapter_config.json: r must be a positive integer, got -4"},
      {"params --model llama-2-7b --lora-r 0", "--lora-r: must be a positive integer, got 0"},
      {"params --model no-such-model", "is neither a zoo model nor a config.json path"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.args);
    Result r = run(c.args);
    EXPECT_EQ(r.code, 2) << r.out;
    EXPECT_NE(r.out.find(c.expect), std::string::npos) << r.out;
    EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 1) << r.out;
  }
}
