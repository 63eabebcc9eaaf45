// The explorer, offscreen: every view shows what the planner gives for the same inputs and
// changes when a knob does; bad input changes nothing but the verdict line; a burst of changes
// ends showing the last one (how fast the loop answers is a benchmark's question, not a test's).
// Each test saves a screenshot of the views it checks.
#include <QDir>
#include <QFile>
#include <fstream>
#include <QLabel>
#include <QElapsedTimer>
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
#include "peftplan/models/config.h"
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
