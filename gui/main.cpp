// peftplan-gui: the what-if explorer. --scenario FILE (a saved scenario), then --model, --peft,
// --cluster, --gpus, --lora-r, --micro-batch, --strategy, --ds-config / --accelerate-config
// start from given inputs; --run PATH opens a run's comparison; --view NAME shows that view; --screenshot FILE renders the window
// (offscreen works: QT_QPA_PLATFORM=offscreen) once the first plan is shown, saves it as PNG and
// exits. A bad file or value prints its error and exits with code 2.
#include <cstdio>

#include <QApplication>
#include <QCommandLineParser>
#include <QLabel>
#include <QTimer>

#include "explorer.h"
#include "peftplan/common/error.h"
#include "peftplan/common/heap.h"
#include "peftplan/models/config.h"
#include "peftplan/planner/specs.h"

#include <fmt/format.h>

namespace {

int bad_input(std::string message) {
  if (message.rfind("error: ", 0) == 0) message.erase(0, 7);  // as the verdict line shows it
  std::fprintf(stderr, "peftplan-gui: %s\n", message.c_str());
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  peftplan::keep_freed_heap_memory();  // every change re-plans every strategy over the cores
  QApplication app(argc, argv);
  QApplication::setApplicationName("peftplan-gui");
  QCommandLineParser cli;
  cli.setApplicationDescription(
      "peftplan's what-if explorer: memory, time and the recommendation for every strategy, on every change.\n"
      "Example: peftplan-gui --model llama-2-70b --cluster 8xA100-80GB --strategy zero3 --view timeline --screenshot 70b.png");
  cli.addHelpOption();
  const QCommandLineOption scenario("scenario", "a scenario saved from the File menu (peftplan.scenario/1)", "FILE");
  const QCommandLineOption model("model", "zoo name or config.json", "NAME");
  const QCommandLineOption peft("peft", "PEFT adapter_config.json (or its folder) in place of the rank and targets", "FILE");
  const QCommandLineOption cluster("cluster", "preset or spelling (2x8xH100-SXM-NDR)", "CLUSTER");
  const QCommandLineOption gpus("gpus", "GPUs used", "N");
  const QCommandLineOption lora("lora-r", "LoRA rank (0: full fine-tuning)", "R");
  const QCommandLineOption mb("micro-batch", "sequences per GPU per micro-step", "B");
  const QCommandLineOption strategy("strategy", "your strategy (ddp, zero1, zero2, zero3, fsdp-full-shard, ...)", "S");
  const QCommandLineOption ds("ds-config", "DeepSpeed ds_config.json (sets the strategy)", "FILE");
  const QCommandLineOption accel("accelerate-config", "accelerate launch YAML, FSDP or MULTI_GPU (sets the strategy)", "FILE");
  const QCommandLineOption run("run", "a peftplan run folder or validation.json: predicted against measured (the measured view)", "PATH");
  const QCommandLineOption view("view", "the view shown: memory, time, recommendation, what moves, timeline, compare, measured", "NAME");
  const QCommandLineOption shot("screenshot", "save the window as PNG once planned, and exit", "FILE");
  cli.addOptions({scenario, model, peft, cluster, gpus, lora, mb, strategy, ds, accel, run, view, shot});
  cli.process(app);
  peftplan::gui::Explorer w;
  try {
    peftplan::gui::Scenario s =
        cli.isSet(scenario)
            ? peftplan::gui::scenario_from_json(peftplan::models::read_json_file(cli.value(scenario).toStdString()), cli.value(scenario).toStdString())
            : w.scenario();
    // Each flag in its control's range (a spin box would clamp a value outside it silently).
    auto number = [&](const QCommandLineOption& o, int& into, int lo, int hi) {
      bool ok = false;
      const int v = cli.value(o).toInt(&ok);
      if (!ok || v < lo || v > hi)
        throw peftplan::input_error("--" + o.names().front().toStdString(), "", fmt::format("must be an integer in [{}, {}]", lo, hi),
                                    cli.value(o).toStdString());
      into = v;
    };
    if (cli.isSet(model)) s.model = cli.value(model).toStdString();
    if (cli.isSet(cluster)) s.cluster = cli.value(cluster).toStdString();
    if (cli.isSet(gpus)) number(gpus, s.gpus, 1, 100000);
    if (cli.isSet(lora)) number(lora, s.lora_r, 0, 4096);
    if (cli.isSet(mb)) number(mb, s.micro_batch, 1, 4096);
    if (cli.isSet(strategy)) {
      s.strategy = cli.value(strategy).toStdString();
      if (!peftplan::planner::from_name(s.strategy, peftplan::planner::kStages))
        throw peftplan::input_error("--strategy", "", "must be one of " + peftplan::planner::names_of(peftplan::planner::kStages), s.strategy);
    }
    w.set_scenario(s);
  } catch (const peftplan::InputError& e) {
    return bad_input(e.what());
  }
  // Files in place of controls: read now, and a bad one ends the start (the window would show it
  // in the verdict line; a script wants the exit code).
  if (cli.isSet(peft) && !w.set_adapter_config(cli.value(peft).toStdString())) return bad_input(w.verdict_line()->text().toStdString());
  if (cli.isSet(ds) && cli.isSet(accel)) return bad_input("--ds-config and --accelerate-config: give one launcher's config, not both");
  for (const auto* o : {&ds, &accel}) {
    if (!cli.isSet(*o)) continue;
    const std::string file = cli.value(*o).toStdString();
    if (!w.set_launcher_config(file)) return bad_input(w.verdict_line()->text().toStdString());
    // The file sets the strategy and the micro-batch (its controls show and lock its values): a
    // flag typed beside it that says otherwise is refused, as `peftplan plan` refuses it.
    const peftplan::gui::Scenario set = w.scenario();
    const std::string flag = "--" + o->names().front().toStdString();
    if (cli.isSet(mb) && cli.value(mb).toInt() != set.micro_batch)
      return bad_input(fmt::format("--micro-batch {} contradicts {} {} (the micro-batch it sets is {}): give one of them",
                                   cli.value(mb).toStdString(), flag, file, set.micro_batch));
    if (cli.isSet(strategy) && cli.value(strategy).toStdString() != set.strategy)
      return bad_input(fmt::format("--strategy {} contradicts {} {} (the strategy it sets is {}): give one of them",
                                   cli.value(strategy).toStdString(), flag, file, set.strategy));
  }
  if (cli.isSet(run) && !w.open_run(cli.value(run).toStdString())) return bad_input(w.verdict_line()->text().toStdString());
  if (cli.isSet(view) && !w.show_view(cli.value(view).toStdString()))
    return bad_input("--view " + cli.value(view).toStdString() + ": no such view (memory, time, recommendation, what moves, timeline, compare, measured)");
  w.show();
  if (cli.isSet(shot)) {
    const QString file = cli.value(shot);
    QObject::connect(&w, &peftplan::gui::Explorer::answered, &w, [&w, file](bool ok) {
      if (!w.settled()) return;  // an older request's answer: wait for the newest
      if (!ok) {  // bad input (a model, a cluster, a file of the scenario): its line, exit code 2
        bad_input(w.verdict_line()->text().toStdString());
        QApplication::exit(2);
        return;
      }
      QTimer::singleShot(200, &w, [&w, file] {  // let the charts lay out
        const bool saved = w.grab().save(file, "PNG");
        QApplication::exit(saved ? 0 : 2);
      });
    });
  }
  return QApplication::exec();
}
