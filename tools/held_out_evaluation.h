#pragma once
// `conveyor train --eval-batches`: the run's held-out batches, the mean loss on them with the
// weights trained so far, and the --log-json record of that loss.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "engine/train/data.h"
#include "engine/train/trainer.h"

namespace conveyor::cli {

// The run's held-out batches (make_held_out_source), the same at every evaluation, so that
// their losses compare, within a run and across the runs that resume it. With --data, the
// bytes the run read, whatever the file holds since.
class HeldOutData {
 public:
  explicit HeldOutData(const Trainer& trainer);

  TokenSource& rewound();

 private:
  std::unique_ptr<TokenSource> source_;
  uint64_t start_;
  std::optional<int32_t> start_token_;
};

// The mean loss on the run's held-out batches (`held_out`, rewound) with the weights trained
// so far. A collective under MPI (`under_mpi`), whose every process gets the same loss.
// `announce`: say it starts, as a long evaluation runs without a line of its own until it ends.
double evaluate_held_out(Trainer& trainer, TokenSource& held_out, int64_t batches, bool announce,
                         bool under_mpi);

// The --log-json record of one evaluation. It has no "step" field, so that a reader of the
// steps' records can skip it by that.
std::string eval_record(double loss, int64_t after_step, int64_t batches, int64_t tokens);

}  // namespace conveyor::cli
