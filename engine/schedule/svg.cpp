#include "engine/schedule/svg.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "engine/schedule/ascii.h"

namespace conveyor::schedule {
namespace {

std::string num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f", v);
  std::string s(buf);
  while (s.back() == '0') s.pop_back();
  if (s.back() == '.') s.pop_back();
  return s;
}

std::string escape(const std::string& text) {
  std::string out;
  for (char c : text) {
    if (c == '<')
      out += "&lt;";
    else if (c == '>')
      out += "&gt;";
    else if (c == '&')
      out += "&amp;";
    else if (c == '"')
      out += "&quot;";
    else
      out += c;
  }
  return out;
}

const char* fill_of(ActionKind kind) {
  switch (kind) {
    case ActionKind::kForward:
      return "#4e79a7";  // blue
    case ActionKind::kBackward:
      return "#59a14f";  // green
    case ActionKind::kBackwardInput:
      return "#e15759";  // red
    case ActionKind::kBackwardWeight:
      return "#f28e2b";  // orange
    case ActionKind::kAllReduceGrad:
      return "#b07aa1";  // purple
    default:
      return "#bab0ac";
  }
}

}  // namespace

std::string render_svg(const Schedule& schedule, const SimResult& sim, const SvgOptions& opt) {
  const double left = 56, right = 16, top = opt.title.empty() ? 12 : 36, row = opt.row_height_px;
  const int all_ranks = static_cast<int>(schedule.ranks.size());
  const int R = std::min(all_ranks, std::max(opt.max_ranks, 1));
  size_t boxes = 0, all_boxes = 0;
  const double span = sim.makespan > 0 ? sim.makespan : 1;
  const double scale = opt.px_per_unit > 0 ? opt.px_per_unit : opt.width_px / span;  // px per unit
  const double axis = span * scale;
  const double rows_bottom = top + R * row;
  const double height = rows_bottom + 64;
  const double width = std::max(left + axis + right, 940.0);  // room for the legend
  std::string out;
  out += "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" + num(width) + "\" height=\"" +
         num(height) + "\" viewBox=\"0 0 " + num(width) + " " + num(height) +
         "\" font-family=\"Helvetica, Arial, sans-serif\">\n";
  out += "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  if (!opt.title.empty())
    out += "<text x=\"" + num(left) + "\" y=\"22\" font-size=\"15\" font-weight=\"bold\">" +
           escape(opt.title) + "</text>\n";
  // Rows: the light background is idle time.
  for (int r = 0; r < R; ++r) {
    const double y = top + r * row;
    out += "<text x=\"" + num(left - 8) + "\" y=\"" + num(y + row * 0.62) +
           "\" font-size=\"12\" text-anchor=\"end\">rank " + std::to_string(r) + "</text>\n";
    out += "<rect x=\"" + num(left) + "\" y=\"" + num(y + 2) + "\" width=\"" + num(axis) +
           "\" height=\"" + num(row - 4) + "\" fill=\"#eeeeee\"/>\n";
  }
  // Compute boxes.
  for (int r = 0; r < R; ++r)
    for (size_t i = 0; i < schedule.ranks[r].size(); ++i) {
      const Action& a = schedule.ranks[r][i];
      if (!is_compute(a.kind)) continue;
      if (++all_boxes > opt.max_boxes) continue;
      ++boxes;
      const auto& t = sim.timing[r][i];
      const double x = left + t.start * scale, w = (t.end - t.start) * scale, y = top + r * row + 2;
      const bool later_chunk = schedule.placement.chunk_of(a.stage) % 2 == 1;
      out += "<g><title>" + escape(to_string(a) + " [" + num(t.start) + ", " + num(t.end) + ")") +
             "</title>";
      out += "<rect x=\"" + num(x) + "\" y=\"" + num(y) + "\" width=\"" + num(w) + "\" height=\"" +
             num(row - 4) + "\" fill=\"" + fill_of(a.kind) + "\"" +
             (later_chunk ? " fill-opacity=\"0.6\"" : "") +
             " stroke=\"white\" stroke-width=\"1\"/>";
      const std::string label = std::to_string(a.microbatch);
      const double font =
          std::min(12.0, std::min(row * 0.5, w / std::max<size_t>(label.size(), 1) * 1.4));
      if (font >= 5)
        out += "<text x=\"" + num(x + w / 2) + "\" y=\"" + num(y + (row - 4) / 2 + font * 0.35) +
               "\" font-size=\"" + num(font) + "\" text-anchor=\"middle\" fill=\"white\">" + label +
               "</text>";
      out += "</g>\n";
    }
  // Gradient all-reduces: a strip along the bottom of the row, since they run on their own
  // stream, overlapping the computes above them.
  for (int r = 0; r < R; ++r)
    for (size_t i = 0; i < schedule.ranks[r].size(); ++i) {
      const Action& a = schedule.ranks[r][i];
      if (!is_reduce(a.kind)) continue;
      const auto& t = sim.timing[r][i];
      const double x = left + t.start * scale, w = std::max((t.end - t.start) * scale, 1.0);
      const double h = (row - 4) * 0.3, y = top + r * row + 2 + (row - 4) - h;
      out += "<g><title>" + escape(to_string(a) + " [" + num(t.start) + ", " + num(t.end) + ")") +
             "</title><rect x=\"" + num(x) + "\" y=\"" + num(y) + "\" width=\"" + num(w) +
             "\" height=\"" + num(h) + "\" fill=\"" + fill_of(a.kind) +
             "\" fill-opacity=\"0.85\"/></g>\n";
    }
  // Time axis and legend.
  out += "<line x1=\"" + num(left) + "\" y1=\"" + num(rows_bottom + 4) + "\" x2=\"" +
         num(left + axis) + "\" y2=\"" + num(rows_bottom + 4) + "\" stroke=\"#555\"/>\n";
  const double step = std::max(1.0, std::pow(10.0, std::floor(std::log10(span / 4))));
  for (double t = 0; t <= span + 1e-9; t += step * (span / step > 20 ? 5 : 1)) {
    const double x = left + t * scale;
    out += "<line x1=\"" + num(x) + "\" y1=\"" + num(rows_bottom + 4) + "\" x2=\"" + num(x) +
           "\" y2=\"" + num(rows_bottom + 8) + "\" stroke=\"#555\"/><text x=\"" + num(x) +
           "\" y=\"" + num(rows_bottom + 20) + "\" font-size=\"10\" text-anchor=\"middle\">" +
           num(t) + "</text>\n";
  }
  double lx = left;
  const double ly = rows_bottom + 34;
  auto legend = [&](const char* fill, const std::string& text) {
    out += "<rect x=\"" + num(lx) + "\" y=\"" + num(ly) + "\" width=\"14\" height=\"14\" fill=\"" +
           fill + "\"/><text x=\"" + num(lx + 18) + "\" y=\"" + num(ly + 11) +
           "\" font-size=\"12\">" + escape(text) + "</text>\n";
    lx += 30 + 7.0 * text.size();
  };
  legend(fill_of(ActionKind::kForward), "F forward");
  if (schedule.splits_backward()) {
    legend(fill_of(ActionKind::kBackwardInput), "I input grad");
    legend(fill_of(ActionKind::kBackwardWeight), "W weight grad");
  } else {
    legend(fill_of(ActionKind::kBackward), "B backward");
  }
  if (schedule.replicas > 1) legend(fill_of(ActionKind::kAllReduceGrad), "AR grad all-reduce");
  legend("#eeeeee", "idle");
  if (schedule.placement.chunks > 1) {
    out += "<rect x=\"" + num(lx) + "\" y=\"" + num(ly) + "\" width=\"14\" height=\"14\" fill=\"" +
           fill_of(ActionKind::kForward) + "\" fill-opacity=\"0.6\"/><text x=\"" + num(lx + 18) +
           "\" y=\"" + num(ly + 11) + "\" font-size=\"12\">odd chunks lighter</text>\n";
    lx += 30 + 7.0 * 18;
  }
  char stats[128];
  std::snprintf(stats, sizeof stats, "makespan %s, bubble %.4f; numbers are micro-batches",
                num(sim.makespan).c_str(), sim.bubble_fraction);
  out += "<text x=\"" + num(lx) + "\" y=\"" + num(ly + 11) + "\" font-size=\"12\" fill=\"#555\">" +
         escape(stats) + "</text>\n";
  if (R < all_ranks || boxes < all_boxes) {
    char cut[160];
    std::snprintf(cut, sizeof cut, "drawn: %d of %d ranks, %zu of %zu compute actions (size cap)",
                  R, all_ranks, boxes, all_boxes);
    out += "<text x=\"" + num(left) + "\" y=\"" + num(ly + 28) +
           "\" font-size=\"12\" fill=\"#a00\">" + escape(cut) + "</text>\n";
  }
  out += "</svg>\n";
  return out;
}

}  // namespace conveyor::schedule
