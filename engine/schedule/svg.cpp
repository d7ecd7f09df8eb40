#include "engine/schedule/svg.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

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

// Length of the well-formed UTF-8 sequence of a character from 0x80 up at text[at], or 0.
size_t utf8_sequence_length(const std::string& text, size_t at) {
  const auto byte = [&](size_t i) { return static_cast<unsigned char>(text[i]); };
  const unsigned char lead = byte(at);
  const size_t n = lead >= 0xc2 && lead <= 0xdf   ? 2
                   : lead >= 0xe0 && lead <= 0xef ? 3
                   : lead >= 0xf0 && lead <= 0xf4 ? 4
                                                  : 0;
  if (n == 0 || at + n > text.size()) return 0;
  for (size_t i = 1; i < n; ++i)
    if ((byte(at + i) & 0xc0) != 0x80) return 0;
  // Overlong forms, UTF-16 surrogates and code points past U+10FFFF.
  const unsigned char second = byte(at + 1);
  if ((lead == 0xe0 && second < 0xa0) || (lead == 0xed && second >= 0xa0) ||
      (lead == 0xf0 && second < 0x90) || (lead == 0xf4 && second >= 0x90))
    return 0;
  return n;
}

// Text as XML character data. XML 1.0 allows no control characters but tab and line breaks,
// and its text must be UTF-8: a title made of a loaded schedule's name may hold anything, so
// a control character or a byte outside well-formed UTF-8 is written as the text \xNN, as
// the command line shows it in messages.
std::string escape(const std::string& text) {
  std::string out;
  const auto hex = [&](unsigned char u) {
    static constexpr char kDigits[] = "0123456789abcdef";
    out.append("\\x").append(1, kDigits[u >> 4]).append(1, kDigits[u & 0xf]);
  };
  for (size_t at = 0; at < text.size(); ++at) {
    const char c = text[at];
    const auto u = static_cast<unsigned char>(c);
    if (c == '<') {
      out += "&lt;";
    } else if (c == '>') {
      out += "&gt;";
    } else if (c == '&') {
      out += "&amp;";
    } else if (c == '"') {
      out += "&quot;";
    } else if (u < 0x20 || u == 0x7f) {
      hex(u);
    } else if (u < 0x80) {
      out += c;
    } else if (const size_t n = utf8_sequence_length(text, at); n > 0) {
      out.append(text, at, n);
      at += n - 1;
    } else {
      hex(u);
    }
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
      return "#76b7b2";  // teal
    default:
      return "#bab0ac";
  }
}

// Legend entries laid out left to right from `left`, so that the canvas can be made wide
// enough for them before anything is drawn.
struct LegendEntry {
  std::string fill, text;
  bool lighter = false;
};
constexpr double kLegendSwatch = 14, kLegendGap = 16, kCharWidth = 7;
double entry_width(const LegendEntry& e) {
  return kLegendSwatch + 4 + kCharWidth * e.text.size() + kLegendGap;
}

// A transfer that takes time: drawn as a strip under the compute boxes of both its ranks.
constexpr const char* kSendFill = "#76706b";
constexpr const char* kRecvFill = "#b07aa1";

}  // namespace

