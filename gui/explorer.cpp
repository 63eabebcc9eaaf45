// The explorer's window (see explorer.h).
#include "explorer.h"

#include <charconv>
#include <filesystem>

#include <QApplication>
#include <QCheckBox>
#include <QComboBox>
#include <QCursor>
#include <QToolTip>
#include <QFileDialog>
#include <QFormLayout>
#include <QMenuBar>
#include <QHBoxLayout>
#include <QHeaderView>
#include <QLabel>
#include <QSpinBox>
#include <QSplitter>
#include <QTabWidget>
#include <QTableWidget>
#include <QTextBrowser>
#include <QVBoxLayout>
#include <QtCharts/QBarCategoryAxis>
#include <QtCharts/QBarSet>
#include <QtCharts/QChart>
#include <QtCharts/QChartView>
#include <QtCharts/QHorizontalStackedBarSeries>
#include <QtCharts/QLineSeries>
#include <QtCharts/QStackedBarSeries>
#include <QtCharts/QValueAxis>

#include <fmt/format.h>

#include "peftplan/common/atomic_file.h"
#include "peftplan/common/error.h"
#include "peftplan/common/json_fields.h"
#include "peftplan/common/schemas.h"
#include "peftplan/common/units.h"
#include "peftplan/models/config.h"
#include "peftplan/planner/ds_config.h"
#include "peftplan/planner/explain.h"
#include "peftplan/planner/launcher_config.h"
#include "peftplan/planner/validate.h"
#include "peftplan/reports/colours.h"
#include "peftplan/reports/launch_files.h"
#include "peftplan/reports/svg.h"
#include "peftplan/sim/cluster.h"
#include "timeline_view.h"

namespace peftplan::gui {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

// "every-K" -> K, or nullopt.
std::optional<std::int64_t> every_k(const std::string& c) {
  if (c.rfind("every-", 0) != 0) return std::nullopt;
  std::int64_t k = 0;
  const char* end = c.data() + c.size();
  const auto [at, ec] = std::from_chars(c.data() + 6, end, k);
  if (ec != std::errc() || at != end || k <= 0) return std::nullopt;
  return k;
}

bool is_yaml(const std::string& path) {
  const std::string ext = std::filesystem::path(path).extension().string();
  return ext == ".yaml" || ext == ".yml";
}

}  // namespace

planner::PlanInput scenario_input(const Scenario& s, sim::Cluster& cluster, std::vector<std::string>& warnings) {
  planner::PlanInput in;
  in.model = models::load_model(s.model);
  if (!s.adapter_config.empty()) {
    std::filesystem::path p = s.adapter_config;
    std::error_code ec;
    if (std::filesystem::is_directory(p, ec)) p /= "adapter_config.json";
    in.peft.adapters.push_back(models::adapter_from_config(models::read_json_file(p.string()), p.string()));
  } else if (s.lora_r > 0) {
    models::AdapterSpec a;
    a.type = models::PeftType::lora;
    a.lora.r = s.lora_r;
    a.lora.alpha = s.lora_alpha > 0 ? s.lora_alpha : s.lora_r;
    if (s.targets == "all-linear") a.lora.targets.kind = models::ModuleSelector::Kind::all_linear;
    else {
      a.lora.targets.kind = models::ModuleSelector::Kind::list;
      std::size_t at = 0;
      for (std::size_t c; (c = s.targets.find(',', at)) != std::string::npos; at = c + 1) a.lora.targets.names.push_back(s.targets.substr(at, c - at));
      a.lora.targets.names.push_back(s.targets.substr(at));
    }
    in.peft.adapters.push_back(a);
  } else {
    in.training.full_finetune = true;
  }
  if (s.qlora && !in.training.full_finetune) {
    models::Quantization q;
    q.dtype = DType::nf4;
    q.double_quant = true;
    in.peft.quantization = q;
  }
  // The QLoRA box always states a base (ticked nf4, unticked unquantised): the verdict says when
  // a checkpoint saved quantised plans otherwise.
  for (auto& w : models::apply_checkpoint_quantization(in.model, in.peft, true)) warnings.push_back(std::move(w));
  in.training.micro_batch = s.micro_batch;
  in.training.seq_len = s.seq_len;
  in.training.grad_accum = s.grad_accum;
  in.training.attention = planner::from_name(s.attention, planner::kAttentions).value_or(planner::Attention::flash);
  if (auto p = planner::from_name(s.precision, planner::kPrecisions)) in.training.precision = *p;
  if (s.checkpointing == "full") in.training.checkpointing = planner::Checkpointing::full;
  else if (const auto k = every_k(s.checkpointing)) {
    in.training.checkpointing = planner::Checkpointing::every_k;
    in.training.checkpoint_every = *k;
  }
  in.profile = planner::from_name(s.profile, planner::kRuntimeProfiles).value_or(planner::RuntimeProfile::deepspeed);
  cluster = sim::resolve_cluster(s.cluster);
  in.strategy.ranks = std::min(s.gpus, sim::total_gpus(cluster));
  in.strategy.stage = planner::from_name(s.strategy, planner::kStages).value_or(planner::Stage::ddp);
  if (in.strategy.stage == planner::Stage::fsdp_hybrid_shard) in.strategy.shard_group = std::min(cluster.gpus_per_node, in.strategy.ranks);
  if (s.offload_optimizer) in.strategy.offload_optimizer = planner::OffloadDevice::cpu;
  if (s.offload_param) in.strategy.offload_param = planner::OffloadDevice::cpu;
  if (!s.launcher_config.empty()) {
    if (is_yaml(s.launcher_config))
      planner::apply_accelerate_config(in, planner::read_accelerate_config_file(s.launcher_config), s.launcher_config, cluster,
                                       {.gpus = in.strategy.ranks, .profile_given = true}, warnings);
    else
      planner::apply_ds_config(in, models::read_json_file(s.launcher_config), s.launcher_config, warnings);
  }
  return in;
}

