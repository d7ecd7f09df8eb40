#include "engine/trainer.h"

#include <cmath>
#include <sstream>
#include <vector>

#include "layers/ops.h"

namespace conveyor {

void TrainConfig::validate() const {
  model.validate();
  optimizer.validate();
  auto fail = [](const std::string& what) { throw std::invalid_argument(what); };
  if (steps < 1) fail("steps must be at least 1, got " + std::to_string(steps));
  if (batch_tokens < 1) fail("batch tokens must be at least 1, got " + std::to_string(batch_tokens));
  if (microbatches < 1)
    fail("micro-batches must be at least 1, got " + std::to_string(microbatches));
  if (batch_tokens % microbatches != 0)
    fail("batch of " + std::to_string(batch_tokens) + " tokens cannot be split into " +
         std::to_string(microbatches) + " equal micro-batches; choose a divisor of the batch");
}

Device resolve_device(const std::string& spec, std::string* note) {
  if (spec != "auto") {
    const Device device = parse_device(spec);
    if (device.is_cuda() && device.index >= cuda_device_count())
      throw std::invalid_argument("device " + device.to_string() + " requested but " +
                                  std::to_string(cuda_device_count()) +
                                  " CUDA device(s) are usable");
    return device;
  }
  if (cuda_device_count() > 0) return Device::cuda(0);
  if (note && built_with_cuda()) *note = "no CUDA device found; running on the CPU backend";
  return Device::cpu();
}

std::unique_ptr<TokenSource> make_token_source(const TrainConfig& config) {
  if (!config.data_path.empty()) {
    auto source = std::make_unique<FileSource>(config.data_path);
    if (config.model.vocab < source->vocab())
      throw std::invalid_argument("data file tokens are bytes (vocab 256) but the model vocab is " +
                                  std::to_string(config.model.vocab) + "; use --vocab 256 or more");
    return source;
  }
  return std::make_unique<MarkovSource>(config.model.vocab, config.seed);
}

Trainer::Trainer(TrainConfig config, Device device) : config_(std::move(config)) {
  config_.validate();
  DeviceContextOptions options;
  options.memory_limit_bytes = config_.memory_limit_bytes;
  options.allow_tf32 = config_.allow_tf32;
  ctx_ = std::make_unique<DeviceContext>(device, options);
  source_ = make_token_source(config_);
  stage_ = std::make_unique<Stage>(config_.model, 0, config_.model.num_units(), *ctx_,
                                   config_.seed);
  optimizer_ = std::make_unique<Optimizer>(*ctx_, stage_->parameters(), config_.optimizer);
}

StepStats Trainer::step() {
  const auto start = std::chrono::steady_clock::now();
  const int64_t step = steps_done_ + 1;
  ctx_->allocator().reset_peak();
  zero_grads(*ctx_, stage_->parameters());

  const int64_t n = config_.batch_tokens / config_.microbatches;
  std::vector<int32_t> inputs(n), targets(n);
  std::vector<Tensor> losses;
  for (int64_t mb = 0; mb < config_.microbatches; ++mb) {
    source_->next(inputs.data(), targets.data(), n);
    Tensor tokens = ctx_->empty({n}, DType::I32);
    MicroBatchInputs in;
    in.targets = ctx_->empty({n}, DType::I32);
    copy_from_host(tokens, inputs.data(), n * sizeof(int32_t));
    copy_from_host(in.targets, targets.data(), n * sizeof(int32_t));
    in.loss_scale = 1.0f / static_cast<float>(config_.batch_tokens);
    losses.push_back(stage_->forward(mb, tokens, in));
    stage_->backward(mb, Tensor());
  }
  double loss_sum = 0.0;
  for (const Tensor& l : losses) loss_sum += ops::sum(*ctx_, l);
  const double loss = loss_sum / static_cast<double>(config_.batch_tokens);
  if (!std::isfinite(loss)) {
    std::ostringstream msg;
    msg << "loss became " << loss << " at step " << step
        << "; lower the learning rate (--lr) or enable clipping (--clip)";
    throw TrainingDiverged(msg.str());
  }
  const double norm = std::sqrt(optimizer_->grad_squared_norm());
  if (!std::isfinite(norm))
    throw TrainingDiverged("gradient norm became " + std::to_string(norm) + " at step " +
                           std::to_string(step));
  const double lr = learning_rate(config_.optimizer, step, config_.steps);
  optimizer_->step(step, lr, clip_scale(config_.optimizer, norm));
  ctx_->synchronize();
  steps_done_ = step;

  StepStats stats;
  stats.step = step;
  stats.loss = loss;
  stats.tokens = config_.batch_tokens;
  stats.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  stats.lr = lr;
  stats.grad_norm = norm;
  stats.peak_bytes = ctx_->allocator().stats().peak_allocated_bytes;
  return stats;
}

}  // namespace conveyor
