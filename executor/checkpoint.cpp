// A Session's checkpoints (session_impl.h): a folder per step written whole and checksummed,
// and resume, which verifies it (or falls back to latest-good).
#include "session_impl.h"

namespace peftplan::executor {

// ------------------------------------------------------------------------------- checkpoints
//
// <checkpoint_dir>/step-<k>/ holds adapter_model.safetensors + adapter_config.json (the whole
// adapter, as every rank has it after the step; under ZeRO-3 all_gathered from the ranks'
// shards first, outside the step's counted collectives), optimizer.rank<r>.bin (rank r's
// optimizer states, then its host parameter copy under offload: a header of two uint64 element
// counts, then fp32), and trainer_state.json (step, data position, seed, ranks, strategy).
// ZeRO-3 adds trainable.rank<r>.bin: rank r's adapter partition exactly as trainable.shard
// holds it (its block of every unit's flattened, padded adapter, in unit order; a header of one
// uint64 element count, then fp32). Resume restores each rank's partition from it bit for bit
// (not from the adapter file, whose tensors do not carry the padding); the frozen shards are
// not trained and are rebuilt from the seed or the weights file as at the start. Ranks write
// into step-<k>.tmp/, rank 0 renames it to step-<k> and then rewrites <checkpoint_dir>/latest
// (temporary name, then rename): a crash leaves the previous checkpoint whole.
// The data position is the step (step k reads global sequences k·G …); dropout masks are a
// counter-based hash of (seed, step, micro-batch, adapter), so the seed and the step are all the
// random state there is.

void Session::save_checkpoint(const std::filesystem::path& dir) const {
  namespace fs = std::filesystem;
  Impl& s = *impl_;
  if (s.zero3) s.gather_adapter();  // a collective: every rank, before rank 0 writes the adapter
  const std::string name = fmt::format("step-{}", s.steps_done);
  const fs::path tmp = dir / (name + ".tmp"), final_dir = dir / name;
  if (s.rank == 0) {
    fs::create_directories(dir);
    fs::remove_all(tmp);
    fs::create_directories(tmp);
  }
  if (s.comm) s.comm->barrier();
  {
    const std::uint64_t ns = static_cast<std::uint64_t>(s.floats(s.opt_states));
    const std::uint64_t np = s.host_params >= 0 ? static_cast<std::uint64_t>(s.floats(s.host_params)) : 0;
    std::string blob(16 + 4 * (ns + np), '\0');
    std::memcpy(blob.data(), &ns, 8);
    std::memcpy(blob.data() + 8, &np, 8);
    s.read_bytes(s.opt_states, blob.data() + 16, 4 * ns);  // staged through the backend
    if (np) s.read_bytes(s.host_params, blob.data() + 16 + 4 * ns, 4 * np);
    write_text_atomic(tmp / fmt::format("optimizer.rank{}.bin", s.rank), blob);
    // A buffer of this rank as a file: a uint64 element count, then its bytes as held.
    auto save_buffer = [&](std::int32_t id, std::uint64_t elem_bytes, const char* file) {
      const std::uint64_t n = s.bytes(id) / elem_bytes;
      std::string bytes(8 + elem_bytes * n, '\0');
      std::memcpy(bytes.data(), &n, 8);
      s.read_bytes(id, bytes.data() + 8, elem_bytes * n);
      write_text_atomic(tmp / fmt::format("{}.rank{}.bin", file, s.rank), bytes);
    };
    if (s.zero3) save_buffer(s.trainable_shard, s.es(), "trainable");  // in the compute dtype
    // Mixed precision: the fp32 masters (the bf16 weights are their rounding).
    if (s.master_root() >= 0) save_buffer(s.master_root(), 4, "master");
  }
  if (s.comm) s.comm->barrier();
  if (s.rank == 0) {
    save_adapter(tmp);
    const auto& t = s.plan.input.training;
    // A checksum of every file (every rank's are written by now): resume verifies them, so a
    // corrupt or partial checkpoint is refused rather than loaded.
    nlohmann::json files = nlohmann::json::object();
    for (const auto& e : fs::directory_iterator(tmp))
      if (e.is_regular_file()) files[e.path().filename().string()] = models::sha256_hex(read_file_bytes(e.path()));
    const nlohmann::json state = {{"schema", schemas::kCheckpoint},
                                  {"sha256", files},
                                  {"step", s.steps_done},
                                  {"next_sequence", s.steps_done * t.micro_batch * t.grad_accum * s.N},
                                  {"seed", s.plan.run.seed},
                                  {"ranks", s.N},
                                  {"strategy", planner::name_of(s.plan.input.strategy.stage)},
                                  {"offload_optimizer", s.host_params >= 0},
                                  {"compute_dtype", name_of(s.dt)}};
    write_text_atomic(tmp / "trainer_state.json", state.dump(1) + "\n");
    replace_directory(tmp, final_dir);
    write_text_atomic(dir / "latest", name + "\n");
  }
  if (s.comm) s.comm->barrier();
}

// A checkpoint folder's files against the checksums its trainer_state.json records: "" when they
// all match, else what is wrong, naming the file.
static std::string checkpoint_problem(const std::filesystem::path& dir) {
  namespace fs = std::filesystem;
  if (!fs::exists(dir / "trainer_state.json")) return fmt::format("{}/trainer_state.json: missing (a partial checkpoint)", dir.string());
  const nlohmann::json st = nlohmann::json::parse(std::ifstream(dir / "trainer_state.json"), nullptr, false);
  if (st.is_discarded() || !st.contains("step")) return fmt::format("{}/trainer_state.json: not a peftplan checkpoint", dir.string());
  if (!st.contains("sha256") || !st["sha256"].is_object())
    return fmt::format("{}/trainer_state.json: sha256 is missing (a checkpoint without checksums cannot be verified)", dir.string());
  for (const auto& [name, want] : st["sha256"].items()) {
    const fs::path f = dir / name;
    if (!fs::is_regular_file(f)) return fmt::format("{}: missing (the checkpoint is partial)", f.string());
    if (!want.is_string() || models::sha256_hex(read_file_bytes(f)) != want.get<std::string>())
      return fmt::format("{}: its SHA-256 differs from trainer_state.json's (the file is corrupt)", f.string());
  }
  return "";
}

void Session::resume(const std::filesystem::path& where_in) {
  namespace fs = std::filesystem;
  Impl& s = *impl_;
  // "<dir>/latest-good": the newest step-<k> folder of <dir> whose files all verify.
  fs::path where = where_in;
  std::string skipped;
  if (where.filename() == "latest-good") {
    const fs::path base = where.parent_path();
    std::vector<std::pair<std::int64_t, fs::path>> steps;
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(base, ec)) {
      const std::string n = e.path().filename().string();
      if (e.is_directory() && n.rfind("step-", 0) == 0 && n.find(".tmp") == std::string::npos) {
        try {
          steps.push_back({std::stoll(n.substr(5)), e.path()});
        } catch (const std::exception&) {
        }
      }
    }
    std::sort(steps.rbegin(), steps.rend());
    std::optional<fs::path> good;
    for (const auto& [k, d] : steps) {
      const std::string problem = checkpoint_problem(d);
      if (problem.empty()) {
        good = d;
        break;
      }
      skipped += (skipped.empty() ? "" : "; ") + problem;
    }
    if (!good) throw InputError(fmt::format("{}: no checkpoint under {} verifies{}", where.string(), base.string(), skipped.empty() ? "" : ": " + skipped));
    where = *good;
  }
  fs::path dir = where;
  if (!fs::exists(dir / "trainer_state.json") && fs::exists(dir / "latest")) {
    std::ifstream f(dir / "latest");
    std::string name;
    f >> name;
    dir /= name;
  }
  if (!fs::exists(dir / "trainer_state.json"))
    throw InputError(fmt::format("{}: no checkpoint here (no trainer_state.json, no latest)", where.string()));
  if (const std::string problem = checkpoint_problem(dir); !problem.empty())
    throw InputError(problem + "; resume from <checkpoint_dir>/latest-good to fall back to the newest checkpoint that verifies");
  const nlohmann::json st = nlohmann::json::parse(std::ifstream(dir / "trainer_state.json"), nullptr, false);
  auto same = [&](const char* key, const nlohmann::json& want) {
    if (st.value(key, nlohmann::json()) != want)
      throw InputError(fmt::format("{}/trainer_state.json: {} is {}, this run has {}", dir.string(), key, st.value(key, nlohmann::json()).dump(),
                                   want.dump()));
  };
  same("ranks", s.N);
  same("strategy", std::string(planner::name_of(s.plan.input.strategy.stage)));
  same("seed", s.plan.run.seed);
  same("offload_optimizer", s.host_params >= 0);
  // (A checkpoint from before mixed precision has no compute_dtype: it was fp32.)
  if (const std::string was = st.value("compute_dtype", std::string("fp32")); was != name_of(s.dt))
    throw InputError(fmt::format("{}/trainer_state.json: compute_dtype is {}, this run has {}", dir.string(), was, name_of(s.dt)));
  const SafetensorsFile adapter = SafetensorsFile::open(dir / "adapter_model.safetensors");
  for (const auto& [id, tt] : s.adapter_views) {
    std::vector<float> host(static_cast<std::size_t>(tt->numel()));
    init_adapter_tensor(*tt, host, s.plan.run.seed, &adapter);
    s.write_compute(id, host);
  }
  const fs::path opt = dir / fmt::format("optimizer.rank{}.bin", s.rank);
  std::ifstream f(opt, std::ios::binary);
  std::uint64_t ns = 0, np = 0;
  f.read(reinterpret_cast<char*>(&ns), 8);
  f.read(reinterpret_cast<char*>(&np), 8);
  const std::uint64_t want_np = s.host_params >= 0 ? static_cast<std::uint64_t>(s.floats(s.host_params)) : 0;
  if (!f || ns != static_cast<std::uint64_t>(s.floats(s.opt_states)) || np != want_np)
    throw InputError(fmt::format("{}: optimizer states of another shape (or missing)", opt.string()));
  std::vector<char> host(4 * std::max(ns, np));  // read on the host, staged to the device
  f.read(host.data(), static_cast<std::streamsize>(4 * ns));
  if (f) s.write_bytes(s.opt_states, host.data(), 4 * ns);
  if (f && np) {
    f.read(host.data(), static_cast<std::streamsize>(4 * np));
    if (f) s.write_bytes(s.host_params, host.data(), 4 * np);
  }
  if (!f) throw InputError(fmt::format("{}: truncated", opt.string()));
  // A buffer save_checkpoint wrote as a file (a uint64 element count, then its bytes), back.
  auto load_buffer = [&](std::int32_t id, std::uint64_t elem_bytes, const char* name, const char* what) {
    const fs::path path = dir / fmt::format("{}.rank{}.bin", name, s.rank);
    std::ifstream in(path, std::ios::binary);
    std::uint64_t n = 0;
    in.read(reinterpret_cast<char*>(&n), 8);
    if (!in || n != s.bytes(id) / elem_bytes) throw InputError(fmt::format("{}: {} of another shape (or missing)", path.string(), what));
    std::vector<char> blob(elem_bytes * n);
    in.read(blob.data(), static_cast<std::streamsize>(blob.size()));
    if (!in) throw InputError(fmt::format("{}: truncated", path.string()));
    s.write_bytes(id, blob.data(), blob.size());
  };
  if (s.zero3) load_buffer(s.trainable_shard, s.es(), "trainable", "adapter partition");  // padding included
  if (s.master_root() >= 0) load_buffer(s.master_root(), 4, "master", "fp32 master weights (a checkpoint of an fp32 run has none)");
  s.steps_done = st.at("step").get<std::int64_t>();
}

}  // namespace peftplan::executor
