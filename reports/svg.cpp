// The report's SVG charts (see svg.h). Sizes are in SVG user units of a 760-wide viewBox; the
// report's CSS scales every chart to the page width, so nothing is cut on A4 or Letter.
#include "peftplan/reports/svg.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "peftplan/reports/colours.h"

namespace peftplan::reports {

std::string xml_escape(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

double tallest_bar(const BarChart& c) {
  double most = 0;
  for (const auto& b : c.bars) {
    double sum = 0;
    for (const auto& s : b.segments) sum += s.value;
    most = std::max(most, sum);
  }
  return most;
}

std::pair<double, double> nice_axis(double max) {
  if (!(max > 0)) return {1.0, 0.2};
  const double raw = max / 5.0;
  const double p = std::pow(10.0, std::floor(std::log10(raw)));
  double step = p;
  for (double m : {1.0, 2.0, 2.5, 5.0, 10.0})
    if (m * p >= raw) {
      step = m * p;
      break;
    }
  return {std::ceil(max / step - 1e-9) * step, step};
}

namespace {

constexpr double kWidth = 760;

// Each chart carries its own style, so that an .svg file beside report.md draws alone.
constexpr std::string_view kStyle =
    "<style>text{font-family:DejaVu Sans,Arial,sans-serif;fill:#222}.title{font-size:15px;font-weight:bold}"
    ".tick,.legend{font-size:11px}.label{font-size:11px}.value{font-size:10px;fill:#444}.axis{font-size:12px}"
    ".grid{stroke:#ddd;stroke-width:1}.limit{stroke:#c00;stroke-width:1.5;stroke-dasharray:6 3}"
    ".limit-label{font-size:11px;fill:#c00}.diagonal{stroke:#888;stroke-dasharray:4 3}.point{fill:#4e79a7;stroke:#fff}</style>";

std::string fmt_tick(double v) {
  if (v == std::floor(v)) return fmt::format("{:.0f}", v);
  return fmt::format("{:g}", v);
}

// Legend entries in first-seen order.
std::vector<std::pair<std::string, std::string>> legend_of(const BarChart& c) {
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& b : c.bars)
    for (const auto& s : b.segments)
      if (std::none_of(out.begin(), out.end(), [&](const auto& e) { return e.first == s.label; })) out.push_back({s.label, s.colour});
  return out;
}

std::string legend_svg(const std::vector<std::pair<std::string, std::string>>& entries, double y, double& height) {
  std::string s;
  double x = 60, row = y;
  for (const auto& [label, colour] : entries) {
    const double w = 18 + 7.0 * static_cast<double>(label.size()) + 16;
    if (x + w > kWidth - 10) {
      x = 60;
      row += 18;
    }
    s += fmt::format(R"(<rect x="{:.1f}" y="{:.1f}" width="12" height="12" fill="{}"/><text x="{:.1f}" y="{:.1f}" class="legend">{}</text>)", x, row,
                     colour, x + 16, row + 10, xml_escape(label));
    s += "\n";
    x += w;
  }
  height = row - y + 18;
  return s;
}

// A horizontal time or value axis under a plot of rows: a grid line and tick per step, the unit
// below (horizontal bars and lanes share it).
std::string x_axis_svg(double left, double right, double plot_top, double plot_h, double top, double step, const std::string& unit) {
  auto x_of = [&](double v) { return left + (right - left) * v / top; };
  std::string body;
  for (double t = 0; t <= top + 1e-9; t += step)
    body += fmt::format(R"(<line x1="{:.1f}" y1="{:.1f}" x2="{:.1f}" y2="{:.1f}" class="grid"/><text x="{:.1f}" y="{:.1f}" class="tick" text-anchor="middle">{}</text>)",
                        x_of(t), plot_top, x_of(t), plot_top + plot_h, x_of(t), plot_top + plot_h + 14, fmt_tick(t)) + "\n";
  body += fmt::format(R"(<text x="{:.1f}" y="{:.1f}" class="axis" text-anchor="middle">{}</text>)", (left + right) / 2, plot_top + plot_h + 30, xml_escape(unit)) + "\n";
  return body;
}

}  // namespace

std::string stacked_bars_svg(const BarChart& c) {
  double max = tallest_bar(c);
  double line_max = 0;
  for (const auto& l : c.lines) line_max = std::max(line_max, l.first);
  max = std::max(max, line_max);
  // A bar far above the reference lines (full fine-tuning of a 70B) would flatten the rest: the
  // axis stops at three times the highest line and such a bar is drawn clipped, its value written.
  if (line_max > 0) max = std::min(max, 3 * line_max);
  const auto [top, step] = nice_axis(max);
  const double left = 60, right = kWidth - 20, plot_top = 52, plot_h = 300, base = plot_top + plot_h;
  const double slot = (right - left) / std::max<double>(1, static_cast<double>(c.bars.size()));
  const double bw = std::min(70.0, slot * 0.6);
  auto y_of = [&](double v) { return base - plot_h * v / top; };
  std::string body;
  // Axis and grid.
  for (double t = 0; t <= top + 1e-9; t += step)
    body += fmt::format(R"(<line x1="{:.1f}" y1="{:.1f}" x2="{:.1f}" y2="{:.1f}" class="grid"/><text x="{:.1f}" y="{:.1f}" class="tick" text-anchor="end">{}</text>)",
                        left, y_of(t), right, y_of(t), left - 6, y_of(t) + 4, fmt_tick(t)) + "\n";
  body += fmt::format(R"S(<text x="14" y="{:.1f}" class="axis" transform="rotate(-90 14 {:.1f})" text-anchor="middle">{}</text>)S", plot_top + plot_h / 2,
                      plot_top + plot_h / 2, xml_escape(c.unit)) + "\n";
  // Bars.
  std::size_t label_lines = 1;
  for (std::size_t i = 0; i < c.bars.size(); ++i) {
    const auto& b = c.bars[i];
    const double x = left + slot * (static_cast<double>(i) + 0.5) - bw / 2;
    double acc = 0;
    for (const auto& s : b.segments) {
      if (s.value <= 0) continue;
      const double y0 = y_of(std::min(top, acc + s.value)), h = y_of(std::min(top, acc)) - y0;
      body += fmt::format(R"(<rect x="{:.1f}" y="{:.2f}" width="{:.1f}" height="{:.2f}" fill="{}" class="seg"><title>{}</title></rect>)", x, y0, bw,
                          std::max(0.0, h), s.colour, xml_escape(s.tooltip)) + "\n";
      acc += s.value;
    }
    // The label under the bar, broken at " + " into lines.
    std::vector<std::string> lines;
    for (std::size_t at = 0;;) {
      const std::size_t plus = b.label.find(" + ", at);
      lines.push_back(b.label.substr(at, plus == std::string::npos ? std::string::npos : plus - at) + (plus == std::string::npos ? "" : " +"));
      if (plus == std::string::npos) break;
      at = plus + 3;
    }
    label_lines = std::max(label_lines, lines.size());
    std::string tspans;
    for (std::size_t k = 0; k < lines.size(); ++k)
      tspans += fmt::format(R"(<tspan x="{:.1f}" dy="{}">{}</tspan>)", x + bw / 2, k == 0 ? "0" : "1.2em", xml_escape(lines[k]));
    body += fmt::format(R"(<text x="{:.1f}" y="{:.1f}" class="label" text-anchor="middle">{}</text>)", x + bw / 2, base + 16, tspans) + "\n";
    const bool clipped = acc > top;
    body += fmt::format(R"(<text x="{:.1f}" y="{:.1f}" class="value" text-anchor="middle">{}</text>)", x + bw / 2, y_of(std::min(acc, top)) - 4,
                        xml_escape(fmt::format("{:.1f}{}{}", acc, clipped ? " (clipped)" : "", b.note.empty() ? "" : " " + b.note))) + "\n";
  }
  // Reference lines; the first's label above it, the next ones' below, so that close lines stay legible.
  for (std::size_t i = 0; i < c.lines.size(); ++i) {
    const auto& [v, label] = c.lines[i];
    body += fmt::format(R"(<line x1="{:.1f}" y1="{:.2f}" x2="{:.1f}" y2="{:.2f}" class="limit"><title>{}</title></line><text x="{:.1f}" y="{:.1f}" class="limit-label" text-anchor="end">{}</text>)",
                        left, y_of(v), right, y_of(v), xml_escape(label), right, i == 0 ? y_of(v) - 4 : y_of(v) + 12, xml_escape(label)) + "\n";
  }
  double legend_h = 0;
  const double legend_y = base + 22 + 14 * static_cast<double>(label_lines);
  const std::string legend = legend_svg(legend_of(c), legend_y, legend_h);
  const double height = legend_y + legend_h + 6;
  return fmt::format(R"(<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {:.0f} {:.0f}" role="img" class="chart"><title>{}</title>{})"
                     "\n<text x=\"{:.1f}\" y=\"22\" class=\"title\">{}</text><text x=\"{:.1f}\" y=\"38\" class=\"value\">{}</text>\n{}{}</svg>",
                     kWidth, height, xml_escape(c.title), kStyle, left, xml_escape(c.title), left, xml_escape(c.subtitle), body, legend);
}

