#pragma once
// Text and CSV forms of a schedule, so a user can write or edit one by hand and run it.
//
// Text: a header comment, then one line per rank:
//   # conveyor schedule: name=1f1b ranks=2 chunks=1 layout=looped microbatches=2
//   r0: F0.0 SA0.0>1 F0.1 SA0.1>1 RG0.0<1 B0.0 RG0.1<1 B0.1
//   r1: RA1.0<0 F1.0 B1.0 SG1.0>0 RA1.1<0 F1.1 B1.1 SG1.1>0
// CSV: the same header comment, then `rank,step,kind,stage,microbatch,peer` rows with kind
// one of F, B, I, W, SEND_ACT, RECV_ACT, SEND_GRAD, RECV_GRAD, ALLREDUCE_GRAD and peer empty
// for compute (micro-batch and peer empty for ALLREDUCE_GRAD).
// A data-parallel schedule's header adds `replicas=D` and its lists hold AR<stage> tokens.
// Without a header, ranks = number of rank lines, stages = largest stage + 1,
// micro-batches = largest micro-batch + 1, layout looped, replicas 1.
#include <string>
#include <string_view>

#include "engine/schedule/schedule.h"

namespace conveyor::schedule {

// The version of the text and CSV forms above; raised when a file would be read differently,
// so that processes of one run built before and after such a change refuse to run together.
inline constexpr int kScheduleTextFormatVersion = 1;

std::string dump_text(const Schedule& schedule);
std::string dump_csv(const Schedule& schedule);
// Both throw ScheduleError naming the line and what was expected.
Schedule parse_text(std::string_view text);
Schedule parse_csv(std::string_view text);
// Picks CSV when the first non-comment line starts with "rank,", or holds commas and is no
// text line ("r<rank>: ..."), text otherwise.
Schedule parse_schedule(std::string_view text);

// Files: CSV when the path ends in ".csv", text otherwise. Throw ScheduleError on I/O errors
// (every write and the close are checked). Loading takes regular files of at most
// kMaxScheduleFileBytes only, so a device or a huge file is refused before it is read; the
// limit holds every file `conveyor schedule --dump` writes (tools/schedule_command.cpp).
inline constexpr unsigned long long kMaxScheduleFileBytes = 512ULL << 20;
void save_schedule(const std::string& path, const Schedule& schedule);
Schedule load_schedule(const std::string& path);

}  // namespace conveyor::schedule
