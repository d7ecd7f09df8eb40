// Minimal use of Conveyor as a library: train the tiny reference model on the synthetic
// Markov source and compare the loss with the best achievable one.
#include <cstdio>

#include "conveyor/engine/conveyor.h"

int main() {
  conveyor::TrainConfig config;
  config.model = conveyor::model_preset("tiny");
  config.steps = 60;
  config.batch_tokens = 2048;
  config.microbatches = 2;
  config.optimizer.lr = 3e-3;

  std::string note;
  config.device = conveyor::resolve_device(std::nullopt, &note);  // a GPU if one is usable
  if (!note.empty()) std::printf("%s\n", note.c_str());

  conveyor::Trainer trainer(config);
  double loss = 0.0;
  for (int64_t s = 0; s < config.steps; ++s) loss = trainer.step().loss;

  const double floor = *trainer.source().entropy();
  std::printf("%lld steps on %s: loss %.4f, source entropy %.4f\n",
              static_cast<long long>(config.steps), trainer.device().to_string().c_str(), loss,
              floor);
  // Exit status says whether training made real progress (the untrained loss is ln 64 = 4.16).
  return loss < 2.0 * floor ? 0 : 1;
}