std::string horizontal_bars_svg(const BarChart& c) {
  double max = tallest_bar(c);
  const auto [top, step] = nice_axis(max);
  const double left = 270, right = kWidth - 160, plot_top = 40, row = 24;
  const double plot_h = row * static_cast<double>(c.bars.size());
  auto x_of = [&](double v) { return left + (right - left) * v / top; };
  std::string body = x_axis_svg(left, right, plot_top, plot_h, top, step, c.unit);
  for (std::size_t i = 0; i < c.bars.size(); ++i) {
    const auto& b = c.bars[i];
    const double y = plot_top + row * static_cast<double>(i) + 4;
    double acc = 0;
    for (const auto& s : b.segments) {
      if (s.value <= 0) continue;
      body += fmt::format(R"(<rect x="{:.2f}" y="{:.1f}" width="{:.2f}" height="{:.1f}" fill="{}" class="seg"><title>{}</title></rect>)", x_of(acc), y,
                          x_of(acc + s.value) - x_of(acc), row - 8, s.colour, xml_escape(s.tooltip)) + "\n";
      acc += s.value;
    }
    body += fmt::format(R"(<text x="{:.1f}" y="{:.1f}" class="label" text-anchor="end">{}</text>)", left - 6, y + row / 2, xml_escape(b.label)) + "\n";
    if (!b.note.empty())  // in the right margin, beside the bar
      body += fmt::format(R"(<text x="{:.1f}" y="{:.1f}" class="value">{}</text>)", right + 8, y + row / 2, xml_escape(b.note)) + "\n";
  }
  double legend_h = 0;
  const std::string legend = legend_svg(legend_of(c), plot_top + plot_h + 40, legend_h);
  const double height = plot_top + plot_h + 40 + legend_h + 6;
  return fmt::format(R"(<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {:.0f} {:.0f}" role="img" class="chart"><title>{}</title>{})"
                     "\n<text x=\"60\" y=\"22\" class=\"title\">{}</text>\n{}{}</svg>",
                     kWidth, height, xml_escape(c.title), kStyle, xml_escape(c.title), body, legend);
}

