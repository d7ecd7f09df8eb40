#pragma once
// Schedule generators. Each builds the compute order per rank, then insert_transfers() adds
// the sends and receives. Within a stage, every generator applies weight gradients (B or W)
// in ascending micro-batch order, so pipeline runs can match the one-stage run bit for bit.
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "engine/schedule/schedule.h"

namespace conveyor::schedule {

enum class ScheduleKind : uint8_t { kGPipe, k1F1B, kInterleaved, kZBH1, kZBV };

struct NamedScheduleKind {
  ScheduleKind kind;
  const char* name;
};
// Every kind with its name, in the order the docs list them: the one list that the name
// lookups below, the command line's parsers and its help texts all read.
std::span<const NamedScheduleKind> schedule_kinds();

const char* schedule_kind_name(ScheduleKind kind);  // "gpipe", "1f1b", "interleaved", "zbh1", "zbv"
std::optional<ScheduleKind> parse_schedule_kind(std::string_view name);
// "gpipe|1f1b|interleaved|zbh1|zbv"
std::string schedule_kind_choices();

// p pipeline ranks, m micro-batches, v chunks per rank (interleaved; zbv accepts 1 or 2 and
// always uses 2; the others need v=1).
// `replicas` > 1: data parallelism, m micro-batches per replica, with the gradient all-reduce
// of each stage after its last weight gradient (add_gradient_all_reduces, schedule.h).
// Throws ScheduleError when the schedule is not defined for these values, saying which
// values would work.
Schedule generate(ScheduleKind kind, int p, int m, int v = 1, int replicas = 1);
// Whether `kind` takes v chunks per rank: zbv 1 or 2 (it always runs 2), interleaved any,
// the others 1. The one rule, for callers that say a refusal in their own words.
bool takes_chunks(ScheduleKind kind, int64_t v);
// The chunks per rank that `kind` runs when given `v` (one that takes_chunks accepts): zbv
// always 2, its V, whatever v says; the others v. The one rule for callers that count a
// layout's stages, or compare chunk counts, before any schedule exists.
int chunks_per_rank(ScheduleKind kind, int v);
// The chunk count alone against the kind (takes_chunks), as generate() checks it first: lets
// a caller refuse it before any other work. Throws ScheduleError.
void check_chunks(ScheduleKind kind, int v);

// GPipe (fill-drain): all forwards, then all backwards in ascending micro-batch order.
Schedule generate_gpipe(int p, int m);
// 1F1B (PipeDream-flush): rank r runs min(p-1-r, m) warm-up forwards, then alternates one
// forward and one backward, then drains the remaining backwards.
Schedule generate_1f1b(int p, int m);
// Interleaved 1F1B (Megatron-LM, Narayanan et al. 2021): v chunks per rank, looped layout,
// stage c*p + r on rank r; needs m to be a multiple of p. v = 1 gives 1F1B.
Schedule generate_interleaved(int p, int m, int v);
// ZB-H1 (Qi et al. 2023): backward split into I and W; I as early as 1F1B's B, at most p-r
// micro-batches between F and I on rank r and at most p + ceil((p-r)/2) between F and W, W deferred
// to fill the bubbles. Order found by list scheduling under the given per-micro-batch costs (unit
// costs by default; generate() uses those), once with I before F and once with F before I; the
// shorter is kept, I first on a tie.
Schedule generate_zbh1(int p, int m, double f = 1, double i = 1, double w = 1);

// ZB-V (Qi et al. 2023, section 6): two chunks per rank in a V (rank r holds stages r and
// 2p-1-r), backward split into I and W; zero bubble after warm-up when F = I = W.
Schedule generate_zbv(int p, int m);

// Adds SEND/RECV actions to compute-only rank lists: each send right after the compute that
// produces the data; each receive right before the compute that consumes it, moved earlier
// where needed so that on every link the receives come in the order of the sends (FIFO).
void insert_transfers(Schedule* schedule);

}  // namespace conveyor::schedule