namespace {

QColor colour(std::string_view hex) { return QColor(QString::fromUtf8(hex.data(), static_cast<int>(hex.size()))); }

// How the explorer names a knob in the planner's suggestions: its control's label, or the
// field for knobs it has no control for.
std::string control_of(planner::Knob k) {
  using planner::Knob;
  switch (k) {
    case Knob::model: return "model";
    case Knob::lora_r: return "LoRA rank";
    case Knob::quantization: return "QLoRA";
    case Knob::stage:
    case Knob::search_stages: return "your strategy";
    case Knob::ranks:
    case Knob::search_gpus: return "GPUs";
    case Knob::profile: return "runtime profile";
    case Knob::micro_batch: return "micro-batch";
    case Knob::seq_len: return "sequence";
    case Knob::precision: return "precision";
    case Knob::checkpointing: return "checkpointing";
    case Knob::gpu: return "cluster";
    default: return std::string(planner::field_of(k));
  }
}

// "; try ..." after a reason, or nothing.
std::string then_try(const std::vector<planner::Suggestion>& s) {
  return s.empty() ? std::string() : "; " + planner::suggestion_text(s, control_of);
}

}  // namespace

Result plan_scenario(const Scenario& s, std::uint64_t generation) {
  Result r;
  r.generation = generation;
  r.scenario = s;
  try {
    sim::Cluster cluster;
    const planner::PlanInput in = scenario_input(s, cluster, r.warnings);
    planner::PlanOptions po;
    // Your configuration under the profile that runs it (planner::profile_that_runs), as plan
    // without --profile does: pure-bf16 DDP is the Trainer's own DDP, since DeepSpeed runs pure
    // bf16 only under ZeRO. The columns and the search keep the profile chosen.
    planner::PlanInput yours_in = in;
    yours_in.profile = planner::profile_that_runs(in.profile, in.strategy, in.training);
    if (yours_in.profile != in.profile)
      r.warnings.push_back(planner::profile_switch_warning(in.strategy, in.training, yours_in.profile, ""));
    const planner::Plan base = planner::make_plan(yours_in, cluster, po);
    const std::string yours(planner::name_of(in.strategy.stage));
    std::vector<std::string> refused;
    r.strategies = reports::seed_strategies(in, cluster, po.headroom_fraction, &refused);
    for (const auto& x : refused) r.warnings.push_back("not shown: " + x);
    r.knobs = reports::knob_deltas(base);
    r.recommendation = planner::recommend(in, cluster, {}, planner::Constraints{}, planner::Objective::tokens_per_s);
    const std::int64_t spare = planner::spare_bytes(base);
    r.verdict = base.fits ? fmt::format("{} fits with {:.1f} GiB to spare ({:.1f} GiB in use of {:.1f} GiB, {:.0f}% headroom kept)", yours,
                                        static_cast<double>(spare) / kGiB, to_gib(base.used_peak_bytes), to_gib(base.device_capacity_bytes),
                                        100 * base.headroom_fraction)
                          : fmt::format("{} does not fit: {}{}", yours, base.reasons.empty() ? std::string() : base.reasons.front(),
                                        then_try(base.suggestions));
    r.base = base;
  } catch (const InputError& e) {
    r.error = e.what();
  }
  return r;
}

nlohmann::json scenario_to_json(const Scenario& s) {
  return {{"schema", schemas::kScenario}, {"model", s.model},   {"lora_r", s.lora_r},         {"lora_alpha", s.lora_alpha}, {"targets", s.targets},
          {"qlora", s.qlora},             {"micro_batch", s.micro_batch}, {"seq_len", s.seq_len}, {"precision", s.precision},
          {"checkpointing", s.checkpointing}, {"cluster", s.cluster}, {"gpus", s.gpus},       {"profile", s.profile},
          {"strategy", s.strategy}, {"attention", s.attention}, {"grad_accum", s.grad_accum},
          {"offload_optimizer", s.offload_optimizer}, {"offload_param", s.offload_param},
          {"adapter_config", s.adapter_config}, {"launcher_config", s.launcher_config}};
}

Scenario scenario_from_json(const nlohmann::json& j, std::string_view source) {
  if (!j.is_object()) throw input_error(source, "", "must hold a JSON object (a peftplan-gui scenario)");
  if (!j.contains("schema") || j["schema"] != schemas::kScenario)
    throw input_error(source, "schema", fmt::format("must be \"{}\"", schemas::kScenario), j.contains("schema") ? j["schema"].dump() : "none");
  Scenario s;  // each field through the shared reader (common/json_fields.h); absent keeps the default
  auto text = [&](const char* k, std::string& into) { into = json_fields::string(j, k, source, into); };
  auto integer = [&](const char* k, int& into, int lo, int hi) {
    into = static_cast<int>(json_fields::integer(j, k, source, into, {}, lo, hi));
  };
  text("model", s.model);
  integer("lora_r", s.lora_r, 0, 4096);
  integer("lora_alpha", s.lora_alpha, 0, 1 << 20);
  text("targets", s.targets);
  s.qlora = json_fields::boolean(j, "qlora", source, s.qlora);
  integer("micro_batch", s.micro_batch, 1, 4096);
  integer("seq_len", s.seq_len, 16, 1 << 20);
  text("precision", s.precision);
  if (!planner::from_name(s.precision, planner::kPrecisions))
    throw input_error(source, "precision", "must be one of " + planner::names_of(planner::kPrecisions), "\"" + s.precision + "\"");
  text("checkpointing", s.checkpointing);
  if (s.checkpointing != "none" && s.checkpointing != "full" && !every_k(s.checkpointing))
    throw input_error(source, "checkpointing", "must be none, full or every-K with a positive K", "\"" + s.checkpointing + "\"");
  text("attention", s.attention);
  if (!planner::from_name(s.attention, planner::kAttentions))
    throw input_error(source, "attention", "must be one of " + planner::names_of(planner::kAttentions), "\"" + s.attention + "\"");
  integer("grad_accum", s.grad_accum, 1, 1 << 20);
  s.offload_optimizer = json_fields::boolean(j, "offload_optimizer", source, s.offload_optimizer);
  s.offload_param = json_fields::boolean(j, "offload_param", source, s.offload_param);
  text("adapter_config", s.adapter_config);
  text("launcher_config", s.launcher_config);
  text("cluster", s.cluster);
  integer("gpus", s.gpus, 1, 100000);
  text("profile", s.profile);
  if (!planner::from_name(s.profile, planner::kRuntimeProfiles))
    throw input_error(source, "profile", "must be one of " + planner::names_of(planner::kRuntimeProfiles), "\"" + s.profile + "\"");
  text("strategy", s.strategy);
  if (!planner::from_name(s.strategy, planner::kStages))
    throw input_error(source, "strategy", "must be one of " + planner::names_of(planner::kStages), "\"" + s.strategy + "\"");
  return s;
}