std::string scatter_svg(const std::string& title, const std::string& unit, const std::vector<Point>& points) {
  double max = 0;
  for (const auto& p : points) max = std::max({max, p.x, p.y});
  const auto [top, step] = nice_axis(max);
  const double left = 70, size = 320, plot_top = 40, base = plot_top + size;
  auto x_of = [&](double v) { return left + size * v / top; };
  auto y_of = [&](double v) { return base - size * v / top; };
  std::string body;
  for (double t = 0; t <= top + 1e-9; t += step) {
    body += fmt::format(R"(<line x1="{:.1f}" y1="{:.1f}" x2="{:.1f}" y2="{:.1f}" class="grid"/><text x="{:.1f}" y="{:.1f}" class="tick" text-anchor="end">{}</text>)",
                        left, y_of(t), left + size, y_of(t), left - 6, y_of(t) + 4, fmt_tick(t)) + "\n";
    body += fmt::format(R"(<text x="{:.1f}" y="{:.1f}" class="tick" text-anchor="middle">{}</text>)", x_of(t), base + 14, fmt_tick(t)) + "\n";
  }
  body += fmt::format(R"(<line x1="{:.1f}" y1="{:.1f}" x2="{:.1f}" y2="{:.1f}" class="diagonal"><title>measured = predicted</title></line>)", x_of(0), y_of(0),
                      x_of(top), y_of(top)) + "\n";
  for (const auto& p : points)
    body += fmt::format(R"(<circle cx="{:.2f}" cy="{:.2f}" r="4" class="point"><title>{}</title></circle>)", x_of(p.x), y_of(p.y), xml_escape(p.tooltip)) + "\n";
  body += fmt::format(R"S(<text x="{:.1f}" y="{:.1f}" class="axis" text-anchor="middle">predicted ({})</text>)S", left + size / 2, base + 32, xml_escape(unit)) + "\n";
  body += fmt::format(R"S(<text x="16" y="{:.1f}" class="axis" transform="rotate(-90 16 {:.1f})" text-anchor="middle">measured ({})</text>)S", plot_top + size / 2,
                      plot_top + size / 2, xml_escape(unit)) + "\n";
  return fmt::format(R"(<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {:.0f} {:.0f}" role="img" class="chart"><title>{}</title>{})"
                     "\n<text x=\"{:.1f}\" y=\"22\" class=\"title\">{}</text>\n{}</svg>",
                     kWidth, base + 44, xml_escape(title), kStyle, left, xml_escape(title), body);
}

