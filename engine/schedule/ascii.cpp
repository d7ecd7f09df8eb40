#include "engine/schedule/ascii.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>

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

namespace {

// The timeline's time unit: the shortest compute action (0 when there is none).
double shortest_compute(const Schedule& schedule, const SimResult& sim) {
  double unit = 0;
  for (size_t r = 0; r < schedule.ranks.size(); ++r)
    for (size_t i = 0; i < schedule.ranks[r].size(); ++i) {
      const double d = sim.timing[r][i].end - sim.timing[r][i].start;
      if (is_compute(schedule.ranks[r][i].kind) && d > 0 && (unit == 0 || d < unit)) unit = d;
    }
  return unit;
}

// Columns of `cell` time units that cover the makespan.
double columns_of(double makespan, double cell) { return std::ceil(makespan / cell - 1e-9); }

std::string number_text(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

}  // namespace

int64_t timeline_columns_unscaled(const Schedule& schedule, const SimResult& sim) {
  const double unit = shortest_compute(schedule, sim);
  if (unit == 0 || sim.makespan <= 0) return 0;
  const double columns = columns_of(sim.makespan, unit);
  return columns < 9e18 ? static_cast<int64_t>(columns) : std::numeric_limits<int64_t>::max();
}

std::string format_timeline(const Schedule& schedule, const SimResult& sim, int max_columns,
                            int max_rows) {
  const size_t all_ranks = schedule.ranks.size();
  const size_t ranks =
      max_rows > 0 ? std::min(all_ranks, static_cast<size_t>(max_rows)) : all_ranks;
  const double unit = shortest_compute(schedule, sim);
  if (unit == 0 || sim.makespan <= 0) return "(empty timeline)\n";
  // A whole number of units per cell, so that cells line up with the actions of a schedule
  // whose times are multiples of the unit.
  const double unscaled = columns_of(sim.makespan, unit);
  max_columns = std::max(max_columns, 1);
  const double scale = unscaled > max_columns ? std::ceil(unscaled / max_columns) : 1;
  double cell = unit * scale;
  // An action so short beside the makespan that the count of its lengths passes a double (a
  // subnormal cost beside ordinary ones): cells cannot be a whole number of it, so the
  // makespan is cut into max_columns equal ones.
  const bool whole_units = std::isfinite(cell) && cell > 0;
  if (!whole_units) cell = sim.makespan / max_columns;
  const int columns = static_cast<int>(
      std::clamp(columns_of(sim.makespan, cell), 1.0, static_cast<double>(max_columns)));
  // Rank r's row of compute actions, or of all-reduces (`reduce`): each cell shows the first
  // action that starts in it, followed by '+' when others start there too (their labels have
  // no room: only a scaled picture has such cells, or actions that take no time), `filler`
  // where an action that started earlier runs on, and `empty` where none runs.
  auto row_cells = [&](size_t r, bool reduce) {
    const char filler = reduce ? '=' : '~';
    std::vector<std::string> cells(columns, reduce ? " " : ".");
    std::vector<int> starts(columns, 0);
    std::vector<double> first_start(columns, 0);
    for (size_t i = 0; i < schedule.ranks[r].size(); ++i) {
      const Action& a = schedule.ranks[r][i];
      if (reduce ? !is_reduce(a.kind) : !is_compute(a.kind)) continue;
      const auto& t = sim.timing[r][i];
      const int c0 =
          std::clamp(static_cast<int>(std::floor(t.start / cell + 1e-9)), 0, columns - 1);
      const int c1 = std::clamp(static_cast<int>(std::ceil(t.end / cell - 1e-9)), c0 + 1, columns);
      if (starts[c0]++ == 0 || t.start < first_start[c0]) {
        cells[c0] = reduce ? to_string(a) : compute_label(schedule, a);
        first_start[c0] = t.start;
      }
      for (int c = c0 + 1; c < c1; ++c)
        if (starts[c] == 0) cells[c].assign(1, filler);
    }
    for (int c = 0; c < columns; ++c)
      if (starts[c] > 1) cells[c] += '+';
    return cells;
  };
  // The gradient all-reduces run on a stream of their own: a row under each rank's. The rows
  // are made twice, for the cell width and to print, so that a wide picture is never held
  // whole.
  const bool reduce_rows = schedule.replicas > 1;
  size_t width = 1;
  for (size_t r = 0; r < ranks; ++r)
    for (const bool reduce : {false, true})
      if (!reduce || reduce_rows)
        for (const std::string& c : row_cells(r, reduce)) width = std::max(width, c.size());
  std::string out;
  if (scale > 1)
    out += "(one cell = " + number_text(cell) + (cell == 1 ? " time unit, " : " time units, ") +
           (whole_units ? number_text(scale) + " x the shortest compute action"
                        : "the shortest compute action (" + number_text(unit) +
                              ") being too short to count cells in") +
           ", to fit " + std::to_string(max_columns) +
           " columns (unscaled: " + number_text(unscaled) +
           "); a cell shows the first action that starts in it, with + when others start there "
           "too)\n";
  auto put_row = [&](const std::string& head, const std::vector<std::string>& cells) {
    out += pad(head, 6);
    for (const auto& c : cells) out += pad(c, width) + " ";
    while (!out.empty() && out.back() == ' ') out.pop_back();
    out += "\n";
  };
  for (size_t r = 0; r < ranks; ++r) {
    put_row(rank_head(r), row_cells(r, false));
    if (reduce_rows) put_row("  ar:", row_cells(r, true));
  }
  if (ranks < all_ranks)
    out += "(ranks " + std::to_string(ranks) + ".." + std::to_string(all_ranks - 1) +
           " not drawn: the first " + std::to_string(ranks) + " of " + std::to_string(all_ranks) +
           ")\n";
  return out;
}

}  // namespace conveyor::schedule
