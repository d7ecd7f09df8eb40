#pragma once
// A trainer config small enough for many runs per test: the tiny preset cut to d=32, two
// blocks, a 16-token vocabulary, 4 steps of 256 tokens in 4 micro-batches, on the CPU.
#include "engine/train/trainer.h"

namespace conveyor::testing {

inline TrainConfig small_train_config(int stages, int replicas, bool shard_optimizer = false) {
  TrainConfig c;
  c.model = model_preset("tiny");
  c.model.d_model = 32;
  c.model.hidden = 64;
  c.model.vocab = 16;
  c.model.n_layers = 2;
  c.steps = 4;
  c.batch_tokens = 256;
  c.microbatches = 4;
  c.optimizer.lr = 1e-2;
  c.seed = 7;
  c.stages = stages;
  c.data_parallel = replicas;
  c.shard_optimizer = shard_optimizer;
  c.device = Device::cpu();
  return c;
}

}  // namespace conveyor::testing
