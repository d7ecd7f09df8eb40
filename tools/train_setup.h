#pragma once
// What `conveyor train` checks and arranges before its first step: output files that would
// destroy an input or a checkpoint of the run are refused, every rank but rank 0 is silenced,
// and held-out batches must fit in --data.
#include <cstdint>

#include "engine/train/train_config.h"
#include "tools/mpi_launch.h"
#include "tools/train_flags.h"

namespace conveyor::cli {

// The output files are opened, and emptied, before any work: one that names an input of the
// run, the other output or a checkpoint would destroy it before the run reads it (a --data
// file read as empty, a `latest` emptied before --resume reads it).
void refuse_outputs_over_inputs(const TrainFlags& f);

// Rank 0 alone prints and writes files; the others stay quiet unless they fail (errors go
// to stderr, which stays open).
void quiet_unless_rank_zero(const MpiSession& mpi, TrainFlags& f);

// With --data, the held-out batches must follow the --steps training batches within the file
// of `file_bytes` bytes (make_held_out_source): past its end the source wraps and would
// evaluate on bytes the run trains on. The last pair's target is the byte after its input, so
// the file needs one byte more than the tokens. From the config and the file's length alone,
// so that it is refused before the model is built.
void check_eval_fits(const TrainConfig& config, int64_t eval_batches, uint64_t file_bytes);

}  // namespace conveyor::cli
