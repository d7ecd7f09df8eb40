#include "tools/held_out_evaluation.h"

#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <sstream>

#include "engine/train/train_config.h"
#include "tools/cli_common.h"

namespace conveyor::cli {

HeldOutData::HeldOutData(const Trainer& trainer)
    : source_(make_held_out_source(trainer.config(), trainer.model().vocab, trainer.source())),
      start_(source_->position()),
      start_token_(source_->current_token()) {}

TokenSource& HeldOutData::rewound() {
  source_->restore(start_, start_token_);
  return *source_;
}

double evaluate_held_out(Trainer& trainer, TokenSource& held_out, int64_t batches, bool announce,
                         bool under_mpi) {
  if (announce) {
    std::printf("eval   %lld held-out batch(es) of %lld tokens, with the weights of step %lld\n",
                static_cast<long long>(batches),
                static_cast<long long>(trainer.config().batch_tokens),
                static_cast<long long>(trainer.steps_done()));
    std::fflush(stdout);
  }
  double loss = 0.0;
  try {
    loss = trainer.evaluate(held_out, batches);
  } catch (const TrainingDiverged& e) {
    loss = e.loss();  // said below, in the command's terms, once a signal has been asked for
  }
  // A signal during the last group of batches (the only one, usually) ends the run here too:
  // unasked, it waited for the next step to end, or after the closing evaluation went unheard.
  if (const int signal = trainer.agreed_stop_request()) throw EvaluationStopped(signal);
  // The last step's own loss and gradient were finite, its update was not: the next step
  // would have said so, and the run would not go on, or end as a success, with a loss of nan.
  if (!std::isfinite(loss)) {
    std::ostringstream msg;
    msg << "the held-out loss is " << (std::isnan(loss) ? std::fabs(loss) : loss)
        << " with the weights of step " << trainer.steps_done()
        << ": its update diverged; lower the learning rate (--lr)";
    // Every process has the same loss, and so stops alike: rank 0 says it.
    if (under_mpi) throw ErrorOfEveryProcess(msg.str(), kExitFailure);
    throw TrainingDiverged(msg.str());
  }
  return loss;
}

std::string eval_record(double loss, int64_t after_step, int64_t batches, int64_t tokens) {
  char hex[40];
  std::snprintf(hex, sizeof hex, "%a", loss);
  const nlohmann::json row = {{"eval_loss", loss},
                              {"eval_loss_hex", hex},
                              {"eval_batches", batches},
                              {"eval_tokens", tokens},
                              {"eval_step", after_step}};
  return row.dump() + "\n";
}

}  // namespace conveyor::cli