Explorer::Explorer(QWidget* parent) : QMainWindow(parent) {
  setWindowTitle("peftplan explorer");
  auto* central = new QWidget(this);
  auto* outer = new QVBoxLayout(central);
  auto* split = new QSplitter(central);
  auto* inputs = new QWidget(split);
  auto* form = new QFormLayout(inputs);
  model_ = new QComboBox(inputs);
  for (const auto& z : models::zoo()) model_->addItem(QString::fromStdString(z.name));
  model_->setEditable(true);  // a config.json path too
  lora_r_ = new QSpinBox(inputs);
  lora_r_->setRange(0, 4096);
  lora_r_->setSpecialValueText("full fine-tuning");
  lora_alpha_ = new QSpinBox(inputs);
  lora_alpha_->setRange(0, 1 << 20);
  lora_alpha_->setSpecialValueText("= rank");
  targets_ = new QComboBox(inputs);
  targets_->addItems({"q_proj,v_proj", "q_proj,k_proj,v_proj,o_proj", "all-linear"});
  qlora_ = new QCheckBox("nf4 base (QLoRA)", inputs);
  micro_batch_ = new QSpinBox(inputs);
  micro_batch_->setRange(1, 4096);
  seq_len_ = new QSpinBox(inputs);
  seq_len_->setRange(16, 1 << 20);
  seq_len_->setSingleStep(512);
  precision_ = new QComboBox(inputs);
  for (auto p : planner::kPrecisions) precision_->addItem(QString::fromUtf8(planner::name_of(p).data()));
  checkpointing_ = new QComboBox(inputs);
  checkpointing_->addItems({"none", "full", "every-2", "every-4", "every-8"});
  attention_ = new QComboBox(inputs);
  for (auto a : planner::kAttentions) attention_->addItem(QString::fromUtf8(planner::name_of(a).data()));
  grad_accum_ = new QSpinBox(inputs);
  grad_accum_->setRange(1, 1 << 20);
  offload_optimizer_ = new QCheckBox("optimizer to the CPU", inputs);
  offload_param_ = new QCheckBox("parameters to the CPU", inputs);
  files_ = new QLabel(inputs);
  files_->setWordWrap(true);
  cluster_ = new QComboBox(inputs);
  for (const auto& p : sim::preset_names()) cluster_->addItem(QString::fromStdString(p));
  cluster_->setEditable(true);  // a spelling such as 2x8xH100-SXM-NDR
  gpus_ = new QSpinBox(inputs);
  gpus_->setRange(1, 100000);
  profile_ = new QComboBox(inputs);
  profile_->addItems({"deepspeed", "hf", "executor"});
  strategy_ = new QComboBox(inputs);
  for (auto s : planner::kStages) strategy_->addItem(QString::fromUtf8(planner::name_of(s).data()));
  form->addRow("model", model_);
  form->addRow("LoRA rank", lora_r_);
  form->addRow("LoRA alpha", lora_alpha_);
  form->addRow("targets", targets_);
  form->addRow("", qlora_);
  form->addRow("micro-batch", micro_batch_);
  form->addRow("sequence", seq_len_);
  form->addRow("accumulation", grad_accum_);
  form->addRow("precision", precision_);
  form->addRow("checkpointing", checkpointing_);
  form->addRow("attention", attention_);
  form->addRow("cluster", cluster_);
  form->addRow("GPUs", gpus_);
  form->addRow("runtime profile", profile_);
  form->addRow("your strategy", strategy_);
  form->addRow("offload", offload_optimizer_);
  form->addRow("", offload_param_);
  form->addRow(files_);
  tabs_ = new QTabWidget(split);
  memory_view_ = new QChartView(tabs_);
  time_view_ = new QChartView(tabs_);
  recommendation_ = new QTextBrowser(tabs_);
  knobs_ = new QTableWidget(tabs_);
  timeline_ = new TimelineView(tabs_);
  auto* compare_page = new QWidget(tabs_);
  auto* compare_layout = new QVBoxLayout(compare_page);
  compare_note_ = new QLabel("Scenario → Pin as B keeps what is shown; then every change is compared with it here.", compare_page);
  compare_note_->setWordWrap(true);
  compare_ = new QTableWidget(compare_page);
  compare_layout->addWidget(compare_note_);
  compare_layout->addWidget(compare_, 1);
  auto* measured_page = new QWidget(tabs_);
  auto* measured_layout = new QVBoxLayout(measured_page);
  measured_note_ = new QLabel("File → Open run… shows a peftplan run folder or a validation.json: predicted against measured.", measured_page);
  measured_note_->setWordWrap(true);
  measured_ = new QTableWidget(measured_page);
  measured_layout->addWidget(measured_note_);
  measured_layout->addWidget(measured_, 1);
  tabs_->addTab(memory_view_, "memory");
  tabs_->addTab(time_view_, "time");
  tabs_->addTab(recommendation_, "recommendation");
  tabs_->addTab(knobs_, "what moves");
  tabs_->addTab(timeline_, "timeline");
  tabs_->addTab(compare_page, "compare");
  tabs_->addTab(measured_page, "measured");
  split->addWidget(inputs);
  split->addWidget(tabs_);
  split->setStretchFactor(1, 3);
  verdict_ = new QLabel(central);
  verdict_->setWordWrap(true);
  outer->addWidget(split, 1);
  outer->addWidget(verdict_);
  setCentralWidget(central);
  resize(1280, 760);
  QMenu* file = menuBar()->addMenu("&File");
  file->addAction("Open scenario…", this, [this] {
    const QString f = QFileDialog::getOpenFileName(this, "Open scenario", {}, "scenario (*.json)");
    if (!f.isEmpty()) load_scenario(f.toStdString());
  });
  file->addAction("Save scenario…", this, [this] {
    const QString f = QFileDialog::getSaveFileName(this, "Save scenario", "scenario.json", "scenario (*.json)");
    if (!f.isEmpty()) save_scenario(f.toStdString());
  });
  file->addSeparator();
  file->addAction("Open adapter_config.json…", this, [this] {
    const QString f = QFileDialog::getOpenFileName(this, "PEFT adapter_config.json", {}, "adapter config (*.json)");
    if (!f.isEmpty()) set_adapter_config(f.toStdString());
  });
  file->addAction("Open ds_config.json or accelerate YAML…", this, [this] {
    const QString f = QFileDialog::getOpenFileName(this, "Launcher config", {}, "ds_config.json or accelerate config (*.json *.yaml *.yml)");
    if (!f.isEmpty()) set_launcher_config(f.toStdString());
  });
  file->addAction("Back to the controls (forget the files)", this, [this] {
    set_adapter_config("");
    set_launcher_config("");
  });
  file->addAction("Open run…", this, [this] {
    const QString f = QFileDialog::getOpenFileName(this, "A peftplan run's summary.json or validation.json", {}, "run (*.json)");
    if (!f.isEmpty()) open_run(f.toStdString());
  });
  file->addSeparator();
  file->addAction("Export report…", this, [this] {
    const QString d = QFileDialog::getSaveFileName(this, "Export report (a folder)", "report");
    if (!d.isEmpty()) export_report(d.toStdString());
  });
  file->addAction("Export launcher config…", this, [this] {
    const bool accelerate = result_.base && !planner::launches_with_deepspeed(result_.base->input);
    const QString f = QFileDialog::getSaveFileName(this, "Export launcher config", accelerate ? "accelerate_config.yaml" : "ds_config.json");
    if (!f.isEmpty()) export_launcher_config(f.toStdString());
  });
  file->addAction("Export launch files…", this, [this] {
    const QString d = QFileDialog::getExistingDirectory(this, "Export launch files into a folder");
    if (!d.isEmpty()) export_launch_files(d.toStdString());
  });
  QMenu* scenario_menu = menuBar()->addMenu("&Scenario");
  scenario_menu->addAction("Pin as B (compare)", this, [this] {
    pin_scenario();
    show_view("compare");
  });

  worker_ = std::thread([this] {
    for (;;) {
      std::pair<Scenario, std::uint64_t> job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || pending_.has_value(); });
        if (stop_) return;
        job = std::move(*pending_);
        pending_.reset();
      }
      Result r = plan_scenario(job.first, job.second);
      // Queued to the GUI thread; the destructor joins this thread before the window goes.
      QMetaObject::invokeMethod(this, [this, r = std::move(r)]() mutable { show_result(std::move(r)); }, Qt::QueuedConnection);
    }
  });

  set_scenario(Scenario{});
  auto changed = [this] { request(); };
  for (QComboBox* c : {model_, targets_, precision_, checkpointing_, attention_, cluster_, profile_, strategy_})
    connect(c, &QComboBox::currentTextChanged, this, changed);
  for (QSpinBox* b : {lora_r_, lora_alpha_, micro_batch_, seq_len_, grad_accum_, gpus_}) connect(b, qOverload<int>(&QSpinBox::valueChanged), this, changed);
  for (QCheckBox* b : {qlora_, offload_optimizer_, offload_param_}) connect(b, &QCheckBox::toggled, this, changed);
  request();
}

