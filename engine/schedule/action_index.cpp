#include "engine/schedule/action_index.h"

#include <algorithm>
#include <string>

namespace conveyor::schedule {

size_t table_cells(int stages, int microbatches) {
  constexpr size_t kMaxCells = size_t{1} << 25;
  const size_t cells = static_cast<size_t>(stages < 0 ? 0 : stages) *
                       static_cast<size_t>(microbatches < 0 ? 0 : microbatches);
  if (cells > kMaxCells)
    throw ScheduleError("stages x micro-batches = " + std::to_string(cells) +
                        " is larger than supported (" + std::to_string(kMaxCells) + ")");
  return cells;
}

ActionIndex::ActionIndex(int rows, int microbatches) : rows_(rows), mbs_(microbatches) {
  index_.assign(kKinds * table_cells(rows, microbatches), -1);
}

void ActionIndex::clear() { std::fill(index_.begin(), index_.end(), -1); }

}  // namespace conveyor::schedule
