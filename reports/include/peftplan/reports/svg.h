// A small SVG chart module: the report's charts as self-contained <svg> elements (no script, no
// font fetched), with axes in units, legible labels and a <title> tooltip on every bar, segment
// and point. Output is well-formed XML, so the report is too.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace peftplan::reports {

std::string xml_escape(std::string_view s);

struct Segment {
  std::string label;    // legend entry ("activations")
  double value = 0;     // in the chart's unit
  std::string colour;   // "#59a14f"
  std::string tooltip;  // the <title>: the segment's numbers
};

struct Bar {
  std::string label;    // under the bar ("zero3")
  std::vector<Segment> segments;  // bottom to top (stacked) or left to right (horizontal)
  std::string note;     // above the bar ("does not fit"), optional
};

struct BarChart {
  std::string title;
  std::string subtitle;  // a second line under the title, optional
  std::string unit;     // axis unit ("GiB", "s")
  std::vector<Bar> bars;
  // Horizontal reference lines (a GPU's memory, the headroom): value and label.
  std::vector<std::pair<double, std::string>> lines;
};

// The largest bar's total (the sum of its segments).
double tallest_bar(const BarChart& chart);

// Vertical stacked bars, one per Bar, with a legend of the segment labels in first-seen order.
std::string stacked_bars_svg(const BarChart& chart);
// Horizontal stacked bars (step time split), one row per Bar.
std::string horizontal_bars_svg(const BarChart& chart);

struct Point {
  double x = 0, y = 0;
  std::string label, tooltip;
};
// Predicted (x) against measured (y) with the y = x diagonal.
std::string scatter_svg(const std::string& title, const std::string& unit, const std::vector<Point>& points);

// Bars on lanes along one time axis (a step's ops per stream, predicted above measured).
struct LaneBar {
  double start = 0, end = 0;  // in the chart's unit
  std::string colour;
  std::string tooltip;
};
struct Lane {
  std::string label;  // at the left of the lane
  std::vector<LaneBar> bars;
};
struct LaneChart {
  std::string title;
  std::string unit;   // the time axis ("ms")
  std::vector<Lane> lanes;
  std::vector<std::pair<std::string, std::string>> legend;  // label, colour
};
std::string lanes_svg(const LaneChart& chart);

// A "nice" axis maximum and step for values up to `max` (1, 2 or 5 times a power of ten).
std::pair<double, double> nice_axis(double max);

}  // namespace peftplan::reports
