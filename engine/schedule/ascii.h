#pragma once
// Text pictures of a schedule: the rank x step grid (list positions) that validation errors
// show, and the rank x time timeline that `conveyor schedule` prints.
#include <cstdint>
#include <string>
#include <vector>

#include "engine/schedule/schedule.h"
#include "engine/schedule/simulator.h"

namespace conveyor::schedule {

// One row per rank, one column per list position, every action shown (transfers too).
// With a mark, the marked action is drawn as >>TOKEN<< and only the columns around it shown.
// At most max_rows ranks are drawn (0: all), those around the marked rank, so that an error
// in a schedule of a thousand ranks stays a screenful.
std::string format_step_grid(const Schedule& schedule, int mark_rank = -1, int mark_index = -1,
                             int max_columns = 16, int max_rows = 16);

// A list position to draw marked: action `index` of rank `rank`.
struct GridMark {
  int rank = 0;
  int index = 0;
};

// The grid with several actions marked (where each rank of a stalled run stands). The rows
// are centred on the first mark's rank; the columns show every mark when they fit in
// max_columns, else the columns around the first mark.
std::string format_step_grid(const Schedule& schedule, const std::vector<GridMark>& marks,
                             int max_columns = 16, int max_rows = 16);

// One row per rank, one column per time unit (the shortest compute action); compute actions
// only, labelled kind + micro-batch (kind + stage.mb with several chunks per rank) in the cell
// where they start, continuation cells '~', idle '.'. A picture wider than max_columns (at
// least 1) is scaled: one cell is a whole number of units, a first line says how many, and a
// cell where several actions start shows the first of them followed by '+', so that no action
// is drawn in a cell it does not start in. At most max_rows ranks are drawn (0: all), the
// first ones, and a last line says how many were left out.
std::string format_timeline(const Schedule& schedule, const SimResult& sim, int max_columns = 160,
                            int max_rows = 64);

// The columns format_timeline needs at one cell per unit (0 for an empty timeline).
int64_t timeline_columns_unscaled(const Schedule& schedule, const SimResult& sim);

// "F3" or "F5.3": a compute action's label in pictures.
std::string compute_label(const Schedule& schedule, const Action& action);

}  // namespace conveyor::schedule
