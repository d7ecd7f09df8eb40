#pragma once
// SVG timeline of a simulated schedule: ranks as rows, time to the right, compute actions as
// boxes coloured by kind (F, B, I, W) and labelled by micro-batch; idle time is the bare row.
#include <cstddef>
#include <string>

#include "engine/schedule/schedule.h"
#include "engine/schedule/simulator.h"

namespace conveyor::schedule {

struct SvgOptions {
  std::string title;       // drawn above the rows; empty = none
  double width_px = 960;   // width of the time axis when px_per_unit is 0
  double px_per_unit = 0;  // fixed scale (same scale for pictures that are compared)
  double row_height_px = 30;
  // Caps on what is drawn, so the file stays small enough to open (about 250 bytes a box);
  // a note under the legend says when a picture was cut.
  int max_ranks = 256;
  size_t max_boxes = 20000;
};

std::string render_svg(const Schedule& schedule, const SimResult& sim,
                       const SvgOptions& options = {});

}  // namespace conveyor::schedule
