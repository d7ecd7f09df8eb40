// Minimal use of Conveyor as a library: train the tiny reference model on the synthetic
// Markov source, or on the bytes of the file given as the argument, and compare the loss with
// the best achievable one.
#include <cstdio>
#include <cstring>
#include <memory>
#include <stdexcept>

#include "conveyor/engine/conveyor.h"

int main(int argc, char** argv) {
  const char* const usage = "usage: minimal_train [DATA_FILE] (its bytes are the tokens)\n";
  if (argc == 2 && (std::strcmp(argv[1], "-h") == 0 || std::strcmp(argv[1], "--help") == 0)) {
    std::fputs(usage, stdout);
    return 0;
  }
  // A second argument would be left unread: the user meant something the example does not do.
  if (argc > 2) {
    std::fprintf(stderr, "minimal_train: takes at most one data file, got %d arguments; %s",
                 argc - 1, usage);
    return 2;
  }
  conveyor::TrainConfig config;
  config.model = conveyor::model_preset("tiny");
  if (argc > 1) {
    config.data_path = argv[1];
    config.model.vocab = 256;  // byte-level tokens
  }
  config.steps = 60;
  config.batch_tokens = 2048;
  config.microbatches = 2;
  config.optimizer.lr = 3e-3;

  std::string note;
  config.device = conveyor::resolve_device(std::nullopt, &note);  // a GPU if one is usable
  if (!note.empty()) std::printf("%s\n", note.c_str());

  std::unique_ptr<conveyor::Trainer> made;
  try {
    made = std::make_unique<conveyor::Trainer>(config);
  } catch (const std::invalid_argument& e) {
    // A data file that cannot be used (InputFileError) or is shorter than a step's batch.
    std::fprintf(stderr, "minimal_train: %s\n", e.what());
    return 2;
  }
  conveyor::Trainer& trainer = *made;
  double loss = 0.0;
  for (int64_t s = 0; s < config.steps; ++s) loss = trainer.step().loss;
  // A file's bytes have no known entropy; the Markov source's is the best loss there is.
  if (!trainer.source().entropy()) {
    std::printf("%lld steps on %s: loss %.4f\n", static_cast<long long>(config.steps),
                trainer.device().to_string().c_str(), loss);
    return 0;
  }
  const double floor = *trainer.source().entropy();
  std::printf("%lld steps on %s: loss %.4f, source entropy %.4f\n",
              static_cast<long long>(config.steps), trainer.device().to_string().c_str(), loss,
              floor);
  // Exit status says whether training made real progress (the untrained loss is ln 64 = 4.16).
  return loss < 2.0 * floor ? 0 : 1;
}
