// The step timeline of one plan: one lane per stream (compute, communication, copies, host), each
// op a bar coloured by its phase (collectives in the communication colour, as in the reports),
// along one time axis. The wheel zooms around the pointer, dragging pans, a double click shows
// the whole step again; hovering a bar names the op and its times. Presentation only: the bars
// are reports::predicted_timeline's (a measured step's lanes can go beside them).
#pragma once

#include <string>
#include <vector>

#include <QWidget>

#include "peftplan/reports/report.h"

namespace peftplan::gui {

class TimelineView : public QWidget {
  Q_OBJECT
 public:
  explicit TimelineView(QWidget* parent = nullptr);

  // Shows these lanes, the whole step in view.
  void set_lanes(std::vector<reports::TimelineLane> lanes, std::string title);
  const std::vector<reports::TimelineLane>& lanes() const { return lanes_; }
  std::size_t bar_count() const;
  double step_s() const { return end_s_; }  // the last bar's end
  // The time range in view (seconds from the start of the step).
  double view_begin_s() const { return t0_; }
  double view_end_s() const { return t1_; }
  // Zooms by `factor` (> 1 zooms in) keeping the time `at_s` where it is on screen; the wheel's
  // action, public for tests.
  void zoom(double factor, double at_s);
  void show_all();
  // The bar under a point of the widget (lane index, bar index), or {-1, -1}.
  std::pair<int, int> bar_at(QPoint p) const;

 protected:
  void paintEvent(QPaintEvent*) override;
  void wheelEvent(QWheelEvent*) override;
  void mousePressEvent(QMouseEvent*) override;
  void mouseMoveEvent(QMouseEvent*) override;
  void mouseReleaseEvent(QMouseEvent*) override;
  void mouseDoubleClickEvent(QMouseEvent*) override;

 private:
  static constexpr int kLabelWidth = 190, kAxisHeight = 34, kLaneHeight = 26, kMargin = 10, kLegendHeight = 24;
  double x_of(double t) const;
  double t_of(double x) const;
  void clamp_view();

  std::vector<reports::TimelineLane> lanes_;
  std::string title_;
  double end_s_ = 0.0;
  double t0_ = 0.0, t1_ = 1.0;
  bool dragging_ = false;
  double drag_x_ = 0.0, drag_t0_ = 0.0;
};

}  // namespace peftplan::gui
