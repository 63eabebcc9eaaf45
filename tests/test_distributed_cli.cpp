// `peftplan run` with several ranks, end to end: mpirun launched by the CLI over the TCP
// transport only (--mca pml ob1 --mca btl tcp,self, so that the network path runs on this
// machine), predicted vs measured memory and collective bytes, rank 0's measurement.json with
// every rank's, checkpoints and --resume, and faults: a rank that throws or is killed ends every
// rank, non-zero, within 30 s, with a message naming the rank.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "peftplan/models/config.h"

namespace fs = std::filesystem;
using namespace std::chrono_literals;

namespace {

const std::string kCorpus = std::string(PEFTPLAN_TEST_DATA) + "/executor/corpus.txt";

fs::path temp_dir(const std::string& name) {
  const fs::path p = fs::temp_directory_path() / ("peftplan_test_dcli_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  fs::create_directories(p);
  return p;
}

std::string slurp(const fs::path& p) {
  std::ifstream f(p);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

// Starts `peftplan run ARGS` in the background (its own process group), output to log.
pid_t start_run(const std::string& args, const fs::path& log, const std::string& env = "") {
  const std::string cmd = "OMP_NUM_THREADS=1 " + env + " exec " + std::string(PEFTPLAN_CLI) + " run " + args + " > " + log.string() + " 2>&1";
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::setpgid(0, 0);
    ::execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  return pid;
}

// Waits up to `limit` for pid; its exit code, or -1 on timeout (then the group is killed).
int wait_for(pid_t pid, std::chrono::seconds limit, double* took_s = nullptr) {
  const auto t0 = std::chrono::steady_clock::now();
  int status = 0;
  while (std::chrono::steady_clock::now() - t0 < limit) {
    if (::waitpid(pid, &status, WNOHANG) == pid) {
      if (took_s) *took_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
    std::this_thread::sleep_for(50ms);
  }
  ::kill(-pid, SIGKILL);
  ::waitpid(pid, &status, 0);
  return -1;
}

int run(const std::string& args, const fs::path& log) { return wait_for(start_run(args, log), 120s); }

// A fixed cluster instead of this machine's calibrated profile, time not judged and one round (a
// run's default is 5, for the time verdict): these tests check training, faults and resume, not
// the time model (tests/test_validate.cpp does that).
const std::string kCommon = "--model tiny-llama-2l --seq-len 8 --micro-batch 1 --grad-accum 2 --lora-targets q_proj,v_proj "
                            "--lora-dropout 0.1 --clip 0.5 --cluster 2xA100-80GB --tolerance-time 1e9 --rounds 1 --data " + kCorpus;

// The pid of rank `rank` of a job whose processes carry PEFTPLAN_TEST_TAG=tag (Open MPI puts
// OMPI_COMM_WORLD_RANK in every rank's environment).
pid_t find_rank(const std::string& tag, int rank) {
  for (const auto& e : fs::directory_iterator("/proc")) {
    const std::string name = e.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::string env = slurp(e.path() / "environ");
    for (char& c : env)
      if (c == '\0') c = '\n';
    env = "\n" + env;
    if (env.find("\nPEFTPLAN_TEST_TAG=" + tag + "\n") != std::string::npos &&
        env.find("\nOMPI_COMM_WORLD_RANK=" + std::to_string(rank) + "\n") != std::string::npos &&
        slurp(e.path() / "cmdline").find("peftplan-exec") != std::string::npos)
      return static_cast<pid_t>(std::stoi(name));
  }
  return -1;
}

}  // namespace

// Two ranks, ZeRO-2 with optimizer offload, over TCP only, checkpointing every 2 steps; then a
// run resumed from step 2 reproduces step 3's loss.
TEST(DistributedCli, Zero2OverTcpWithCheckpointsAndResume) {
  const fs::path dir = temp_dir("tcp");
  const std::string args = kCommon + " --gpus 2 --strategy zero2 --offload-optimizer cpu --steps 3 --checkpoint-every 2 "
                                     "--mpi-args \"--mca pml ob1 --mca btl tcp,self\" --out " + dir.string();
  ASSERT_EQ(run(args, dir / "log"), 0) << slurp(dir / "log");
  const std::string out = slurp(dir / "log");
  EXPECT_NE(out.find("step 3/3"), std::string::npos) << out;
  EXPECT_NE(out.find("measured memory equals the prediction exactly"), std::string::npos) << out;
  EXPECT_NE(out.find("measured collective bytes equal the prediction exactly"), std::string::npos) << out;
  const auto m = peftplan::models::read_json_file((dir / "measurement.json").string());
  ASSERT_EQ(m["per_rank"].size(), 2u);
  EXPECT_EQ(m["per_rank"][1]["rank"].get<int>(), 1);
  EXPECT_EQ(m["per_rank"][1]["memory"], m["per_rank"][0]["memory"]);  // the same program on both
  EXPECT_GT(m["collectives"]["reduce_scatter"]["bytes"].get<std::uint64_t>(), 0u);
  EXPECT_TRUE(fs::exists(dir / "checkpoints" / "step-2" / "optimizer.rank1.bin"));
  EXPECT_EQ(slurp(dir / "checkpoints" / "latest"), "step-2\n");
  const fs::path dir2 = temp_dir("resume");
  ASSERT_EQ(run(kCommon + " --gpus 2 --strategy zero2 --offload-optimizer cpu --steps 3 --resume " + (dir / "checkpoints").string() +
                    " --out " + dir2.string(),
                dir2 / "log"),
            0)
      << slurp(dir2 / "log");
  const auto m2 = peftplan::models::read_json_file((dir2 / "measurement.json").string());
  ASSERT_EQ(m2["losses"].size(), 1u);
  EXPECT_EQ(m2["losses"][0].get<double>(), m["losses"][2].get<double>());
  fs::remove_all(dir);
  fs::remove_all(dir2);
}

// Checkpoints record a SHA-256 of every file: a corrupt one is refused naming the file, and
// <checkpoint_dir>/latest-good falls back to the newest checkpoint that verifies.
TEST(DistributedCli, CorruptCheckpointIsRefusedAndLatestGoodFallsBack) {
  const fs::path dir = temp_dir("rot");
  ASSERT_EQ(run(kCommon + " --gpus 2 --strategy zero2 --steps 4 --checkpoint-every 2 --out " + dir.string(), dir / "log"), 0)
      << slurp(dir / "log");
  const auto state = peftplan::models::read_json_file((dir / "checkpoints" / "step-4" / "trainer_state.json").string());
  for (const char* f : {"optimizer.rank0.bin", "optimizer.rank1.bin", "adapter_model.safetensors", "adapter_config.json"})
    EXPECT_EQ(state["sha256"][f].get<std::string>().size(), 64u) << f;
  {  // one flipped byte in rank 1's optimizer states of the newest checkpoint
    std::fstream f(dir / "checkpoints" / "step-4" / "optimizer.rank1.bin", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(20);
    f.put('\x7f');
  }
  const fs::path again = temp_dir("rot-again");
  EXPECT_EQ(run(kCommon + " --gpus 2 --strategy zero2 --steps 6 --resume " + (dir / "checkpoints").string() + " --out " + again.string(),
                again / "log"),
            2)
      << slurp(again / "log");
  EXPECT_NE(slurp(again / "log").find("step-4/optimizer.rank1.bin: its SHA-256 differs from trainer_state.json's"), std::string::npos)
      << slurp(again / "log");
  const fs::path good = temp_dir("rot-good");
  ASSERT_EQ(run(kCommon + " --gpus 2 --strategy zero2 --steps 6 --resume " + (dir / "checkpoints" / "latest-good").string() + " --out " +
                    good.string(),
                good / "log"),
            0)
      << slurp(good / "log");
  EXPECT_NE(slurp(good / "log").find("resumed from"), std::string::npos);
  EXPECT_NE(slurp(good / "log").find("at step 2"), std::string::npos) << slurp(good / "log");  // step-4 is corrupt: step-2
  fs::remove_all(dir);
  fs::remove_all(again);
  fs::remove_all(good);
}

// A two-rank run of `strategy` with a fault injected through `env`: every rank ends, non-zero,
// within 30 s, and the output says each of `expected`.
static void expect_fault_ends_the_job(const std::string& name, const std::string& strategy, const std::string& env,
                                      const std::vector<std::string>& expected) {
  const fs::path dir = temp_dir(name);
  const pid_t pid = start_run(kCommon + " --gpus 2 --strategy " + strategy + " --steps 5 --out " + dir.string(), dir / "log", env);
  double took = 0.0;
  const int code = wait_for(pid, 30s, &took);
  const std::string out = slurp(dir / "log");
  EXPECT_GT(code, 0) << out;
  EXPECT_LT(took, 30.0) << out;
  for (const std::string& e : expected) EXPECT_NE(out.find(e), std::string::npos) << e << "\n" << out;
  fs::remove_all(dir);
}

// A rank that throws in the middle of a step: the message names the rank and the op.
TEST(DistributedCli, FailingRankEndsTheJobWithItsRankAndOp) {
  expect_fault_ends_the_job("throw", "ddp", "PEFTPLAN_FAULT=1:1:150",
                            {"peftplan-exec: rank 1: internal error: injected fault (PEFTPLAN_FAULT) at step 1, op 150 ("});
}

// A rank that stalls instead of dying (PEFTPLAN_FAULT=...:stall: it stops at op 150 of step 1
// and never returns): its peer's watchdog (5 s here) names the stalled rank and the op it stopped
// at.
TEST(DistributedCli, StalledRankIsNamedAndEveryRankExits) {
  expect_fault_ends_the_job("stall", "zero2", "PEFTPLAN_FAULT=1:1:150:stall PEFTPLAN_WATCHDOG_S=5",
                            {"peftplan-exec: rank 0: error: op ", "waited more than 5 s for its peers: rank 1 stalled at step 1, op 150 ("});
}

// A rank killed (SIGKILL) mid-run: every rank is gone within 30 s and the job names the rank.
TEST(DistributedCli, KilledRankEndsTheJob) {
  const fs::path dir = temp_dir("kill");
  const std::string tag = std::to_string(::getpid());
  const pid_t pid = start_run(kCommon + " --gpus 2 --strategy zero1 --steps 1000000 --out " + dir.string(), dir / "log",
                              "PEFTPLAN_TEST_TAG=" + tag);
  pid_t victim = -1;
  for (int i = 0; i < 600 && victim < 0; ++i) {  // up to 30 s for the run to reach step 2
    std::this_thread::sleep_for(50ms);
    if (slurp(dir / "log").find("step 2/") != std::string::npos) victim = find_rank(tag, 1);
  }
  ASSERT_GT(victim, 0) << "rank 1 not found; log:\n" << slurp(dir / "log");
  ::kill(victim, SIGKILL);
  double took = 0.0;
  const int code = wait_for(pid, 30s, &took);
  const std::string out = slurp(dir / "log");
  EXPECT_GT(code, 0) << out;
  EXPECT_LT(took, 30.0) << out;
  EXPECT_NE(out.find("rank 1"), std::string::npos) << out;
  fs::remove_all(dir);
}

namespace {

// The first step's loss as `peftplan run` prints it ("step 1/K  loss 5.577516 ...").
std::string first_loss(const std::string& log) {
  const auto at = log.find("step 1/");
  if (at == std::string::npos) return "";
  const auto loss = log.find("loss ", at);
  return log.substr(loss + 5, log.find(' ', loss + 5) - loss - 5);
}

}  // namespace

// One rank under mpirun: every strategy (with and without optimizer offload) runs the same
// training as DDP, and its memory and collective bytes (a one-rank gather still moves its bytes)
// equal the plan. A regression test: ZeRO-2 and offloaded copies once named no gradient buffer
// when nothing was sharded.
TEST(DistributedCli, EveryStrategyRunsOnOneRank) {
  const fs::path dir = fs::temp_directory_path() / "peftplan_one_rank";
  fs::remove_all(dir);
  fs::create_directories(dir);
  const std::string common = "--model tiny-llama-2l --seq-len 8 --micro-batch 2 --lora-targets q_proj,v_proj --steps 2 "
                             "--cluster 1xA100-80GB --tolerance-time 1e9 --rounds 1 --data " + kCorpus;
  ASSERT_EQ(run(common + " --strategy ddp --out " + (dir / "ddp").string(), dir / "ddp.log"), 0) << slurp(dir / "ddp.log");
  const std::string ddp_loss = first_loss(slurp(dir / "ddp.log"));
  ASSERT_FALSE(ddp_loss.empty());
  for (const std::string s : {"zero1 --offload-optimizer cpu", "zero2", "zero2 --offload-optimizer cpu", "zero3",
                              "zero3 --offload-optimizer cpu"}) {
    SCOPED_TRACE(s);
    const fs::path log = dir / (std::to_string(std::hash<std::string>{}(s)) + ".log");
    ASSERT_EQ(run(common + " --strategy " + s + " --out " + (dir / "out").string(), log), 0) << slurp(log);
    EXPECT_EQ(first_loss(slurp(log)), ddp_loss);
    EXPECT_NE(slurp(log).find("measured memory equals the prediction exactly"), std::string::npos) << slurp(log);
  }
  fs::remove_all(dir);
}
