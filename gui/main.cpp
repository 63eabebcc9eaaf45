// peftplan-gui: the what-if explorer. --model, --cluster, --lora-r, --micro-batch, --strategy
// start from given inputs; --screenshot FILE renders the window (offscreen works:
// QT_QPA_PLATFORM=offscreen) once the first plan is shown, saves it as PNG and exits.
#include <QApplication>
#include <QCommandLineParser>
#include <QTimer>

#include "explorer.h"

int main(int argc, char** argv) {
  QApplication app(argc, argv);
  QApplication::setApplicationName("peftplan-gui");
  QCommandLineParser cli;
  cli.setApplicationDescription("peftplan's what-if explorer: memory, time and the recommendation for every strategy, on every change");
  cli.addHelpOption();
  const QCommandLineOption model("model", "zoo name or config.json", "NAME");
  const QCommandLineOption cluster("cluster", "preset or spelling (2x8xH100-SXM-NDR)", "CLUSTER");
  const QCommandLineOption lora("lora-r", "LoRA rank (0: full fine-tuning)", "R");
  const QCommandLineOption mb("micro-batch", "sequences per GPU per micro-step", "B");
  const QCommandLineOption strategy("strategy", "your strategy (ddp, zero1, ...)", "S");
  const QCommandLineOption shot("screenshot", "save the window as PNG once planned, and exit", "FILE");
  cli.addOptions({model, cluster, lora, mb, strategy, shot});
  cli.process(app);
  peftplan::gui::Explorer w;
  peftplan::gui::Scenario s = w.scenario();
  if (cli.isSet(model)) s.model = cli.value(model).toStdString();
  if (cli.isSet(cluster)) s.cluster = cli.value(cluster).toStdString();
  if (cli.isSet(lora)) s.lora_r = cli.value(lora).toInt();
  if (cli.isSet(mb)) s.micro_batch = cli.value(mb).toInt();
  if (cli.isSet(strategy)) s.strategy = cli.value(strategy).toStdString();
  w.set_scenario(s);
  w.show();
  if (cli.isSet(shot)) {
    const QString file = cli.value(shot);
    QObject::connect(&w, &peftplan::gui::Explorer::planned, &w, [&w, file] {
      QTimer::singleShot(200, &w, [&w, file] {  // let the charts lay out
        const bool ok = w.grab().save(file, "PNG");
        QApplication::exit(ok ? 0 : 2);
      });
    });
  }
  return QApplication::exec();
}
