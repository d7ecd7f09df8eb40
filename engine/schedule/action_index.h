#pragma once
// Position of every action of a schedule in the list of the rank that owns it, by
// (kind, stage, micro-batch): a flat table, since the validator and the simulator look actions
// up by what they carry millions of times at scale. Only the kinds asked for are stored.
#include <array>
#include <cstddef>
#include <vector>

#include "engine/schedule/schedule.h"

namespace conveyor::schedule {

// stages x micro-batches, the cells of one (stage, micro-batch) table. Throws ScheduleError
// when that is beyond what such a table may hold (negative counts count as 0).
size_t table_cells(int stages, int microbatches);

class ActionIndex {
 public:
  // Kinds are numbered by ActionKind; `kinds[k]` says whether kind k gets a table.
  static constexpr int kKinds = 9;
  using KindSet = std::array<bool, kKinds>;
  static constexpr KindSet all_kinds() {
    return {true, true, true, true, true, true, true, true, true};
  }

  // Throws ScheduleError when stages x micro-batches is beyond what a table may hold.
  ActionIndex(int stages, int microbatches, KindSet kinds = all_kinds());

  // Records `index` for the action and returns the position recorded before (-1 if none).
  // Actions outside the tables (kind not stored, stage or micro-batch out of range) are ignored.
  int insert(const Action& a, int index) {
    int* slot = find(a.kind, a.stage, a.microbatch);
    if (!slot) return -1;
    const int before = *slot;
    *slot = index;
    return before;
  }
  // Every action of every rank of `s`.
  void insert_all(const Schedule& s);

  // Position, or -1 when absent (or out of range).
  int at(ActionKind kind, int stage, int mb) const {
    const int* slot = const_cast<ActionIndex*>(this)->find(kind, stage, mb);
    return slot ? *slot : -1;
  }

 private:
  int* find(ActionKind kind, int stage, int mb) {
    const int table = slot_of_kind_[static_cast<int>(kind)];
    if (table < 0 || stage < 0 || stage >= stages_ || mb < 0 || mb >= mbs_) return nullptr;
    return &index_[(static_cast<size_t>(table) * stages_ + stage) * mbs_ + mb];
  }
  int stages_, mbs_;
  std::array<int, kKinds> slot_of_kind_{};
  std::vector<int> index_;
};

}  // namespace conveyor::schedule
