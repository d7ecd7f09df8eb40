#pragma once
// Position of every action of a schedule in the list of the rank that owns it, by
// (kind, stage, micro-batch): a flat table, since the validator looks actions up by what they
// carry millions of times at scale. It holds the kinds with one action per (stage,
// micro-batch) — computes and transfers, not the all-reduce — and the positions of one
// (stage, micro-batch) cell lie together, since the validator asks about a cell's actions
// together.
#include <cstddef>
#include <vector>

#include "engine/schedule/schedule.h"

namespace conveyor::schedule {

// stages x micro-batches, the cells of one (stage, micro-batch) table. Throws ScheduleError
// when that is beyond what such a table may hold (negative counts count as 0).
size_t table_cells(int stages, int microbatches);

class ActionIndex {
 public:
  // Positions per cell, by ActionKind: F, B, I, W, SEND_ACT, RECV_ACT, SEND_GRAD, RECV_GRAD.
  static constexpr int kKinds = static_cast<int>(ActionKind::kRecvGrad) + 1;

  // Throws ScheduleError when stages x micro-batches is beyond what a table may hold.
  ActionIndex(int stages, int microbatches);

  // Records `index` for the action and returns the position recorded before (-1 if none).
  // Actions outside the table (an all-reduce, stage or micro-batch out of range) are ignored.
  int insert(const Action& a, int index) {
    if (!holds(a.kind, a.stage, a.microbatch)) return -1;
    int& slot = cell(a.stage, a.microbatch)[static_cast<int>(a.kind)];
    const int before = slot;
    slot = index;
    return before;
  }

  // Position, or -1 when absent (or outside the table).
  int at(ActionKind kind, int stage, int mb) const {
    return holds(kind, stage, mb) ? cell(stage, mb)[static_cast<int>(kind)] : -1;
  }

  // The positions of the actions of (stage, mb), indexed by kind (-1: absent); `stage` and
  // `mb` must be in range. The cell of (stage + 1, mb) is row() entries further on.
  int* cell(int stage, int mb) {
    return &index_[(static_cast<size_t>(stage) * mbs_ + mb) * kKinds];
  }
  const int* cell(int stage, int mb) const {
    return &index_[(static_cast<size_t>(stage) * mbs_ + mb) * kKinds];
  }
  size_t row() const { return static_cast<size_t>(mbs_) * kKinds; }

 private:
  bool holds(ActionKind kind, int stage, int mb) const {
    return static_cast<int>(kind) < kKinds && stage >= 0 && stage < stages_ && mb >= 0 && mb < mbs_;
  }
  int stages_, mbs_;
  std::vector<int> index_;
};

}  // namespace conveyor::schedule