std::string render_svg(const Schedule& schedule, const SimResult& sim, const SvgOptions& opt) {
  const double left = 56, right = 16, top = opt.title.empty() ? 12 : 36, row = opt.row_height_px;
  const int all_ranks = static_cast<int>(schedule.ranks.size());
  const int R = std::min(all_ranks, std::max(opt.max_ranks, 1));
  bool costed_transfers = false;
  for (int r = 0; r < R && !costed_transfers; ++r)
    for (size_t i = 0; i < schedule.ranks[r].size(); ++i)
      if (is_transfer(schedule.ranks[r][i].kind) && sim.timing[r][i].end > sim.timing[r][i].start) {
        costed_transfers = true;
        break;
      }
  // Each row: compute boxes, then (when transfers take time, or gradients are all-reduced)
  // strips for the streams that run beside the computes, one each for sends, receives and
  // all-reduces: these overlap in time, and on one strip a receive would hide a send.
  const bool reduces = schedule.replicas > 1;
  const int strips = (costed_transfers ? 2 : 0) + (reduces ? 1 : 0);
  const double strip = strips > 0 ? std::max(3.0, std::round(row * 0.2)) : 0.0;
  const double box_height = row - 4 - (strip > 0 ? strip + 1 : 0);
  const double row_step = row + std::max(strips - 1, 0) * strip;  // a rank's row and its strips
  auto strip_y = [&](int r, ActionKind kind) {
    const int lane = is_reduce(kind) ? strips - 1 : is_send(kind) ? 0 : 1;
    return top + r * row_step + 2 + box_height + 1 + lane * strip;
  };

  std::vector<LegendEntry> legend{{fill_of(ActionKind::kForward), "F forward"}};
  if (schedule.splits_backward()) {
    legend.push_back({fill_of(ActionKind::kBackwardInput), "I input grad"});
    legend.push_back({fill_of(ActionKind::kBackwardWeight), "W weight grad"});
  } else {
    legend.push_back({fill_of(ActionKind::kBackward), "B backward"});
  }
  legend.push_back({"#eeeeee", "idle"});
  if (reduces)
    legend.push_back({fill_of(ActionKind::kAllReduceGrad), "AR grad all-reduce (strip)"});
  if (schedule.placement.chunks > 1)
    legend.push_back({fill_of(ActionKind::kForward), "odd chunks lighter", true});
  if (costed_transfers) {
    legend.push_back({kSendFill, "send (strip)"});
    legend.push_back({kRecvFill, "receive (strip)"});
  }
  double legend_width = 0;
  for (const auto& e : legend) legend_width += entry_width(e);
  char stats[128];
  std::snprintf(stats, sizeof stats, "makespan %s, bubble %.4f; numbers are micro-batches",
                num(sim.makespan).c_str(), sim.bubble_fraction);
  // Over the box cap, every drawn rank is drawn up to the same time, `horizon`: the start of
  // the first box past the cap in time order. Cutting rank after rank instead would leave the
  // later ranks bare, which reads as idle.
  auto drawn = [&](int r, size_t i) {
    const ActionKind kind = schedule.ranks[r][i].kind;
    const auto& t = sim.timing[r][i];
    return is_compute(kind) || is_reduce(kind) || (costed_transfers && t.end > t.start);
  };
  std::vector<double> starts;
  for (int r = 0; r < R; ++r)
    for (size_t i = 0; i < schedule.ranks[r].size(); ++i)
      if (drawn(r, i)) starts.push_back(sim.timing[r][i].start);
  const bool time_cut = starts.size() > opt.max_boxes;
  double horizon = sim.makespan;
  if (time_cut) {
    const auto past = starts.begin() + static_cast<std::ptrdiff_t>(opt.max_boxes);
    std::nth_element(starts.begin(), past, starts.end());
    horizon = *past;
  }
  // What was left out, said under the legend (ranks past the cap draw nothing, and the total
  // counts their boxes too).
  size_t all_boxes = starts.size();
  for (int r = R; r < all_ranks; ++r)
    for (size_t i = 0; i < schedule.ranks[r].size(); ++i) all_boxes += drawn(r, i);
  const size_t boxes =
      time_cut ? static_cast<size_t>(std::count_if(starts.begin(), starts.end(),
                                                   [&](double t) { return t < horizon; }))
               : starts.size();
  std::string note;
  if (R < all_ranks || time_cut)
    note = "drawn: " + std::to_string(R) + " of " + std::to_string(all_ranks) + " ranks" +
           (time_cut ? ", the first " + num(horizon) + " of " + num(sim.makespan) + " time units"
                     : "") +
           ", " + std::to_string(boxes) + " of " + std::to_string(all_boxes) +
           " actions (size cap)";
  const double text_width = kCharWidth * std::max(std::strlen(stats), note.size());

  const double span = horizon > 0 ? horizon : 1;
  const double scale = opt.px_per_unit > 0 ? opt.px_per_unit : opt.width_px / span;  // px per unit
  const double axis = span * scale;
  const double rows_bottom = top + R * row_step;
  const double height = rows_bottom + 82;
  const double width = std::max(left + axis, left + std::max(legend_width, text_width)) + right;
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
    const double y = top + r * row_step;
    out += "<text x=\"" + num(left - 8) + "\" y=\"" + num(y + row * 0.62) +
           "\" font-size=\"12\" text-anchor=\"end\">rank " + std::to_string(r) + "</text>\n";
    out += "<rect x=\"" + num(left) + "\" y=\"" + num(y + 2) + "\" width=\"" + num(axis) +
           "\" height=\"" + num(row_step - 4) + "\" fill=\"#eeeeee\"/>\n";
  }
  // Compute boxes, and transfer strips.
  for (int r = 0; r < R; ++r)
    for (size_t i = 0; i < schedule.ranks[r].size(); ++i) {
      const Action& a = schedule.ranks[r][i];
      const auto& t = sim.timing[r][i];
      if (!drawn(r, i) || (time_cut && t.start >= horizon)) continue;
      const double end = std::min(t.end, horizon);  // the picture ends at the horizon
      if (!is_compute(a.kind)) {
        const bool reduce = is_reduce(a.kind);
        const char* fill = reduce ? fill_of(a.kind) : is_send(a.kind) ? kSendFill : kRecvFill;
        out += "<g><title>" + escape(to_string(a) + " [" + num(t.start) + ", " + num(t.end) + ")") +
               "</title><rect x=\"" + num(left + t.start * scale) + "\" y=\"" +
               num(strip_y(r, a.kind)) + "\" width=\"" +
               num(std::max((end - t.start) * scale, reduce ? 1.0 : 0.0)) + "\" height=\"" +
               num(strip) + "\" fill=\"" + fill + "\"/></g>\n";
        continue;
      }
      const double x = left + t.start * scale, w = (end - t.start) * scale,
                   y = top + r * row_step + 2;
      const bool later_chunk = schedule.placement.chunk_of(a.stage) % 2 == 1;
      out += "<g><title>" + escape(to_string(a) + " [" + num(t.start) + ", " + num(t.end) + ")") +
             "</title>";
      out += "<rect x=\"" + num(x) + "\" y=\"" + num(y) + "\" width=\"" + num(w) + "\" height=\"" +
             num(box_height) + "\" fill=\"" + fill_of(a.kind) + "\"" +
             (later_chunk ? " fill-opacity=\"0.6\"" : "") +
             " stroke=\"white\" stroke-width=\"1\"/>";
      const std::string label = std::to_string(a.microbatch);
      const double font =
          std::min(12.0, std::min(box_height * 0.55, w / std::max<size_t>(label.size(), 1) * 1.4));
      if (font >= 5)
        out += "<text x=\"" + num(x + w / 2) + "\" y=\"" + num(y + box_height / 2 + font * 0.35) +
               "\" font-size=\"" + num(font) + "\" text-anchor=\"middle\" fill=\"white\">" + label +
               "</text>";
      out += "</g>\n";
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
  const double ly = rows_bottom + 32;
  for (const auto& e : legend) {
    out += "<rect x=\"" + num(lx) + "\" y=\"" + num(ly) + "\" width=\"" + num(kLegendSwatch) +
           "\" height=\"" + num(kLegendSwatch) + "\" fill=\"" + e.fill + "\"" +
           (e.lighter ? " fill-opacity=\"0.6\"" : "") + "/><text x=\"" +
           num(lx + kLegendSwatch + 4) + "\" y=\"" + num(ly + 11) + "\" font-size=\"12\">" +
           escape(e.text) + "</text>\n";
    lx += entry_width(e);
  }
  out += "<text x=\"" + num(left) + "\" y=\"" + num(ly + 30) +
         "\" font-size=\"12\" fill=\"#555\">" + escape(stats) + "</text>\n";
  if (!note.empty())
    out += "<text x=\"" + num(left) + "\" y=\"" + num(ly + 46) +
           "\" font-size=\"12\" fill=\"#a00\">" + escape(note) + "</text>\n";
  out += "</svg>\n";
  return out;
}

}  // namespace conveyor::schedule
