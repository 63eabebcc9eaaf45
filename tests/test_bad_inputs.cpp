// The bad-inputs corpus (tests/bad-inputs/<kind>/): every file of every kind through the command
// that reads it. Each must be refused as bad input: exit code 2 (not a crash, not an internal
// error, not a hang: every run is under `timeout`), one line on stderr that names the file and
// holds no byte that would not print (error.h printable()), and no output file left behind.
// Adding a file to the corpus adds it to the test.
#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <sys/wait.h>

#include "peftplan/common/error.h"

namespace fs = std::filesystem;

namespace {

const fs::path kCorpus = fs::path(PEFTPLAN_SOURCE_DIR) / "tests" / "bad-inputs";

struct Outcome {
  int code = 0;
  std::string out, err;
};

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

Outcome run(const std::string& args, const fs::path& dir) {
  const fs::path out = dir / "stdout", err = dir / "stderr";
  const std::string cmd = "timeout 60 " + std::string(PEFTPLAN_CLI) + " " + args + " >" + out.string() + " 2>" + err.string();
  const int status = std::system(cmd.c_str());
  Outcome r;
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.out = slurp(out);
  r.err = slurp(err);
  return r;
}

class BadInputs : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("peftplan_bad_inputs_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Every file of `kind` through `args` ({} is the file): refused as bad input, naming the file.
  void check_kind(const std::string& kind, const std::string& args) {
    std::vector<fs::path> files;
    for (const auto& e : fs::directory_iterator(kCorpus / kind))
      if (e.is_regular_file()) files.push_back(e.path());
    std::sort(files.begin(), files.end());
    ASSERT_GE(files.size(), 5u) << kind;
    for (const fs::path& f : files) {
      SCOPED_TRACE(f.string());
      const fs::path out = dir_ / "out";
      std::string a = args;
      a.replace(a.find("{}"), 2, f.string());
      const Outcome r = run(a + " ", dir_);
      EXPECT_EQ(r.code, 2) << r.err;
      EXPECT_EQ(r.err.rfind("peftplan: error: ", 0), 0u) << r.err;
      ASSERT_FALSE(r.err.empty());
      EXPECT_EQ(r.err.find('\n'), r.err.size() - 1) << "more than one line: " << r.err;
      EXPECT_NE(r.err.find(f.string()), std::string::npos) << "the file is not named: " << r.err;
      EXPECT_EQ(peftplan::printable(r.err), r.err) << "a byte that does not print";
      EXPECT_FALSE(fs::exists(out)) << "an output was left behind";
      ++checked_[kind];
    }
  }

  fs::path dir_;
  std::map<std::string, int> checked_;
};

TEST_F(BadInputs, ModelConfigs) { check_kind("model-config", "plan --model {}"); }

// The example: a module the model lacks names the adapter file as well as the module.
TEST_F(BadInputs, AdapterConfigs) {
  check_kind("adapter-config", "plan --model tiny-llama-2l --peft {}");
  const Outcome r = run("plan --model tiny-llama-2l --peft " + (kCorpus / "adapter-config" / "module_the_model_lacks.json").string(), dir_);
  EXPECT_NE(r.err.find("no_such_proj"), std::string::npos) << r.err;
}

TEST_F(BadInputs, DeepSpeedConfigs) { check_kind("ds-config", "plan --gpus 2 --ds-config {}"); }

TEST_F(BadInputs, AccelerateConfigs) { check_kind("accelerate-config", "plan --gpus 2 --accelerate-config {}"); }

TEST_F(BadInputs, ClusterFiles) { check_kind("cluster", "plan --model tiny-llama-2l --cluster {}"); }

TEST_F(BadInputs, PlanFiles) { check_kind("plan", "compare {} " + (kCorpus / "plan" / "empty.json").string() + " --out " + (dir_ / "out").string()); }

TEST_F(BadInputs, Measurements) {
  const fs::path plan = dir_ / "plan.json";
  const Outcome w = run("plan --model tiny-llama-2l --profile executor --precision fp32 --attention eager --gpus 1 --micro-batch 1 --seq-len 16 "
                    "--write-plan " + plan.string(), dir_);
  ASSERT_EQ(w.code, 0) << w.err;
  check_kind("measurement", "compare " + plan.string() + " {} --out " + (dir_ / "out").string());
}

}  // namespace