Explorer::~Explorer() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (worker_.joinable()) worker_.join();
}

Scenario Explorer::scenario() const {
  Scenario s;
  s.model = model_->currentText().toStdString();
  s.lora_r = lora_r_->value();
  s.lora_alpha = lora_alpha_->value();
  s.targets = targets_->currentText().toStdString();
  s.qlora = qlora_->isChecked();
  s.micro_batch = micro_batch_->value();
  s.seq_len = seq_len_->value();
  s.precision = precision_->currentText().toStdString();
  s.checkpointing = checkpointing_->currentText().toStdString();
  s.attention = attention_->currentText().toStdString();
  s.grad_accum = grad_accum_->value();
  s.cluster = cluster_->currentText().toStdString();
  s.gpus = gpus_->value();
  s.profile = profile_->currentText().toStdString();
  s.strategy = strategy_->currentText().toStdString();
  s.offload_optimizer = offload_optimizer_->isChecked();
  s.offload_param = offload_param_->isChecked();
  s.adapter_config = adapter_config_;
  s.launcher_config = launcher_config_;
  return s;
}

void Explorer::set_scenario(const Scenario& s) {
  loading_ = true;  // one request for the whole scenario, not one per control
  model_->setCurrentText(QString::fromStdString(s.model));
  lora_r_->setValue(s.lora_r);
  lora_alpha_->setValue(s.lora_alpha);
  targets_->setCurrentText(QString::fromStdString(s.targets));
  qlora_->setChecked(s.qlora);
  micro_batch_->setValue(s.micro_batch);
  seq_len_->setValue(s.seq_len);
  precision_->setCurrentText(QString::fromStdString(s.precision));
  if (checkpointing_->findText(QString::fromStdString(s.checkpointing)) < 0) checkpointing_->addItem(QString::fromStdString(s.checkpointing));
  checkpointing_->setCurrentText(QString::fromStdString(s.checkpointing));
  attention_->setCurrentText(QString::fromStdString(s.attention));
  grad_accum_->setValue(s.grad_accum);
  cluster_->setCurrentText(QString::fromStdString(s.cluster));
  gpus_->setValue(s.gpus);
  profile_->setCurrentText(QString::fromStdString(s.profile));
  strategy_->setCurrentText(QString::fromStdString(s.strategy));
  offload_optimizer_->setChecked(s.offload_optimizer);
  offload_param_->setChecked(s.offload_param);
  adapter_config_ = s.adapter_config;
  launcher_config_ = s.launcher_config;
  show_files();
  loading_ = false;
  request();
}