std::string lanes_svg(const LaneChart& c) {
  double max = 0;
  for (const auto& l : c.lanes)
    for (const auto& b : l.bars) max = std::max(max, b.end);
  const auto [top, step] = nice_axis(max);
  const double left = 230, right = kWidth - 20, plot_top = 40, row = 22;
  const double plot_h = row * static_cast<double>(c.lanes.size());
  auto x_of = [&](double v) { return left + (right - left) * v / top; };
  std::string body = x_axis_svg(left, right, plot_top, plot_h, top, step, c.unit);
  for (std::size_t i = 0; i < c.lanes.size(); ++i) {
    const auto& lane = c.lanes[i];
    const double y = plot_top + row * static_cast<double>(i) + 3;
    for (const auto& b : lane.bars)  // at least a hairline, so that a short op is still seen and has its tooltip
      body += fmt::format(R"(<rect x="{:.2f}" y="{:.1f}" width="{:.2f}" height="{:.1f}" fill="{}" class="seg"><title>{}</title></rect>)", x_of(b.start), y,
                          std::max(0.6, x_of(b.end) - x_of(b.start)), row - 6, b.colour, xml_escape(b.tooltip)) + "\n";
    body += fmt::format(R"(<text x="{:.1f}" y="{:.1f}" class="label" text-anchor="end">{}</text>)", left - 6, y + row / 2 + 1, xml_escape(lane.label)) + "\n";
  }
  double legend_h = 0;
  const std::string legend = legend_svg(c.legend, plot_top + plot_h + 40, legend_h);
  const double height = plot_top + plot_h + 40 + legend_h + 6;
  return fmt::format(R"(<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {:.0f} {:.0f}" role="img" class="chart"><title>{}</title>{})"
                     "\n<text x=\"60\" y=\"22\" class=\"title\">{}</text>\n{}{}</svg>",
                     kWidth, height, xml_escape(c.title), kStyle, xml_escape(c.title), body, legend);
}

}  // namespace peftplan::reports
