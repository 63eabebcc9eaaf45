// The explorer's window (see explorer.h).
#include "explorer.h"

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
#include "peftplan/planner/explain.h"
#include "peftplan/reports/colours.h"
#include "peftplan/reports/svg.h"
#include "peftplan/sim/cluster.h"

namespace peftplan::gui {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

planner::PlanInput input_of(const Scenario& s, sim::Cluster& cluster) {
  planner::PlanInput in;
  in.model = models::load_model(s.model);
  if (s.lora_r > 0) {
    models::AdapterSpec a;
    a.type = models::PeftType::lora;
    a.lora.r = s.lora_r;
    a.lora.alpha = s.lora_r;
    if (s.targets == "all-linear") a.lora.targets.kind = models::ModuleSelector::Kind::all_linear;
    else {
      a.lora.targets.kind = models::ModuleSelector::Kind::list;
      std::size_t at = 0;
      for (std::size_t c; (c = s.targets.find(',', at)) != std::string::npos; at = c + 1) a.lora.targets.names.push_back(s.targets.substr(at, c - at));
      a.lora.targets.names.push_back(s.targets.substr(at));
    }
    in.peft.adapters.push_back(a);
    if (s.qlora) {
      models::Quantization q;
      q.dtype = DType::nf4;
      q.double_quant = true;
      in.peft.quantization = q;
    }
  } else {
    in.training.full_finetune = true;
  }
  in.training.micro_batch = s.micro_batch;
  in.training.seq_len = s.seq_len;
  in.training.attention = planner::Attention::flash;
  if (auto p = planner::from_name(s.precision, planner::kPrecisions)) in.training.precision = *p;
  if (s.checkpointing == "full") in.training.checkpointing = planner::Checkpointing::full;
  in.profile = planner::from_name(s.profile, planner::kRuntimeProfiles).value_or(planner::RuntimeProfile::deepspeed);
  cluster = sim::resolve_cluster(s.cluster);
  in.strategy.ranks = std::min(s.gpus, sim::total_gpus(cluster));
  in.strategy.stage = planner::from_name(s.strategy, planner::kStages).value_or(planner::Stage::ddp);
  return in;
}

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
  try {
    sim::Cluster cluster;
    const planner::PlanInput in = input_of(s, cluster);
    planner::PlanOptions po;
    const planner::Plan base = planner::make_plan(in, cluster, po);
    r.strategies = reports::seed_strategies(in, cluster, po.headroom_fraction);
    r.knobs = reports::knob_deltas(base);
    r.recommendation = planner::recommend(in, cluster, {}, planner::Constraints{}, planner::Objective::tokens_per_s);
    const auto headroom = static_cast<std::int64_t>(base.headroom_fraction * static_cast<double>(base.device_capacity_bytes));
    const std::int64_t spare = static_cast<std::int64_t>(base.device_capacity_bytes) - headroom - static_cast<std::int64_t>(base.used_peak_bytes);
    r.verdict = base.fits ? fmt::format("{} fits with {:.1f} GiB to spare ({:.1f} GiB in use of {:.1f} GiB, {:.0f}% headroom kept)", s.strategy,
                                        static_cast<double>(spare) / kGiB, to_gib(base.used_peak_bytes), to_gib(base.device_capacity_bytes),
                                        100 * base.headroom_fraction)
                          : fmt::format("{} does not fit: {}{}", s.strategy, base.reasons.empty() ? std::string() : base.reasons.front(),
                                        then_try(base.suggestions));
  } catch (const InputError& e) {
    r.error = e.what();
  }
  return r;
}