void Explorer::show_files() {
  std::string text;
  if (!adapter_config_.empty()) text += "adapter: " + adapter_config_ + " (in place of rank and targets)\n";
  if (!launcher_config_.empty())
    text += "launcher: " + launcher_config_ + " (sets the strategy, offload, micro-batch, accumulation and precision; edit the file, or File → Back to "
            "the controls)";
  files_->setText(QString::fromStdString(text));
  for (QWidget* w : std::initializer_list<QWidget*>{lora_r_, lora_alpha_, targets_}) w->setEnabled(adapter_config_.empty());
  for (QWidget* w : std::initializer_list<QWidget*>{strategy_, offload_optimizer_, offload_param_, micro_batch_, grad_accum_, precision_})
    w->setEnabled(launcher_config_.empty());
}

bool Explorer::set_adapter_config(const std::string& path) {
  Scenario s = scenario();
  s.adapter_config = path;
  try {
    sim::Cluster c;
    std::vector<std::string> w;
    (void)scenario_input(s, c, w);  // read now: a bad file changes nothing
  } catch (const InputError& e) {
    show_error(e.what());
    return false;
  }
  set_scenario(s);
  return true;
}

bool Explorer::set_launcher_config(const std::string& path) {
  Scenario s = scenario();
  s.launcher_config = path;
  try {
    if (!path.empty() && !is_yaml(path)) {  // a DeepSpeed config runs ZeRO under DeepSpeed, whatever was shown before
      if (const auto stage = planner::from_name(s.strategy, planner::kStages); stage && planner::is_fsdp(*stage)) s.strategy = "ddp";
      if (s.profile == "hf") s.profile = "deepspeed";
    }
    if (!path.empty() && is_yaml(path)) {
      s.profile = "hf";  // an accelerate job runs transformers + PEFT
      // Its num_processes is the GPU count (the control then overrides it, as accelerate launch
      // --num_processes does).
      const planner::AccelerateConfig ac = planner::read_accelerate_config_file(path);
      if (ac.strategy.ranks > 0) s.gpus = ac.strategy.ranks;
    }
    sim::Cluster c;
    std::vector<std::string> w;
    const planner::PlanInput in = scenario_input(s, c, w);  // read now: a bad file changes nothing
    // The controls show what the file sets (and stay locked while it is in use).
    s.strategy = std::string(planner::name_of(in.strategy.stage));
    s.offload_optimizer = in.strategy.offload_optimizer == planner::OffloadDevice::cpu;
    s.offload_param = in.strategy.offload_param == planner::OffloadDevice::cpu;
    s.micro_batch = static_cast<int>(in.training.micro_batch);
    s.grad_accum = static_cast<int>(in.training.grad_accum);
    s.precision = std::string(planner::name_of(in.training.precision));
  } catch (const InputError& e) {
    show_error(e.what());
    return false;
  }
  set_scenario(s);
  return true;
}

bool Explorer::export_launcher_config(const std::string& path) {
  if (!result_.base) return false;
  try {
    const planner::PlanInput& in = result_.base->input;
    if (!planner::launches_with_deepspeed(in)) {
      const std::int32_t per_node = std::max(1, result_.base->cluster.gpus_per_node);
      write_text_atomic(path, planner::write_accelerate_config(in.strategy, in.training, (in.strategy.ranks + per_node - 1) / per_node));
    } else {
      write_text_atomic(path, planner::write_ds_config(in.strategy, in.training).dump(2) + "\n");
    }
    return true;
  } catch (const InputError& e) {
    show_error(e.what());
    return false;
  }
}

bool Explorer::export_launch_files(const std::string& dir) {
  if (!result_.base) return false;
  try {
    planner::Candidate row;
    row.input = result_.base->input;
    row.family = std::string(planner::name_of(row.input.strategy.stage));
    if (row.input.strategy.offload_optimizer == planner::OffloadDevice::cpu) row.family += " + offload optimizer";
    if (row.input.strategy.offload_param == planner::OffloadDevice::cpu) row.family += " + offload param";
    const auto stale = reports::emit_launch_files(dir, row, result_.base->cluster, row.input.training.eval_batch, result_.scenario.model, "peftplan-gui");
    if (!stale.empty()) verdict_->setText(verdict_->text() + "\n" + QString::fromStdString(reports::stale_launch_files_note(dir, stale)));
    return true;
  } catch (const InputError& e) {
    show_error(e.what());
    return false;
  }
}

bool Explorer::show_view(const std::string& name) {
  for (int i = 0; i < tabs_->count(); ++i)
    if (tabs_->tabText(i).toStdString() == name) {
      tabs_->setCurrentIndex(i);
      return true;
    }
  return false;
}

QWidget* Explorer::timeline() const { return timeline_; }

void Explorer::pin_scenario() {
  if (result_.strategies.empty()) return;
  pinned_ = std::make_pair(result_.scenario, result_);
  build_comparison();
}

