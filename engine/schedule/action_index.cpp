#include "engine/schedule/action_index.h"

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

ActionIndex::ActionIndex(int stages, int microbatches, KindSet kinds)
    : stages_(stages), mbs_(microbatches) {
  const size_t cells = table_cells(stages, microbatches);
  int tables = 0;
  for (int k = 0; k < kKinds; ++k) slot_of_kind_[k] = kinds[k] ? tables++ : -1;
  index_.assign(static_cast<size_t>(tables) * cells, -1);
}

void ActionIndex::insert_all(const Schedule& s) {
  for (const auto& list : s.ranks)
    for (int i = 0; i < static_cast<int>(list.size()); ++i) insert(list[i], i);
}

}  // namespace conveyor::schedule