nlohmann::json scenario_to_json(const Scenario& s) {
  return {{"schema", schemas::kScenario}, {"model", s.model},   {"lora_r", s.lora_r},         {"targets", s.targets},
          {"qlora", s.qlora},             {"micro_batch", s.micro_batch}, {"seq_len", s.seq_len}, {"precision", s.precision},
          {"checkpointing", s.checkpointing}, {"cluster", s.cluster}, {"gpus", s.gpus},       {"profile", s.profile},
          {"strategy", s.strategy}};
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
  text("targets", s.targets);
  s.qlora = json_fields::boolean(j, "qlora", source, s.qlora);
  integer("micro_batch", s.micro_batch, 1, 4096);
  integer("seq_len", s.seq_len, 16, 1 << 20);
  text("precision", s.precision);
  if (!planner::from_name(s.precision, planner::kPrecisions))
    throw input_error(source, "precision", "must be one of " + planner::names_of(planner::kPrecisions), "\"" + s.precision + "\"");
  text("checkpointing", s.checkpointing);
  if (s.checkpointing != "none" && s.checkpointing != "full") throw input_error(source, "checkpointing", "must be none or full", "\"" + s.checkpointing + "\"");
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
  checkpointing_->addItems({"none", "full"});
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
  form->addRow("targets", targets_);
  form->addRow("", qlora_);
  form->addRow("micro-batch", micro_batch_);
  form->addRow("sequence", seq_len_);
  form->addRow("precision", precision_);
  form->addRow("checkpointing", checkpointing_);
  form->addRow("cluster", cluster_);
  form->addRow("GPUs", gpus_);
  form->addRow("runtime profile", profile_);
  form->addRow("your strategy", strategy_);
  tabs_ = new QTabWidget(split);
  memory_view_ = new QChartView(tabs_);
  time_view_ = new QChartView(tabs_);
  recommendation_ = new QTextBrowser(tabs_);
  knobs_ = new QTableWidget(tabs_);
  tabs_->addTab(memory_view_, "memory");
  tabs_->addTab(time_view_, "time");
  tabs_->addTab(recommendation_, "recommendation");
  tabs_->addTab(knobs_, "what moves");
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
  file->addAction("Export report…", this, [this] {
    const QString d = QFileDialog::getSaveFileName(this, "Export report (a folder)", "report");
    if (!d.isEmpty()) export_report(d.toStdString());
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
  for (QComboBox* c : {model_, targets_, precision_, checkpointing_, cluster_, profile_, strategy_}) connect(c, &QComboBox::currentTextChanged, this, changed);
  for (QSpinBox* b : {lora_r_, micro_batch_, seq_len_, gpus_}) connect(b, qOverload<int>(&QSpinBox::valueChanged), this, changed);
  connect(qlora_, &QCheckBox::toggled, this, changed);
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
  s.targets = targets_->currentText().toStdString();
  s.qlora = qlora_->isChecked();
  s.micro_batch = micro_batch_->value();
  s.seq_len = seq_len_->value();
  s.precision = precision_->currentText().toStdString();
  s.checkpointing = checkpointing_->currentText().toStdString();
  s.cluster = cluster_->currentText().toStdString();
  s.gpus = gpus_->value();
  s.profile = profile_->currentText().toStdString();
  s.strategy = strategy_->currentText().toStdString();
  return s;
}

void Explorer::set_scenario(const Scenario& s) {
  loading_ = true;  // one request for the whole scenario, not one per control
  model_->setCurrentText(QString::fromStdString(s.model));
  lora_r_->setValue(s.lora_r);
  targets_->setCurrentText(QString::fromStdString(s.targets));
  qlora_->setChecked(s.qlora);
  micro_batch_->setValue(s.micro_batch);
  seq_len_->setValue(s.seq_len);
  precision_->setCurrentText(QString::fromStdString(s.precision));
  checkpointing_->setCurrentText(QString::fromStdString(s.checkpointing));
  cluster_->setCurrentText(QString::fromStdString(s.cluster));
  gpus_->setValue(s.gpus);
  profile_->setCurrentText(QString::fromStdString(s.profile));
  strategy_->setCurrentText(QString::fromStdString(s.strategy));
  loading_ = false;
  request();
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
    const Scenario s = scenario();
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
    return;
  }
  result_ = std::move(r);
  verdict_->setStyleSheet(result_.verdict.find("does not fit") != std::string::npos ? "color:#b00" : "color:#070");
  verdict_->setText(QString::fromStdString(result_.verdict));
  build_memory_view();
  build_time_view();
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
    names << QString::fromStdString(fmt::format("{} ({:.0f} tok/s)", s.label, t.tokens_per_s));
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