void Explorer::build_comparison() {
  if (!pinned_) return;
  const auto& [bs, b] = *pinned_;
  const Scenario& as = result_.scenario;
  // What differs between the two scenarios, field by field.
  const nlohmann::json ja = scenario_to_json(as), jb = scenario_to_json(bs);
  std::string differs;
  for (const auto& [k, v] : ja.items())
    if (jb.contains(k) && jb[k] != v) differs += fmt::format("{}{} {} → {}", differs.empty() ? "" : ", ", k, jb[k].dump(), v.dump());
  compare_note_->setText(QString::fromStdString(fmt::format("A: the scenario shown now; B: the pinned one. {}",
                                                            differs.empty() ? "They do not differ." : "A differs from B in: " + differs + ".")));
  // A row per strategy, matched on what it runs (stage, offloads, full fine-tuning) rather than
  // on its label: the same DDP is "ddp" under deepspeed and "ddp (hf)" in pure bf16, where the
  // Trainer's own DDP runs it (planner::profile_that_runs).
  auto key = [](const reports::StrategyColumn& c) {
    if (!c.plan) return c.label;
    const planner::Strategy& st = c.plan->input.strategy;
    return fmt::format("{}|{}|{}|{}", planner::name_of(st.stage), planner::name_of(st.offload_optimizer), planner::name_of(st.offload_param),
                       c.plan->input.peft.adapters.empty());
  };
  struct Row {
    std::string key, label_a, label_b;
  };
  std::vector<Row> rows;
  for (const Result* r : {static_cast<const Result*>(&result_), &b})
    for (const auto& c : r->strategies) {
      const std::string k = key(c);
      auto it = std::find_if(rows.begin(), rows.end(), [&](const Row& x) { return x.key == k; });
      if (it == rows.end()) it = rows.insert(rows.end(), Row{k, {}, {}});
      (r == &result_ ? it->label_a : it->label_b) = c.label;
    }
  auto find = [&](const Result& r, const std::string& k) -> const planner::Plan* {
    for (const auto& c : r.strategies)
      if (c.plan && key(c) == k) return &*c.plan;
    return nullptr;
  };
  compare_->clear();
  compare_->setColumnCount(9);
  compare_->setHorizontalHeaderLabels({"strategy", "A in use (GiB)", "B in use (GiB)", "A step (s)", "B step (s)", "A tokens/s", "B tokens/s",
                                       "A", "B"});
  compare_->setRowCount(static_cast<int>(rows.size()));
  for (int i = 0; i < static_cast<int>(rows.size()); ++i) {
    const Row& row = rows[static_cast<std::size_t>(i)];
    const planner::Plan* pa = find(result_, row.key);
    const planner::Plan* pb = find(b, row.key);
    const std::string l = row.label_a.empty() || row.label_b.empty() || row.label_a == row.label_b
                              ? (row.label_a.empty() ? row.label_b : row.label_a)
                              : fmt::format("{} / {}", row.label_a, row.label_b);
    auto gib = [](const planner::Plan* p) { return p ? QString::asprintf("%.2f", to_gib(p->used_peak_bytes)) : QString("-"); };
    auto step = [](const planner::Plan* p) { return p && p->time ? QString::asprintf("%.4f", p->time->step_s) : QString("-"); };
    auto tok = [](const planner::Plan* p) { return p && p->time ? QString::asprintf("%.0f", p->time->tokens_per_s) : QString("-"); };
    auto fits = [](const planner::Plan* p) { return p ? QString(p->fits ? "fits" : "does not fit") : QString("-"); };
    const QStringList cells = {QString::fromStdString(l), gib(pa), gib(pb), step(pa), step(pb), tok(pa), tok(pb), fits(pa), fits(pb)};
    for (int c = 0; c < cells.size(); ++c) compare_->setItem(i, c, new QTableWidgetItem(cells[c]));
  }
  compare_->horizontalHeader()->setStretchLastSection(true);
}

bool Explorer::open_run(const std::string& path) {
  try {
    namespace fs = std::filesystem;
    // One validation.json per strategy (planner::run_folders: `report --run`'s rule), each named
    // by its folder.
    std::vector<std::pair<std::string, fs::path>> files;
    for (const fs::path& d : planner::run_folders(path)) files.emplace_back(d.filename().string(), d / "validation.json");
    std::vector<std::pair<std::string, planner::Validation>> vs;
    for (const auto& [name, f] : files) vs.emplace_back(name, planner::validation_from_json(models::read_json_file(f.string()), f.string()));
    measured_->clear();
    measured_->setColumnCount(7);
    measured_->setHorizontalHeaderLabels({"strategy", "figure", "predicted", "measured", "error", "spread", "verdict"});
    // Every figure but the memory categories neither side has (as `run` prints them).
    auto shown = [](const planner::Figure& f) { return f.section != "memory" || f.name == "peak" || f.predicted != 0.0 || f.measured != 0.0; };
    int rows = 0;
    for (const auto& [name, v] : vs)
      for (const auto* section : {&v.memory, &v.time, &v.comm, &v.throughput}) rows += static_cast<int>(std::count_if(section->begin(), section->end(), shown));
    measured_->setRowCount(rows);
    int row = 0;
    std::string summary;
    for (const auto& [name, v] : vs) {
      for (const auto* section : {&v.memory, &v.time, &v.comm, &v.throughput})
        for (const planner::Figure& f : *section) {
          if (!shown(f)) continue;
          const bool time = f.section == "time";
          const bool bytes = f.section == "memory" || f.section == "comm";
          auto value = [&](double x) {
            return bytes ? QString::fromStdString(human_bytes(static_cast<std::uint64_t>(x)))
                         : time ? QString::asprintf("%.3f ms", x * 1e3) : QString::asprintf("%.1f", x);
          };
          const QStringList cells = {QString::fromStdString(name), QString::fromStdString(f.key()), value(f.predicted), value(f.measured),
                                     QString::asprintf("%+.2f%%", 100 * f.relative_error),
                                     f.has_spread ? QString::asprintf("%.3f ms", f.spread * 1e3) : QString(),
                                     QString::fromUtf8(planner::name_of(f.verdict()).data())};
          for (int c = 0; c < cells.size(); ++c) measured_->setItem(row, c, new QTableWidgetItem(cells[c]));
          ++row;
        }
      summary += fmt::format("{}{}: {}", summary.empty() ? "" : "; ", name,
                             !v.outside.empty() ? fmt::format("{} outside", v.outside.size())
                             : !v.inconclusive.empty() ? fmt::format("within, {} inconclusive", v.inconclusive.size())
                                                       : std::string("within tolerance"));
    }
    measured_->resizeColumnsToContents();
    measured_->horizontalHeader()->setStretchLastSection(true);
    measured_note_->setText(QString::fromStdString(fmt::format("{}: {}", path, summary)));
    show_view("measured");
    return true;
  } catch (const InputError& e) {
    show_error(e.what());
    return false;
  }
}

