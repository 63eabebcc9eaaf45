// The explorer, offscreen: every view shows what the planner gives for the same inputs and
// changes when a knob does; bad input changes nothing but the verdict line; a burst of changes
// ends showing the last one (how fast the loop answers is a benchmark's question, not a test's).
// Each test saves a screenshot of the views it checks.
#include <algorithm>
#include <QDir>
#include <QCheckBox>
#include <QComboBox>
#include <QFile>
#include <fstream>
#include <QLabel>
#include <QElapsedTimer>
#include <QImage>
#include <QSignalSpy>
#include <QTabWidget>
#include <QTableWidget>
#include <QTest>
#include <QTextBrowser>
#include <QtCharts/QBarSet>
#include <QtCharts/QChart>
#include <QtCharts/QChartView>
#include <QtCharts/QStackedBarSeries>

#include "explorer.h"
#include "timeline_view.h"
#include "peftplan/common/schemas.h"
#include "peftplan/common/units.h"
#include "peftplan/models/config.h"
#include "peftplan/planner/accelerate_config.h"
#include "peftplan/planner/ds_config.h"
#include "peftplan/planner/plan_file.h"
#include "peftplan/planner/validate.h"
#include "peftplan/reports/report.h"
#include "peftplan/sim/cluster.h"

using namespace peftplan;

class TestGui : public QObject {
  Q_OBJECT

