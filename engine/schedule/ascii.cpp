#include "engine/schedule/ascii.h"

#include <algorithm>
#include <cmath>

namespace conveyor::schedule {
namespace {
std::string pad(std::string s, size_t width) {
  if (s.size() < width) s.append(width - s.size(), ' ');
  return s;
}

// "r3:", the head of rank 3's row. Appended piece by piece: GCC 12 warns (-Wrestrict, a false
// positive) on "r" + std::to_string(r) once this is inlined.
std::string rank_head(size_t rank) {
  return std::string("r").append(std::to_string(rank)).append(":");
}
}  // namespace

std::string compute_label(const Schedule& schedule, const Action& a) {
  std::string label = kind_name(a.kind);
  if (schedule.placement.chunks > 1) label.append(std::to_string(a.stage)).append(".");
  return label.append(std::to_string(a.microbatch));
}

namespace {

// The grid with `marks` drawn marked, its rows around focus_rank and its columns around the
// marks (or around focus_index when they do not fit).
std::string step_grid(const Schedule& schedule, const std::vector<GridMark>& marks, int mark_rank,
                      int mark_index, int max_columns, int max_rows) {
  size_t steps = 0;
  for (const auto& list : schedule.ranks) steps = std::max(steps, list.size());
  size_t first = 0, last = steps;  // columns [first, last)
  if (mark_index >= 0 && steps > static_cast<size_t>(max_columns)) {
    const size_t half = max_columns / 2;
    int lo = mark_index, hi = mark_index;
    for (const GridMark& m : marks) lo = std::min(lo, m.index), hi = std::max(hi, m.index);
    const size_t centre = hi - lo < max_columns ? (lo + hi) / 2 : mark_index;
    first = centre > half ? centre - half : 0;
    last = std::min(steps, first + max_columns);
    first = last > static_cast<size_t>(max_columns) ? last - max_columns : 0;
  }
  // Rows [row_first, row_last): the window of ranks around the marked one.
  const size_t ranks = schedule.ranks.size();
  size_t row_first = 0, row_last = ranks;
  if (max_rows > 0 && ranks > static_cast<size_t>(max_rows)) {
    const size_t centre = mark_rank >= 0 ? static_cast<size_t>(mark_rank) : 0;
    row_first = centre > static_cast<size_t>(max_rows / 2) ? centre - max_rows / 2 : 0;
    row_last = std::min(ranks, row_first + max_rows);
    row_first = row_last - max_rows;
  }
  auto cell = [&](size_t r, size_t i) -> std::string {
    if (i >= schedule.ranks[r].size()) return "";
    const std::string t = to_string(schedule.ranks[r][i]);
    for (const GridMark& m : marks)
      if (static_cast<int>(r) == m.rank && static_cast<int>(i) == m.index) return ">>" + t + "<<";
    return t;
  };
  size_t width = 4;
  for (size_t r = row_first; r < row_last; ++r)
    for (size_t i = first; i < last; ++i) width = std::max(width, cell(r, i).size());
  std::string out = "step  ";
  if (first > 0) out += "... ";
  for (size_t i = first; i < last; ++i) out += pad(std::to_string(i), width) + " ";
  while (out.back() == ' ') out.pop_back();
  out += "\n";
  if (row_first > 0) out += "... ranks 0.." + std::to_string(row_first - 1) + " not shown\n";
  for (size_t r = row_first; r < row_last; ++r) {
    std::string row = pad(rank_head(r), 6);
    if (first > 0) row += "... ";
    for (size_t i = first; i < last; ++i) row += pad(cell(r, i), width) + " ";
    if (last < schedule.ranks[r].size()) row += "...";
    while (!row.empty() && row.back() == ' ') row.pop_back();
    out += row + "\n";
  }
  if (row_last < ranks)
    out +=
        "... ranks " + std::to_string(row_last) + ".." + std::to_string(ranks - 1) + " not shown\n";
  return out;
}

}  // namespace

std::string format_step_grid(const Schedule& schedule, int mark_rank, int mark_index,
                             int max_columns, int max_rows) {
  std::vector<GridMark> marks;
  if (mark_rank >= 0 && mark_index >= 0) marks.push_back({mark_rank, mark_index});
  return step_grid(schedule, marks, mark_rank, mark_index, max_columns, max_rows);
}

std::string format_step_grid(const Schedule& schedule, const std::vector<GridMark>& marks,
                             int max_columns, int max_rows) {
  if (marks.empty()) return step_grid(schedule, marks, -1, -1, max_columns, max_rows);
  return step_grid(schedule, marks, marks[0].rank, marks[0].index, max_columns, max_rows);
}

std::string format_timeline(const Schedule& schedule, const SimResult& sim, int max_columns,
                            int max_rows) {
  const size_t all_ranks = schedule.ranks.size();
  const size_t ranks =
      max_rows > 0 ? std::min(all_ranks, static_cast<size_t>(max_rows)) : all_ranks;
  double unit = 0;
  for (size_t r = 0; r < schedule.ranks.size(); ++r)
    for (size_t i = 0; i < schedule.ranks[r].size(); ++i) {
      const double d = sim.timing[r][i].end - sim.timing[r][i].start;
      if (is_compute(schedule.ranks[r][i].kind) && d > 0 && (unit == 0 || d < unit)) unit = d;
    }
  if (unit == 0 || sim.makespan <= 0) return "(empty timeline)\n";
  if (sim.makespan / unit > max_columns) unit = sim.makespan / max_columns;
  const int columns = static_cast<int>(std::ceil(sim.makespan / unit - 1e-9));
  std::vector<std::vector<std::string>> grid(ranks, std::vector<std::string>(columns, "."));
  size_t width = 1;
  for (size_t r = 0; r < ranks; ++r)
    for (size_t i = 0; i < schedule.ranks[r].size(); ++i) {
      const Action& a = schedule.ranks[r][i];
      if (!is_compute(a.kind)) continue;
      const auto& t = sim.timing[r][i];
      const int c0 =
          std::clamp(static_cast<int>(std::floor(t.start / unit + 1e-9)), 0, columns - 1);
      const int c1 = std::clamp(static_cast<int>(std::ceil(t.end / unit - 1e-9)), c0 + 1, columns);
      const std::string label = compute_label(schedule, a);
      width = std::max(width, label.size());
      grid[r][c0] = label;
      for (int c = c0 + 1; c < c1; ++c) grid[r][c].assign(1, '~');
    }
  // The gradient all-reduces run on a stream of their own: a row under each rank's.
  std::vector<std::vector<std::string>> reduce_grid;
  if (schedule.replicas > 1) {
    reduce_grid.assign(ranks, std::vector<std::string>(columns, " "));
    for (size_t r = 0; r < ranks; ++r)
      for (size_t i = 0; i < schedule.ranks[r].size(); ++i) {
        const Action& a = schedule.ranks[r][i];
        if (!is_reduce(a.kind)) continue;
        const auto& t = sim.timing[r][i];
        const int c0 =
            std::clamp(static_cast<int>(std::floor(t.start / unit + 1e-9)), 0, columns - 1);
        const int c1 =
            std::clamp(static_cast<int>(std::ceil(t.end / unit - 1e-9)), c0 + 1, columns);
        const std::string label = to_string(a);
        width = std::max(width, label.size());
        reduce_grid[r][c0] = label;
        for (int c = c0 + 1; c < c1; ++c) reduce_grid[r][c].assign(1, '=');
      }
  }
  std::string out;
  auto put_row = [&](const std::string& head, const std::vector<std::string>& cells) {
    out += pad(head, 6);
    for (const auto& c : cells) out += pad(c, width) + " ";
    while (!out.empty() && out.back() == ' ') out.pop_back();
    out += "\n";
  };
  for (size_t r = 0; r < grid.size(); ++r) {
    put_row(rank_head(r), grid[r]);
    if (!reduce_grid.empty()) put_row("  ar:", reduce_grid[r]);
  }
  if (ranks < all_ranks)
    out += "(ranks " + std::to_string(ranks) + ".." + std::to_string(all_ranks - 1) +
           " not drawn: the first " + std::to_string(ranks) + " of " + std::to_string(all_ranks) +
           ")\n";
  return out;
}

}  // namespace conveyor::schedule