void Explorer::show_error(const std::string& message) {
  verdict_->setText(QString::fromStdString("error: " + message));
  verdict_->setStyleSheet("color:#b00");
}

bool Explorer::save_scenario(const std::string& path) {
  try {
    write_text_atomic(path, scenario_to_json(scenario()).dump(2) + "\n");
    return true;
  } catch (const InputError& e) {
    show_error(e.what());
    return false;
  }
}

bool Explorer::load_scenario(const std::string& path) {
  try {
    set_scenario(scenario_from_json(models::read_json_file(path), path));  // read whole before any control changes
    return true;
  } catch (const InputError& e) {
    show_error(e.what());
    return false;
  }
}

bool Explorer::export_report(const std::string& dir) {
  if (result_.strategies.empty()) return false;
  try {
    reports::ReportInput ri;
    const Scenario& s = result_.scenario;
    ri.title = fmt::format("{} on {} ({} GPUs), from peftplan-gui", s.model, s.cluster, s.gpus);
    ri.provenance.version = reports::version_string();
    ri.provenance.command = fmt::format("peftplan-gui scenario {}", scenario_to_json(s).dump());
    ri.provenance.inputs = {{"model", s.model}, {"cluster", s.cluster}, {"runtime profile", s.profile}};
    ri.strategies = result_.strategies;
    ri.knobs = result_.knobs;
    ri.recommendation = result_.recommendation;
    ri.base_label = fmt::format("{} at micro-batch {} (the configuration given)", s.strategy, s.micro_batch);
    reports::write_report(dir, ri);
    return true;
  } catch (const InputError& e) {
    show_error(e.what());
    return false;
  }
}

void Explorer::request() {
  if (loading_) return;
  const std::uint64_t g = ++generation_;
  {
    std::lock_guard<std::mutex> lock(mu_);
    pending_ = std::make_pair(scenario(), g);  // replaces a request not started yet
  }
  cv_.notify_one();
}

void Explorer::show_result(Result r) {
  if (r.generation != generation_.load()) return;  // a newer request is on its way
  shown_generation_ = r.generation;
  if (!r.error.empty()) {  // bad input changes nothing but the verdict line
    show_error(r.error);
    emit answered(false);
    return;
  }
  result_ = std::move(r);
  verdict_->setStyleSheet(result_.verdict.find("does not fit") != std::string::npos ? "color:#b00" : "color:#070");
  std::string verdict = result_.verdict;
  for (const auto& w : result_.warnings) verdict += "\nwarning: " + w;
  verdict_->setText(QString::fromStdString(verdict));
  build_memory_view();
  build_time_view();
  if (result_.base)
    timeline_->set_lanes(reports::predicted_timeline(*result_.base),
                         fmt::format("the step of {} as simulated ({:.3f} s): wheel to zoom, drag to pan, double-click for the whole step",
                                     planner::name_of(result_.base->input.strategy.stage), result_.base->time ? result_.base->time->step_s : 0.0));
  build_comparison();
  std::string html;
  if (result_.recommendation) {
    const auto& rec = *result_.recommendation;
    html += "<p><b>" + reports::xml_escape(rec.summary + then_try(rec.suggestions)) + "</b></p>";
    if (!rec.ranked.empty()) html += "<p>" + reports::xml_escape(rec.ranked.front().reason) + "</p>";
    html += "<ul>";
    for (const auto& x : rec.rejected) html += "<li><b>" + reports::xml_escape(x.family) + "</b>: " + reports::xml_escape(x.reason + then_try(x.suggestions)) + "</li>";
    html += "</ul>";
  }
  recommendation_->setHtml(QString::fromStdString(html));
  knobs_->clear();
  knobs_->setColumnCount(6);
  knobs_->setHorizontalHeaderLabels({"knob", "change", "in use (GiB)", "step", "tokens/s", "verdict"});
  knobs_->setRowCount(static_cast<int>(result_.knobs.size()));
  for (int i = 0; i < static_cast<int>(result_.knobs.size()); ++i) {
    const auto& k = result_.knobs[static_cast<std::size_t>(i)];
    const QStringList cells = {QString::fromStdString(k.knob), QString::fromStdString(k.change),
                               QString::asprintf("%+.2f", static_cast<double>(k.used_delta_bytes) / kGiB), QString::asprintf("%+.1f%%", 100 * k.step_delta),
                               QString::asprintf("%+.1f%%", 100 * k.tokens_delta), k.fits ? "fits" : "does not fit"};
    for (int c = 0; c < cells.size(); ++c) knobs_->setItem(i, c, new QTableWidgetItem(cells[c]));
  }
  knobs_->horizontalHeader()->setStretchLastSection(true);
  emit planned();
  emit answered(true);
}

