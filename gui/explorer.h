// The what-if explorer's window: inputs on the left, views on the right (memory per strategy,
// step time, the recommendation, what moves when one knob changes, the step timeline of your
// strategy, two scenarios side by side, a run's predicted against measured), a verdict line at
// the bottom. Presentation only: every number comes from the planner (reports::seed_strategies,
// planner::recommend, reports::knob_deltas, reports::predicted_timeline,
// planner::validation_from_json), re-planned off the GUI thread on every change, the newest
// request winning.
#pragma once

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include <QMainWindow>
#include <nlohmann/json.hpp>

#include "peftplan/planner/recommend.h"
#include "peftplan/reports/report.h"

class QComboBox;
class QSpinBox;
class QLabel;
class QTabWidget;
class QTextBrowser;
class QTableWidget;
class QCheckBox;

class QChartView;

namespace peftplan::gui {

// The scenario's inputs, as the controls hold them.
struct Scenario {
  std::string model = "llama-2-7b";
  int lora_r = 16;            // 0: full fine-tuning
  int lora_alpha = 0;         // LoRA's alpha (the scale alpha / r); 0: equal to the rank
  std::string targets = "q_proj,v_proj";
  bool qlora = false;
  int micro_batch = 2;
  int seq_len = 2048;
  std::string precision = "bf16";
  std::string checkpointing = "none";  // none, full, every-K
  std::string attention = "flash";     // eager, flash
  int grad_accum = 1;
  std::string cluster = "8xA100-80GB";
  int gpus = 8;
  std::string profile = "deepspeed";
  std::string strategy = "ddp";  // the configuration the verdict and the knobs are about
  bool offload_optimizer = false;  // to the CPU (ZeRO)
  bool offload_param = false;      // to the CPU (ZeRO-3, FSDP)
  // Files in place of controls: PEFT's adapter_config.json (the adapter: rank, alpha, targets,
  // quantisation stay the QLoRA box's) and a launcher's config — DeepSpeed's ds_config.json or
  // accelerate's YAML — which sets the strategy (planner::apply_ds_config,
  // apply_accelerate_config). Empty: the controls say.
  std::string adapter_config;
  std::string launcher_config;
};

// Everything the views show for one scenario, computed off the GUI thread.
struct Result {
  std::uint64_t generation = 0;
  Scenario scenario;  // what was planned (the controls may have moved on since)
  std::string error;  // bad input: the message, and nothing else changes
  std::vector<reports::StrategyColumn> strategies;
  std::optional<planner::Recommendation> recommendation;
  std::vector<reports::KnobDelta> knobs;
  std::optional<planner::Plan> base;  // the scenario's own configuration (your strategy)
  std::vector<std::string> warnings;  // from a launcher config (keys peftplan does not model)
  std::string verdict;
};


// The plan input and cluster a scenario describes (a launcher config, when given, last: it sets
// the strategy as `plan --ds-config` / `--accelerate-config` do); warnings from its files are
// appended. Throws InputError for bad input.
planner::PlanInput scenario_input(const Scenario& s, sim::Cluster& cluster, std::vector<std::string>& warnings);

// Plans a scenario (the work of one re-plan; public for tests and the benchmark).
Result plan_scenario(const Scenario& s, std::uint64_t generation);

// A scenario as JSON ("schema": "peftplan.scenario/1") and back; reading throws InputError
// naming `source` and the field.
nlohmann::json scenario_to_json(const Scenario& s);
Scenario scenario_from_json(const nlohmann::json& j, std::string_view source);

class Explorer : public QMainWindow {
  Q_OBJECT
 public:
  explicit Explorer(QWidget* parent = nullptr);
  ~Explorer() override;