  static bool wait_planned(gui::Explorer& w, int timeout_ms = 120000) {
    QSignalSpy spy(&w, &gui::Explorer::planned);
    return spy.wait(timeout_ms);
  }
  // Waits until the shown result is the scenario's (the newest request wins).
  // Until the views show the answer to the newest change. Waiting for a quiet interval instead
  // (no `planned` for 2 s) returned early whenever a loaded machine (ctest -j with the MPI
  // tests) stretched one re-plan past it.
  static void settle(gui::Explorer& w) {
    QElapsedTimer t;
    t.start();
    while (!w.settled() && t.elapsed() < 300'000) QTest::qWait(10);
    QVERIFY2(w.settled(), "no answer to the newest change in 300 s");
  }
  static void shot(QWidget& w, const QString& name) {
    QDir().mkpath(PEFTPLAN_SCREENSHOT_DIR);
    QVERIFY(w.grab().save(QString(PEFTPLAN_SCREENSHOT_DIR) + "/" + name + ".png"));
  }
  // The memory chart's value (GiB) of one category for one strategy's bar.
  static double bar(gui::Explorer& w, const QString& category, const std::string& strategy) {
    auto* view = qobject_cast<QChartView*>(w.views()->widget(0));
    for (QAbstractSeries* s : view->chart()->series()) {
      auto* bars = qobject_cast<QStackedBarSeries*>(s);
      if (!bars) continue;
      int column = -1;
      const auto& cols = w.result().strategies;
      for (int i = 0; i < static_cast<int>(cols.size()); ++i)
        if (cols[static_cast<std::size_t>(i)].label == strategy) column = i;
      for (QBarSet* set : bars->barSets())
        if (set->label() == category && column >= 0) return set->at(column);
    }
    return -1;
  }
  static planner::Plan plan(const gui::Scenario& s, planner::Stage stage) {
    planner::PlanInput in;
    in.model = models::load_model(s.model);
    models::AdapterSpec a;
    a.type = models::PeftType::lora;
    a.lora.r = s.lora_r;
    a.lora.alpha = s.lora_r;
    a.lora.targets.kind = models::ModuleSelector::Kind::list;
    a.lora.targets.names = {"q_proj", "v_proj"};
    in.peft.adapters.push_back(a);
    in.training.micro_batch = s.micro_batch;
    in.training.seq_len = s.seq_len;
    in.strategy.stage = stage;
    const sim::Cluster c = sim::resolve_cluster(s.cluster);
    in.strategy.ranks = sim::total_gpus(c);
    return planner::make_plan(in, c);
  }
  static constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

 private slots:
  void memory_view_is_the_plan() {
    gui::Explorer w;
    w.show();
    settle(w);
    const gui::Scenario s = w.scenario();
    QCOMPARE(w.result().strategies.size(), std::size_t{7});
    for (auto [label, stage] : {std::pair{"ddp", planner::Stage::ddp}, std::pair{"zero3", planner::Stage::zero3}}) {
      const planner::Plan p = plan(s, stage);
      QCOMPARE(bar(w, "base_weights", label), static_cast<double>(p.memory.at_peak_bytes[0]) / kGiB);
      QCOMPARE(bar(w, "activations", label), static_cast<double>(p.memory.at_peak_bytes[5]) / kGiB);
    }
    w.views()->setCurrentIndex(0);
    shot(w, "memory");
    // Raising the micro-batch grows the activations segment, by what plan says.
    const double before = bar(w, "activations", "ddp");
    gui::Scenario more = s;
    more.micro_batch = s.micro_batch * 2;
    w.set_scenario(more);
    settle(w);
    const double after = bar(w, "activations", "ddp");
    QVERIFY(after > before * 1.9);
    QCOMPARE(after, static_cast<double>(plan(more, planner::Stage::ddp).memory.at_peak_bytes[5]) / kGiB);
    shot(w, "memory-micro-batch-4");
    // Hovering a segment shows its formula with the numbers (what explain prints).
    const std::string f = w.segment_formula(sim::MemCategory::activations, 1);
    QVERIFY2(f.find("ddp · activations") != std::string::npos, f.c_str());
    QVERIFY2(f.find("B·S·I × 2 B (bf16)") != std::string::npos, f.c_str());
    QVERIFY2(w.segment_formula(sim::MemCategory::optimizer_states, 4).find("ZeRO paper") != std::string::npos, "zero3's optimizer states");
  }

  void seventy_billion_zero3_shrinks_the_base() {
    gui::Explorer w;
    w.show();
    gui::Scenario s = w.scenario();
    s.model = "llama-2-70b";
    s.seq_len = 4096;
    s.micro_batch = 1;
    s.checkpointing = "full";
    s.strategy = "zero2";
    w.set_scenario(s);
    settle(w);
    QVERIFY(w.verdict_line()->text().contains("zero2 does not fit"));
    const double z2 = bar(w, "base_weights", "zero2"), z3 = bar(w, "base_weights", "zero3");
    QVERIFY(z3 < z2 / 7);
    s.strategy = "zero3";
    w.set_scenario(s);
    settle(w);
    QVERIFY2(w.verdict_line()->text().contains("zero3 fits"), qPrintable(w.verdict_line()->text()));
    shot(w, "memory-70b-zero3");
    w.views()->setCurrentIndex(1);
    shot(w, "time-70b");
    w.views()->setCurrentIndex(2);
    auto* rec = qobject_cast<QTextBrowser*>(w.views()->widget(2));
    QVERIFY(rec->toPlainText().contains("recommended: zero3"));
    QVERIFY(rec->toPlainText().contains("does not fit"));
    shot(w, "recommendation-70b");
    w.views()->setCurrentIndex(3);
    auto* knobs = qobject_cast<QTableWidget*>(w.views()->widget(3));
    QVERIFY(knobs->rowCount() >= 4);
    QCOMPARE(knobs->item(0, 0)->text(), QString("micro-batch"));
    shot(w, "what-moves-70b");
  }

  void bad_input_changes_nothing_but_the_verdict() {
    gui::Explorer w;
    w.show();
    settle(w);
    const auto before = w.result().strategies.front().plan->used_peak_bytes;
    gui::Scenario s = w.scenario();
    s.model = "no-such-model";
    w.set_scenario(s);
    QTest::qWait(3000);
    QVERIFY2(w.verdict_line()->text().startsWith("error: "), qPrintable(w.verdict_line()->text()));
    QVERIFY(w.verdict_line()->text().contains("no-such-model"));
    QCOMPARE(w.result().strategies.front().plan->used_peak_bytes, before);
    shot(w, "bad-input");
  }

  void scenarios_save_load_and_export() {
    gui::Explorer w;
    w.show();
    settle(w);
    const QString dir = QString(PEFTPLAN_SCREENSHOT_DIR) + "/files";
    QDir(dir).removeRecursively();
    QDir().mkpath(dir);
    gui::Scenario s = w.scenario();
    s.model = "llama-2-13b";
    s.micro_batch = 3;
    s.strategy = "zero2";
    w.set_scenario(s);
    settle(w);
    const std::string file = (dir + "/scenario.json").toStdString();
    QVERIFY(w.save_scenario(file));
    gui::Explorer other;
    QVERIFY(other.load_scenario(file));
    QCOMPARE(QString::fromStdString(other.scenario().model), QString("llama-2-13b"));
    QCOMPARE(other.scenario().micro_batch, 3);
    QCOMPARE(QString::fromStdString(other.scenario().strategy), QString("zero2"));
    // A bad file: its error in the verdict line, naming the file and field; nothing changes.
    {
      std::ofstream bad((dir + "/bad.json").toStdString());
      bad << R"({"schema": "peftplan.scenario/1", "micro_batch": -3})";
    }
    QVERIFY(!other.load_scenario((dir + "/bad.json").toStdString()));
    QVERIFY2(other.verdict_line()->text().contains("bad.json: micro_batch must be an integer in [1, 4,096], got -3"), qPrintable(other.verdict_line()->text()));
    QCOMPARE(other.scenario().micro_batch, 3);
    // Export: the report command's files, the memory table equal to what the window shows.
    QVERIFY(w.export_report((dir + "/report").toStdString()));
    for (const char* f : {"report.html", "report.md", "memory.svg", "time.svg"}) QVERIFY2(QFile::exists(dir + "/report/" + f), f);
    QFile html(dir + "/report/report.html");
    QVERIFY(html.open(QIODevice::ReadOnly));
    const QString text = QString::fromUtf8(html.readAll());
    const auto& ddp = *w.result().strategies[1].plan;
    QVERIFY(text.contains(QString("data-field=\"memory.device.at_peak.activations_bytes\" data-value=\"%1\"").arg(ddp.memory.at_peak_bytes[5])));
  }

  // Llama-2-13B with ZeRO-3 shown, the rest the defaults; the scenario shown.
  static gui::Scenario show_13b_zero3(gui::Explorer& w) {
    w.show();
    gui::Scenario s = w.scenario();
    s.model = "llama-2-13b";
    s.strategy = "zero3";
    w.set_scenario(s);
    settle(w);
    return s;
  }
  static QString dir_for(const QString& name) {
    const QString dir = QString(PEFTPLAN_SCREENSHOT_DIR) + "/" + name;
    QDir(dir).removeRecursively();
    QDir().mkpath(dir);
    return dir;
  }
  static void write(const QString& path, const std::string& text) {
    std::ofstream f(path.toStdString());
    f << text;
  }
  static QString read_all(const QString& path) {
    QFile f(path);
    return f.open(QIODevice::ReadOnly) ? QString::fromUtf8(f.readAll()) : QString();
  }

  // The timeline shows the selected strategy's simulated step: one bar per op of the plan's
  // timeline (reports::predicted_timeline of the same plan), ZeRO-3 with its all-gathers on a
  // lane of their own; the wheel's zoom narrows the view around the pointer.
  void timeline_shows_the_selected_strategys_ops() {
    gui::Explorer w;
    gui::Scenario s = show_13b_zero3(w);
    auto* view = qobject_cast<gui::TimelineView*>(w.timeline());
    QVERIFY(view);
    const planner::Plan p = plan(s, planner::Stage::zero3);
    std::size_t expected = 0;
    for (const auto& l : reports::predicted_timeline(p)) expected += l.bars.size();
    QCOMPARE(view->bar_count(), expected);
    QCOMPARE(view->step_s(), p.time->step_s);
    bool gathers = false;
    for (const auto& l : view->lanes())
      for (const auto& b : l.bars) gathers = gathers || (b.collective && b.name.find("gather") != std::string::npos);
    QVERIFY(gathers);
    QVERIFY(w.show_view("timeline"));
    shot(w, "timeline-13b-zero3");
    const double mid = 0.5 * p.time->step_s;
    view->zoom(4.0, mid);
    QVERIFY(std::abs((view->view_end_s() - view->view_begin_s()) - p.time->step_s / 4) < 1e-9 * p.time->step_s);
    QVERIFY(view->view_begin_s() < mid && view->view_end_s() > mid);
    shot(w, "timeline-13b-zero3-zoomed");
    // DDP: no all-gathers, a different program.
    s.strategy = "ddp";
    w.set_scenario(s);
    settle(w);
    std::size_t ddp = 0;
    for (const auto& l : reports::predicted_timeline(plan(s, planner::Stage::ddp))) ddp += l.bars.size();
    QCOMPARE(view->bar_count(), ddp);
    QVERIFY(ddp != expected);
    QCOMPARE(view->view_begin_s(), 0.0);  // a new plan is shown whole
  }

  // A ds_config.json sets the strategy and offload controls (and locks them) and the plan is
  // the file's; a bad one shows its error naming the file and key and changes nothing; the
  // launcher config exported for the plan shown reads back into the same strategy.
  void launcher_configs_set_the_strategy() {
    gui::Explorer w;
    w.show();
    settle(w);
    const QString dir = dir_for("launcher");
    write(dir + "/ds_config.json", R"({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
      "bf16": {"enabled": true},
      "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}})");
    QVERIFY(w.set_launcher_config((dir + "/ds_config.json").toStdString()));
    settle(w);
    QCOMPARE(QString::fromStdString(w.scenario().strategy), QString("zero3"));
    QVERIFY(w.scenario().offload_optimizer);
    QVERIFY(w.result().base);
    QCOMPARE(w.result().base->input.strategy.stage, planner::Stage::zero3);
    QCOMPARE(w.result().base->input.strategy.offload_optimizer, planner::OffloadDevice::cpu);
    QVERIFY(w.verdict_line()->text().startsWith("zero3 "));
    bool locked = false;
    for (QComboBox* c : w.findChildren<QComboBox*>())
      if (c->currentText() == "zero3") locked = !c->isEnabled();
    QVERIFY2(locked, "the strategy control is locked while the file sets it");
    shot(w, "ds-config-zero3");
    // The launch files of the plan shown, as recommend --emit writes them; plan.json is the plan.
    QVERIFY(w.export_launch_files((dir + "/launch").toStdString()));
    for (const char* f : {"plan.json", "ds_config.json", "accelerate_config.yaml", "adapter_config.json", "train.py", "launch.sh"})
      QVERIFY2(QFile::exists(dir + "/launch/" + f), f);
    const planner::PlanFile pf = planner::read_plan_file((dir + "/launch/plan.json").toStdString());
    QCOMPARE(pf.input.strategy.stage, planner::Stage::zero3);
    QCOMPARE(pf.input.strategy.offload_optimizer, planner::OffloadDevice::cpu);
    // Export: the plan's ds_config.json reads back into the same strategy.
    QVERIFY(w.export_launcher_config((dir + "/exported.json").toStdString()));
    planner::DsConfigInputs di;
    di.world_size = w.result().base->input.strategy.ranks;
    di.training = w.result().base->input.training;
    const planner::DsConfig back = planner::read_ds_config(models::read_json_file((dir + "/exported.json").toStdString()), "exported.json", di);
    QCOMPARE(back.strategy.stage, planner::Stage::zero3);
    QCOMPARE(back.strategy.offload_optimizer, planner::OffloadDevice::cpu);
    // A bad file: the error names it and the key; nothing changes.
    write(dir + "/bad.json", R"({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 7}})");
    QVERIFY(!w.set_launcher_config((dir + "/bad.json").toStdString()));
    QVERIFY2(w.verdict_line()->text().contains("bad.json") && w.verdict_line()->text().contains("zero_optimization.stage"),
             qPrintable(w.verdict_line()->text()));
    QCOMPARE(QString::fromStdString(w.scenario().launcher_config), dir + "/ds_config.json");
    // accelerate's YAML (the fms-acceleration benchmarks' file): FSDP FULL_SHARD under the hf profile.
    QVERIFY(w.set_launcher_config(PEFTPLAN_SOURCE_DIR "/tests/data/accelerate/fms-acceleration-benchmarks.yaml"));
    settle(w);
    QCOMPARE(QString::fromStdString(w.scenario().strategy), QString("fsdp-full-shard"));
    QCOMPARE(QString::fromStdString(w.scenario().profile), QString("hf"));
    QCOMPARE(w.result().base->input.strategy.stage, planner::Stage::fsdp_full_shard);
    QVERIFY(w.export_launcher_config((dir + "/exported.yaml").toStdString()));
    QCOMPARE(planner::read_accelerate_config_file((dir + "/exported.yaml").toStdString()).strategy.stage, planner::Stage::fsdp_full_shard);
    shot(w, "accelerate-fsdp");
    // FSDP's own activation checkpointing: the exported YAML keeps it and train.py leaves the
    // Trainer's gradient_checkpointing off (transformers refuses the two together).
    write(dir + "/ckpt.yaml", "distributed_type: FSDP\nnum_processes: 2\nfsdp_config:\n  fsdp_sharding_strategy: FULL_SHARD\n"
                              "  fsdp_activation_checkpointing: true\n");
    QVERIFY(w.set_launcher_config((dir + "/ckpt.yaml").toStdString()));
    settle(w);
    QCOMPARE(w.result().base->input.training.checkpointing, planner::Checkpointing::full);
    QVERIFY(w.export_launch_files((dir + "/fsdp-ckpt").toStdString()));
    QVERIFY(planner::read_accelerate_config_file((dir + "/fsdp-ckpt/accelerate_config.yaml").toStdString()).strategy.fsdp.activation_checkpointing);
    QVERIFY(read_all(dir + "/fsdp-ckpt/train.py").contains("\"fsdp_checkpointing\": True,"));
    // A ds_config.json after the FSDP YAML: ZeRO under DeepSpeed again, not a refusal.
    QVERIFY(w.set_launcher_config((dir + "/ds_config.json").toStdString()));
    settle(w);
    QCOMPARE(w.result().base->input.strategy.stage, planner::Stage::zero3);
    QCOMPARE(w.result().base->input.profile, planner::RuntimeProfile::deepspeed);
    // Back to the controls.
    QVERIFY(w.set_launcher_config(""));
    settle(w);
    QVERIFY(w.scenario().launcher_config.empty());
  }

  // A strategy the planner refuses for the scenario's settings (the Trainer's GradScaler with fp16
  // full fine-tuning under DDP) is left out of the columns with a warning; the rest are shown, not
  // an error for all of them.
  void refused_columns_are_left_out_with_a_warning() {
    gui::Scenario s;  // fp16 full fine-tuning under the Trainer: its GradScaler refuses DDP, FSDP's takes it
    s.lora_r = 0;
    s.precision = "fp16";
    s.profile = "hf";
    s.strategy = "fsdp-full-shard";
    const gui::Result r = gui::plan_scenario(s, 1);
    QVERIFY2(r.error.empty(), r.error.c_str());
    QVERIFY(r.base);
    QVERIFY(!r.strategies.empty());
    for (const auto& c : r.strategies) QVERIFY2(c.label != "ddp", c.label.c_str());
    bool warned = false;
    for (const auto& x : r.warnings) warned |= x.rfind("not shown: ddp: ", 0) == 0;
    QVERIFY(warned);
  }

  // Pure-bf16 DDP under DeepSpeed is what the Trainer's own DDP runs, as plan plans it: your
  // configuration and the DDP columns under hf, said in a warning and in the label.
  void pure_bf16_ddp_is_planned_as_the_trainers_ddp() {
    gui::Scenario s;
    s.precision = "bf16-pure";
    s.strategy = "ddp";
    const gui::Result r = gui::plan_scenario(s, 1);
    QVERIFY2(r.error.empty(), r.error.c_str());
    QVERIFY(r.base);
    QCOMPARE(r.base->input.profile, planner::RuntimeProfile::hf);
    const auto warns = [](const gui::Result& res, std::string_view fragment) {
      return std::any_of(res.warnings.begin(), res.warnings.end(), [&](const std::string& x) { return x.find(fragment) != std::string::npos; });
    };
    for (const auto& x : r.warnings) QVERIFY2(x.rfind("not shown: ", 0) != 0, x.c_str());
    QVERIFY(warns(r, "precision bf16-pure with strategy ddp is planned with profile hf: DeepSpeed runs pure bf16 only under ZeRO"));
    bool ddp = false, zero2 = false;
    for (const auto& c : r.strategies) {
      ddp |= c.label == "ddp (hf)" && c.plan && c.plan->input.profile == planner::RuntimeProfile::hf;
      zero2 |= c.label == "zero2" && c.plan && c.plan->input.profile == planner::RuntimeProfile::deepspeed;
    }
    QVERIFY(ddp);
    QVERIFY(zero2);
    // FSDP is accelerate's: under the deepspeed profile your configuration is planned with hf too.
    s.precision = "bf16";
    s.strategy = "fsdp-full-shard";
    const gui::Result f = gui::plan_scenario(s, 2);
    QVERIFY2(f.error.empty(), f.error.c_str());
    QVERIFY(f.base);
    QCOMPARE(f.base->input.profile, planner::RuntimeProfile::hf);
    QVERIFY(warns(f, "strategy fsdp-full-shard is planned with profile hf: torch FSDP runs under accelerate"));
  }

  // An adapter_config.json stands in for rank and targets: the plan's trainable parameters are
  // the file's (r 16 on q_proj and v_proj, as the rank-16 controls would give).
  void adapter_config_sets_the_adapter() {
    gui::Explorer w;
    w.show();
    gui::Scenario s = w.scenario();
    s.lora_r = 64;
    s.targets = "all-linear";
    w.set_scenario(s);
    settle(w);
    const auto before = w.result().base->memory.at_peak_bytes[static_cast<std::size_t>(sim::MemCategory::trainable_weights)];
    QVERIFY(w.set_adapter_config(PEFTPLAN_SOURCE_DIR "/tests/data/adapters/qv16"));
    settle(w);
    s.lora_r = 16;
    s.targets = "q_proj,v_proj";
    const planner::Plan p = plan(s, planner::Stage::ddp);
    const auto cat = static_cast<std::size_t>(sim::MemCategory::trainable_weights);
    QCOMPARE(w.result().base->memory.at_peak_bytes[cat], p.memory.at_peak_bytes[cat]);
    QVERIFY(w.result().base->memory.at_peak_bytes[cat] < before);
    QVERIFY(!w.set_adapter_config(PEFTPLAN_SOURCE_DIR "/tests/data/no-such-adapter.json"));
    QVERIFY(w.verdict_line()->text().contains("no-such-adapter.json"));
  }

  // A checkpoint saved quantised plans at its own quantisation whether or not the QLoRA box is
  // ticked (models::apply_checkpoint_quantization, the rule `plan` applies; the verdict warns
  // while the box says otherwise), and full fine-tuning of it is refused as bad input.
  void a_checkpoint_saved_quantised_plans_as_saved() {
    gui::Scenario s;
    s.model = PEFTPLAN_SOURCE_DIR "/tests/data/quantised/llama-3-8b-bnb-4bit";
    sim::Cluster c;
    std::vector<std::string> w;
    const planner::PlanInput saved = gui::scenario_input(s, c, w);
    QVERIFY(saved.peft.quantization.has_value());
    QCOMPARE(saved.peft.quantization->dtype, DType::nf4);
    QVERIFY(saved.peft.quantization->double_quant);
    QCOMPARE(w.size(), std::size_t{1});
    QVERIFY(w[0].find("planned as bitsandbytes nf4 with double quantisation, not unquantised") != std::string::npos);
    w.clear();
    s.qlora = true;  // the box's nf4 with double quantisation is what it is: no warning
    QVERIFY(gui::scenario_input(s, c, w).peft.quantization == saved.peft.quantization);
    QVERIFY(w.empty());
    s.lora_r = 0;
    s.qlora = false;
    const gui::Result r = gui::plan_scenario(s, 1);
    QVERIFY(r.error.find("transformers' Trainer refuses to fine-tune a purely quantised model") != std::string::npos);
  }

  // Two scenarios side by side: B pinned at micro-batch 2, A at 4; each cell is its plan's.
  void compare_puts_two_scenarios_side_by_side() {
    gui::Explorer w;
    w.show();
    settle(w);
    gui::Scenario s = w.scenario();
    w.pin_scenario();
    s.micro_batch = 4;
    w.set_scenario(s);
    settle(w);
    QTableWidget* t = w.comparison();
    QCOMPARE(t->rowCount(), static_cast<int>(w.result().strategies.size()));
    int row = -1;
    for (int i = 0; i < t->rowCount(); ++i)
      if (t->item(i, 0)->text() == "zero2") row = i;
    QVERIFY(row >= 0);
    gui::Scenario b = s;
    b.micro_batch = 2;
    QCOMPARE(t->item(row, 1)->text(), QString::asprintf("%.2f", to_gib(plan(s, planner::Stage::zero2).used_peak_bytes)));
    QCOMPARE(t->item(row, 2)->text(), QString::asprintf("%.2f", to_gib(plan(b, planner::Stage::zero2).used_peak_bytes)));
    QVERIFY2(w.comparison_note()->text().contains("micro_batch 2 → 4"), qPrintable(w.comparison_note()->text()));
    QVERIFY(w.show_view("compare"));
    shot(w, "compare");
  }

  // A row per strategy, matched on what runs: pure bf16 makes the DDP column "ddp (hf)" (the
  // Trainer's own DDP), and it is compared with B's "ddp" in one row, not two half-empty ones.
  void compare_matches_a_strategy_across_its_profile_label() {
    gui::Explorer w;
    w.show();
    settle(w);
    gui::Scenario s = w.scenario();
    w.pin_scenario();
    s.precision = "bf16-pure";
    w.set_scenario(s);
    settle(w);
    QTableWidget* t = w.comparison();
    QCOMPARE(t->rowCount(), static_cast<int>(w.result().strategies.size()));
    int row = -1;
    for (int i = 0; i < t->rowCount(); ++i)
      if (t->item(i, 0)->text() == "ddp (hf) / ddp") row = i;
    QVERIFY2(row >= 0, qPrintable(t->item(0, 0)->text()));
    QVERIFY(t->item(row, 1)->text() != "-");
    QVERIFY(t->item(row, 2)->text() != "-");
  }

  // A run folder (summary.json naming each strategy's folder) shows every figure predicted
  // against measured with its verdict; a bad validation.json names the file and field and
  // changes nothing.
  void a_run_folder_shows_predicted_against_measured() {
    gui::Explorer w;
    w.show();
    settle(w);
    const QString dir = dir_for("run");
    nlohmann::json runs = nlohmann::json::array();
    for (const char* strategy : {"ddp", "zero3"}) {
      planner::Validation v;
      planner::Figure peak, step;
      peak.section = "memory";
      peak.name = "peak";
      peak.predicted = peak.measured = 1000.0;
      step.section = "time";
      step.name = "step_s";
      step.predicted = 0.040;
      step.measured = std::string(strategy) == "ddp" ? 0.044 : 0.050;
      step.tolerance = 0.15;
      step.relative_error = step.measured / step.predicted - 1.0;
      step.within = std::abs(step.relative_error) <= 0.15;
      step.has_spread = true;
      step.spread = 0.001;
      v.memory = {peak};
      v.time = {step};
      if (!step.within) v.outside = {"time.step_s"};
      v.within_tolerance = step.within;
      QDir().mkpath(dir + "/" + strategy);
      write(dir + "/" + strategy + "/validation.json", planner::validation_to_json(v).dump());
      runs.push_back({{"strategy", strategy}, {"dir", (dir + "/" + strategy).toStdString()}});
    }
    write(dir + "/summary.json", nlohmann::json{{"schema", schemas::kRunSummary}, {"rounds", 5}, {"runs", runs}}.dump());
    QVERIFY(w.open_run(dir.toStdString()));
    QTableWidget* t = w.measured();
    QCOMPARE(t->rowCount(), 4);
    QCOMPARE(t->item(1, 1)->text(), QString("time.step_s"));
    QCOMPARE(t->item(1, 4)->text(), QString("+10.00%"));
    QCOMPARE(t->item(1, 6)->text(), QString("within"));
    QCOMPARE(t->item(3, 0)->text(), QString("zero3"));
    QCOMPARE(t->item(3, 6)->text(), QString("outside"));
    shot(w, "measured");
    write(dir + "/ddp/validation.json", R"({"schema": "peftplan.validation/1"})");
    QVERIFY(!w.open_run((dir + "/ddp/validation.json").toStdString()));
    QVERIFY2(w.verdict_line()->text().contains("validation.json") && w.verdict_line()->text().contains("schema"),
             qPrintable(w.verdict_line()->text()));
    QCOMPARE(t->rowCount(), 4);
  }

  // Every view that depends on the inputs changes when a knob does: four GPUs instead of eight
  // for Llama-2-13B (the memory per GPU, the step, the search's answer, the deltas, your
  // strategy's timeline and the A column of the comparison all move). The measured view shows a
  // run, not the inputs.
  void every_view_changes_when_a_knob_does() {
    gui::Explorer w;
    gui::Scenario s = show_13b_zero3(w);
    w.pin_scenario();
    const std::vector<std::string> views = {"memory", "time", "recommendation", "what moves", "timeline", "compare"};
    std::vector<QImage> before;
    for (const auto& v : views) {
      QVERIFY(w.show_view(v));
      before.push_back(w.views()->currentWidget()->grab().toImage());
    }
    s.gpus = 4;
    w.set_scenario(s);
    settle(w);
    for (std::size_t i = 0; i < views.size(); ++i) {
      QVERIFY(w.show_view(views[i]));
      const QImage after = w.views()->currentWidget()->grab().toImage();
      QVERIFY2(after != before[i], views[i].c_str());
      shot(w, QString::fromStdString("changed-" + views[i]).replace(' ', '-'));
    }
  }

  void a_burst_of_changes_ends_on_the_last() {
    gui::Explorer w;
    w.show();
    settle(w);
    gui::Scenario s = w.scenario();
    for (int i = 1; i <= 100; ++i) {
      s.micro_batch = i;
      w.set_scenario(s);
      QCoreApplication::processEvents();  // the loop keeps running while plans run on the worker
    }
    settle(w);
    QCOMPARE(w.result().strategies.front().plan->input.training.micro_batch, std::int64_t{100});
  }
};

QTEST_MAIN(TestGui)
#include "test_gui.moc"
