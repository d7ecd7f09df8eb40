#pragma once
// Where each rank stands in its step: written by the rank as it runs (plain stores, nothing
// read on the hot path) and read only after a failed step, to show a stalled run's positions.
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "engine/schedule/schedule.h"

namespace conveyor {

struct RankProgress {
  enum class Phase {
    kNotStarted,
    kRunning,            // action `action` is running (a compute, a send, a receive polled)
    kWaitingForReceive,  // blocked in the receive of action `action`
    kWaitingForSum,      // blocked in the gradient sum over replicas of action `action`
    kEndOfStep,          // every action done: the step's transfers, all-reduce and update
    kDone,
  };
  Phase phase = Phase::kNotStarted;
  size_t action = 0;
  // The heads of the rank's streams: list positions of their next actions (the list's size
  // once a stream is done).
  size_t compute = 0, send = 0, recv = 0, reduce = 0;
};

// A rank whose position is known to this process.
struct RankPosition {
  int index = 0;          // among all P*D ranks
  int pipeline_rank = 0;  // its row of the schedule
  int replica = 0;
  std::vector<int> replica_group;  // the ranks its gradient sums wait for
  RankProgress progress;
};

// A position as bytes, for the process that reports a failure of ranks held by several
// processes (comm::Transport::collect_failure_reports), and back. decode_position returns
// nothing for bytes that are not a position of a rank of `schedule` with `world` ranks.
std::vector<std::byte> encode_position(const RankPosition& position);
std::optional<RankPosition> decode_position(const std::vector<std::byte>& bytes,
                                            const schedule::Schedule& schedule, int world);

// The rank x list-position grid of `focus`'s replica with each known rank's position marked,
// bounded to a screenful, then one line per known rank saying where it is and what it waits
// on. `world` is the number of ranks of the run; ranks not in `known` (held by other
// processes) are named as unknown.
std::string format_positions(const schedule::Schedule& schedule,
                             const std::vector<RankPosition>& known, int focus, int world);

}  // namespace conveyor