  Scenario scenario() const;
  void set_scenario(const Scenario& s);  // sets the controls (each change re-plans; the newest wins)
  const Result& result() const { return result_; }
  QTabWidget* views() const { return tabs_; }
  // What hovering a memory segment shows: the category's derivation for that strategy
  // (planner::explain_plan, as `peftplan explain` prints it).
  std::string segment_formula(sim::MemCategory category, int strategy) const;
  QLabel* verdict_line() const { return verdict_; }
  // Whether the views show the answer (a result or an error) to the newest change: no re-plan is
  // waiting or running. Tests wait on it rather than on a quiet interval, which a loaded machine
  // stretches.
  bool settled() const { return shown_generation_ == generation_.load(); }

  // File actions (the menu's, and the tests'): each writes atomically; a bad file shows its
  // error in the verdict line and changes nothing. Return whether they succeeded.
  bool save_scenario(const std::string& path);
  bool load_scenario(const std::string& path);
  bool export_report(const std::string& dir);  // `peftplan report`'s files for what is shown
  // The launcher config of your strategy as shown: ds_config.json for a DeepSpeed plan (ZeRO),
  // accelerate's YAML for FSDP and for DDP under the hf profile (planner::write_ds_config,
  // write_accelerate_config). The file's kind follows the plan, not the name given.
  bool export_launcher_config(const std::string& path);
  // The files to launch your strategy with, as `recommend --emit` writes them for its top row
  // (reports::emit_launch_files): plan.json, the launcher's config, adapter_config.json, train.py
  // and launch.sh.
  bool export_launch_files(const std::string& dir);
  // Files in place of controls (see Scenario); each is read at once, and a bad one changes
  // nothing. A launcher config also sets the strategy and offload controls (shown, then locked)
  // and, for accelerate's YAML, the hf profile. An empty path goes back to the controls.
  bool set_adapter_config(const std::string& path);
  bool set_launcher_config(const std::string& path);
  // A `peftplan run` folder (its summary.json, or one strategy's validation.json) or a
  // validation.json: predicted against measured, figure by figure, in the "measured" view.
  bool open_run(const std::string& path);
  // Keeps what is shown as scenario B; the "compare" view puts the current scenario (A) beside it.
  void pin_scenario();
  QWidget* timeline() const;
  QTableWidget* comparison() const { return compare_; }
  QLabel* comparison_note() const { return compare_note_; }
  QTableWidget* measured() const { return measured_; }
  // Shows the view of that name ("memory", "time", "recommendation", "what moves", "timeline",
  // "compare", "measured"); false when there is none.
  bool show_view(const std::string& name);

 signals:
  void planned();  // the views show a new result
  // The newest change is answered: a result shown (ok) or its error in the verdict line.
  void answered(bool ok);

 private:
  void request();                 // a control changed: plan it off the GUI thread
  void show_error(const std::string& message);
  void show_result(Result r);     // on the GUI thread
  void build_memory_view();
  void build_time_view();
  void build_comparison();
  void show_files();  // the files in place of controls, and which controls they lock

  QComboBox *model_, *targets_, *precision_, *checkpointing_, *attention_, *cluster_, *profile_, *strategy_;
  QSpinBox *lora_r_, *lora_alpha_, *micro_batch_, *seq_len_, *grad_accum_, *gpus_;
  QCheckBox *qlora_, *offload_optimizer_, *offload_param_;
  QLabel* files_;
  QTabWidget* tabs_;
  QChartView *memory_view_, *time_view_;
  QTextBrowser* recommendation_;
  QTableWidget* knobs_;
  class TimelineView* timeline_;
  QTableWidget* compare_;
  QLabel* compare_note_;
  QTableWidget* measured_;
  QLabel* measured_note_;
  QLabel* verdict_;
  Result result_;
  std::string adapter_config_, launcher_config_;
  std::optional<std::pair<Scenario, Result>> pinned_;  // scenario B
  bool loading_ = false;
  // The worker: one thread, one pending request (a newer one replaces it), joined on close.
  std::mutex mu_;
  std::condition_variable cv_;
  std::optional<std::pair<Scenario, std::uint64_t>> pending_;
  bool stop_ = false;
  std::atomic<std::uint64_t> generation_{0};
  std::uint64_t shown_generation_ = 0;  // the request the views answer (GUI thread)
  std::thread worker_;
};

}  // namespace peftplan::gui
