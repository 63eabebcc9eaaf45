// The step timeline (see timeline_view.h).
#include "timeline_view.h"

#include <algorithm>
#include <array>
#include <cmath>

#include <QMouseEvent>
#include <QPainter>
#include <QToolTip>
#include <QWheelEvent>

#include <fmt/format.h>

#include "peftplan/reports/colours.h"
#include "peftplan/reports/svg.h"

namespace peftplan::gui {

TimelineView::TimelineView(QWidget* parent) : QWidget(parent) {
  setMouseTracking(true);
  setMinimumHeight(kAxisHeight + 2 * kLaneHeight + 2 * kMargin);
  setAutoFillBackground(true);
}

void TimelineView::set_lanes(std::vector<reports::TimelineLane> lanes, std::string title) {
  lanes_ = std::move(lanes);
  title_ = std::move(title);
  end_s_ = 0.0;
  for (const auto& l : lanes_)
    for (const auto& b : l.bars) end_s_ = std::max(end_s_, b.end_s);
  setMinimumHeight(kAxisHeight + static_cast<int>(std::max<std::size_t>(lanes_.size(), 2)) * kLaneHeight + 2 * kMargin + kLegendHeight);
  show_all();
}

std::size_t TimelineView::bar_count() const {
  std::size_t n = 0;
  for (const auto& l : lanes_) n += l.bars.size();
  return n;
}

void TimelineView::show_all() {
  t0_ = 0.0;
  t1_ = end_s_ > 0.0 ? end_s_ : 1.0;
  update();
}

void TimelineView::clamp_view() {
  const double whole = end_s_ > 0.0 ? end_s_ : 1.0;
  const double width = std::clamp(t1_ - t0_, whole * 1e-6, whole);
  t0_ = std::clamp(t0_, 0.0, whole - width);
  t1_ = t0_ + width;
}

void TimelineView::zoom(double factor, double at_s) {
  if (!(factor > 0.0)) return;
  t0_ = at_s - (at_s - t0_) / factor;
  t1_ = at_s + (t1_ - at_s) / factor;
  clamp_view();
  update();
}

double TimelineView::x_of(double t) const {
  const double w = std::max(1, width() - kLabelWidth - kMargin);
  return kLabelWidth + (t - t0_) / (t1_ - t0_) * w;
}

double TimelineView::t_of(double x) const {
  const double w = std::max(1, width() - kLabelWidth - kMargin);
  return t0_ + (x - kLabelWidth) / w * (t1_ - t0_);
}

std::pair<int, int> TimelineView::bar_at(QPoint p) const {
  const int lane = (p.y() - kAxisHeight - kMargin) / kLaneHeight;
  if (p.y() < kAxisHeight + kMargin || lane < 0 || lane >= static_cast<int>(lanes_.size()) || p.x() < kLabelWidth) return {-1, -1};
  const double plot = std::max(1, width() - kLabelWidth - kMargin);
  const double t = t_of(p.x()), slack = (t1_ - t0_) / plot * 2;  // two pixels either side
  const auto& bars = lanes_[static_cast<std::size_t>(lane)].bars;
  int best = -1;
  double best_d = slack;
  for (int i = 0; i < static_cast<int>(bars.size()); ++i) {
    const auto& b = bars[static_cast<std::size_t>(i)];
    const double d = t < b.start_s ? b.start_s - t : t > b.end_s ? t - b.end_s : 0.0;
    if (d <= best_d) {
      best = i;
      best_d = d;
      if (d == 0.0) break;
    }
  }
  return {best < 0 ? -1 : lane, best};
}

void TimelineView::paintEvent(QPaintEvent*) {
  QPainter p(this);
  p.fillRect(rect(), Qt::white);
  p.setPen(Qt::black);
  QFont f = font();
  f.setPointSizeF(8.5);
  p.setFont(f);
  p.drawText(QRect(kMargin, 2, width() - 2 * kMargin, 14), Qt::AlignLeft | Qt::AlignVCenter, QString::fromStdString(title_));
  if (lanes_.empty()) return;
  // The time axis: a "nice" step (reports' rule) in milliseconds.
  const double span_ms = (t1_ - t0_) * 1e3;
  const double tick = std::max(reports::nice_axis(span_ms).second, 1e-9);
  p.setPen(QColor("#999"));
  for (double t = std::ceil(t0_ * 1e3 / tick) * tick; t <= t1_ * 1e3 + 1e-12; t += tick) {
    const int x = static_cast<int>(std::lround(x_of(t / 1e3)));
    p.drawLine(x, kAxisHeight - 6, x, kAxisHeight + kMargin + static_cast<int>(lanes_.size()) * kLaneHeight);
    p.drawText(QRect(x - 40, 16, 80, 12), Qt::AlignCenter, QString::fromStdString(fmt::format("{:.4g} ms", t)));
  }
  // The legend under the lanes: each phase drawn, and collectives.
  {
    std::array<bool, sim::kNumPhases> seen{};
    bool collective = false;
    for (const auto& l : lanes_)
      for (const auto& b : l.bars) (b.collective ? collective : seen[static_cast<std::size_t>(b.phase)]) = true;
    int x = kLabelWidth;
    const int y = kAxisHeight + kMargin + static_cast<int>(lanes_.size()) * kLaneHeight + 8;
    auto item = [&](std::string_view hex, const std::string& text) {
      p.fillRect(QRect(x, y + 2, 10, 10), QColor(QString::fromUtf8(hex.data(), static_cast<int>(hex.size()))));
      p.setPen(Qt::black);
      const QString t = QString::fromStdString(text);
      p.drawText(QRect(x + 14, y, 200, 14), Qt::AlignLeft | Qt::AlignVCenter, t);
      x += 24 + p.fontMetrics().horizontalAdvance(t);
    };
    for (int ph = 0; ph < sim::kNumPhases; ++ph)
      if (seen[static_cast<std::size_t>(ph)]) item(reports::colour_of(static_cast<sim::Phase>(ph)), std::string(sim::name_of(static_cast<sim::Phase>(ph))));
    if (collective) item(reports::kCommColour, "collective");
  }
  for (std::size_t l = 0; l < lanes_.size(); ++l) {
    const int y = kAxisHeight + kMargin + static_cast<int>(l) * kLaneHeight;
    p.setPen(Qt::black);
    p.drawText(QRect(kMargin, y, kLabelWidth - 2 * kMargin, kLaneHeight), Qt::AlignRight | Qt::AlignVCenter,
               QString::fromStdString(lanes_[l].label));
    // Bars narrower than a pixel that fall on a pixel already drawn are skipped: a 70B plan has
    // tens of thousands of ops, and the whole step is a few hundred pixels wide.
    int last_px = -1;
    for (const auto& b : lanes_[l].bars) {
      if (b.end_s < t0_ || b.start_s > t1_) continue;
      const double x0 = std::max<double>(x_of(b.start_s), kLabelWidth), x1 = std::min<double>(x_of(b.end_s), width() - kMargin);
      if (x1 - x0 < 1.0 && static_cast<int>(x0) == last_px) continue;
      last_px = static_cast<int>(x0);
      const std::string_view hex = b.collective ? reports::kCommColour : reports::colour_of(b.phase);
      p.fillRect(QRectF(x0, y + 3, std::max(1.0, x1 - x0), kLaneHeight - 6), QColor(QString::fromUtf8(hex.data(), static_cast<int>(hex.size()))));
    }
  }
}

void TimelineView::wheelEvent(QWheelEvent* e) {
  const double notches = e->angleDelta().y() / 120.0;
  zoom(std::pow(1.25, notches), t_of(e->position().x()));
  e->accept();
}

void TimelineView::mousePressEvent(QMouseEvent* e) {
  if (e->button() != Qt::LeftButton) return;
  dragging_ = true;
  drag_x_ = e->position().x();
  drag_t0_ = t0_;
}

void TimelineView::mouseMoveEvent(QMouseEvent* e) {
  if (dragging_) {
    const double w = std::max(1, width() - kLabelWidth - kMargin);
    const double span = t1_ - t0_;
    t0_ = drag_t0_ - (e->position().x() - drag_x_) / w * span;
    t1_ = t0_ + span;
    clamp_view();
    update();
    return;
  }
  const auto [lane, bar] = bar_at(e->position().toPoint());
  if (bar < 0) {
    QToolTip::hideText();
    return;
  }
  const auto& b = lanes_[static_cast<std::size_t>(lane)].bars[static_cast<std::size_t>(bar)];
  QToolTip::showText(e->globalPosition().toPoint(),
                     QString::fromStdString(fmt::format("{} ({}{})\n{:.3f} → {:.3f} ms, {:.3f} ms", b.name, sim::name_of(b.phase),
                                                        b.collective ? ", collective" : "", b.start_s * 1e3, b.end_s * 1e3,
                                                        (b.end_s - b.start_s) * 1e3)),
                     this);
}

void TimelineView::mouseReleaseEvent(QMouseEvent*) { dragging_ = false; }

void TimelineView::mouseDoubleClickEvent(QMouseEvent*) { show_all(); }

}  // namespace peftplan::gui