std::string Explorer::segment_formula(sim::MemCategory cat, int strategy) const {
  if (strategy < 0 || strategy >= static_cast<int>(result_.strategies.size())) return "";
  const auto& col = result_.strategies[static_cast<std::size_t>(strategy)];
  const planner::Explanation e = planner::explain_plan(*col.plan);
  std::string text = fmt::format("{} · {}", col.label, sim::name_of(cat));
  for (const auto& c : e.categories) {
    if (c.category != cat) continue;
    text += fmt::format(" = {} at the peak", human_bytes(c.at_peak_bytes));
    if (!c.closed_form.empty()) text += "\n" + c.closed_form;
    int shown = 0;
    for (const auto& t : c.terms) {
      if (shown++ == 5) break;
      text += fmt::format("\n{}  {} × {}", human_bytes(t.bytes), t.count, t.what);
      if (!t.formula.empty()) text += fmt::format(", each {} = {}", t.formula, t.numbers);
    }
  }
  return text;
}

void Explorer::build_memory_view() {
  auto* chart = new QChart();
  chart->setTitle("memory per GPU by category, predicted (GiB): allocated, then reserved, then what nvidia-smi shows");
  auto* series = new QStackedBarSeries(chart);
  QStringList names;
  for (const auto& s : result_.strategies) names << QString::fromStdString(s.label);
  for (int c = 0; c < sim::kNumDeviceCategories; ++c) {
    const auto cat = static_cast<sim::MemCategory>(c);
    auto* set = new QBarSet(QString::fromUtf8(sim::name_of(cat).data()), series);
    set->setColor(colour(reports::colour_of(cat)));
    for (const auto& s : result_.strategies) *set << static_cast<double>(s.plan->memory.at_peak_bytes[static_cast<std::size_t>(c)]) / kGiB;
    series->append(set);
    // Hovering a segment shows its derivation: what `peftplan explain` prints for the category.
    connect(set, &QBarSet::hovered, this, [this, cat](bool on, int index) {
      if (!on) return QToolTip::hideText();
      QToolTip::showText(QCursor::pos(), QString::fromStdString(segment_formula(cat, index)));
    });
  }
  auto* cache = new QBarSet("allocator cache", series);
  cache->setColor(QColor("#cfcfcf"));
  auto* outside = new QBarSet("outside the allocator", series);
  outside->setColor(QColor("#9a9a9a"));
  double top = 0;
  for (const auto& s : result_.strategies) {
    const auto& p = *s.plan;
    *cache << static_cast<double>(p.reserved_peak_bytes - std::min(p.reserved_peak_bytes, p.memory.device_peak_bytes)) / kGiB;
    *outside << static_cast<double>(p.outside_allocator_bytes) / kGiB;
    top = std::max(top, static_cast<double>(p.used_peak_bytes) / kGiB);
  }
  series->append(cache);
  series->append(outside);
  chart->addSeries(series);
  auto* x = new QBarCategoryAxis(chart);
  x->append(names);
  auto* y = new QValueAxis(chart);
  const double capacity = result_.strategies.empty() ? 0 : static_cast<double>(result_.strategies.front().plan->device_capacity_bytes) / kGiB;
  y->setRange(0, std::min(std::max(top, capacity) * 1.05, 3 * capacity));
  y->setTitleText("GiB per GPU");
  chart->addAxis(x, Qt::AlignBottom);
  chart->addAxis(y, Qt::AlignLeft);
  series->attachAxis(x);
  series->attachAxis(y);
  // The GPU's memory as a line across the bars.
  auto* line = new QLineSeries(chart);
  line->setName(QString::asprintf("GPU memory %.0f GiB", capacity));
  line->append(-0.5, capacity);
  line->append(static_cast<double>(names.size()) - 0.5, capacity);
  line->setColor(QColor("#c00"));
  chart->addSeries(line);
  auto* lx = new QValueAxis(chart);
  lx->setRange(-0.5, static_cast<double>(names.size()) - 0.5);
  lx->setVisible(false);
  chart->addAxis(lx, Qt::AlignTop);
  line->attachAxis(lx);
  line->attachAxis(y);
  chart->legend()->setAlignment(Qt::AlignBottom);
  QFont small = chart->legend()->font();
  small.setPointSizeF(7.5);
  chart->legend()->setFont(small);
  QChart* old = memory_view_->chart();
  memory_view_->setChart(chart);
  delete old;
}

void Explorer::build_time_view() {
  auto* chart = new QChart();
  chart->setTitle("step time per strategy, predicted (s)");
  auto* series = new QHorizontalStackedBarSeries(chart);
  auto* compute = new QBarSet("compute", series);
  compute->setColor(colour(reports::kComputeColour));
  auto* comm = new QBarSet("exposed communication", series);
  comm->setColor(colour(reports::kCommColour));
  auto* rest = new QBarSet("offload, CPU optimizer, host", series);
  rest->setColor(colour(reports::kOffloadColour));
  QStringList names;
  for (const auto& s : result_.strategies) {
    const auto& t = *s.plan->time;
    names << QString::fromStdString(fmt::format("{} ({:.0f} tok/s, MFU {:.1f}%, exposed comm. {:.3f} s)", s.label, t.tokens_per_s, 100 * t.mfu,
                                                t.exposed_comm_s));
    *compute << t.compute_s;
    *comm << t.exposed_comm_s;
    *rest << std::max(0.0, t.step_s - t.compute_s - t.exposed_comm_s);
  }
  series->append(compute);
  series->append(comm);
  series->append(rest);
  chart->addSeries(series);
  auto* y = new QBarCategoryAxis(chart);
  y->append(names);
  auto* x = new QValueAxis(chart);
  x->setTitleText("seconds per optimizer step");
  chart->addAxis(y, Qt::AlignLeft);
  chart->addAxis(x, Qt::AlignBottom);
  series->attachAxis(y);
  series->attachAxis(x);
  chart->legend()->setAlignment(Qt::AlignBottom);
  QChart* old = time_view_->chart();
  time_view_->setChart(chart);
  delete old;
}

}  // namespace peftplan::gui
