#pragma once
// Position of actions in a rank's list by (kind, row, micro-batch), where a row is a stage, or
// a chunk when the table holds one rank's stages: a flat table, since the validator looks
// actions up by what they carry millions of times at scale. It holds the kinds with one action
// per (stage, micro-batch) — computes and transfers, not the all-reduce — and the positions of
// one (row, micro-batch) cell lie together, since the validator asks about a cell's actions
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

  // Every position absent. Throws ScheduleError when rows x micro-batches is beyond what a
  // table may hold.
  ActionIndex(int rows, int microbatches);

  // Makes every position absent again.
  void clear();

  // Records `index` for an action of `kind` in (row, mb) and returns the position recorded
  // before (-1 if none). Kinds and cells outside the table (an all-reduce, a row or micro-batch
  // out of range) are ignored.
  int insert(ActionKind kind, int row, int mb, int index) {
    if (!holds(kind, row, mb)) return -1;
    int& slot = cell(row, mb)[static_cast<int>(kind)];
    const int before = slot;
    slot = index;
    return before;
  }

  // Position, or -1 when absent (or outside the table).
  int at(ActionKind kind, int row, int mb) const {
    return holds(kind, row, mb) ? cell(row, mb)[static_cast<int>(kind)] : -1;
  }

  // The positions of the actions of (row, mb), indexed by kind (-1: absent); `row` and `mb`
  // must be in range. The cell of (row + 1, mb) is row_size() entries further on.
  int* cell(int row, int mb) { return &index_[(static_cast<size_t>(row) * mbs_ + mb) * kKinds]; }
  const int* cell(int row, int mb) const {
    return &index_[(static_cast<size_t>(row) * mbs_ + mb) * kKinds];
  }
  size_t row_size() const { return static_cast<size_t>(mbs_) * kKinds; }

 private:
  bool holds(ActionKind kind, int row, int mb) const {
    return static_cast<int>(kind) < kKinds && row >= 0 && row < rows_ && mb >= 0 && mb < mbs_;
  }
  int rows_, mbs_;
  std::vector<int> index_;
};

}  // namespace conveyor::schedule
