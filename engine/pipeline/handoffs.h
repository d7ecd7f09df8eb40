#pragma once
// Tensors handed between the actions of one executor rank, per kind and (stage, micro-batch):
// stage outputs and input gradients waiting to be sent or used locally, received ones waiting
// to be used. Keeps the bytes they hold (rounded as the allocator counts them), so the
// executor's per-action memory sample costs O(1).
#include <cstdint>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "engine/core/allocator.h"
#include "engine/core/stream.h"
#include "engine/core/tensor.h"
#include "engine/schedule/schedule.h"

namespace conveyor {

// A tensor and the event after which it is ready on the stream that produced it (on CUDA:
// received tensors, and outputs that a send will take; null otherwise).
struct Handoff {
  Tensor tensor;
  Event* ready = nullptr;
};

class Handoffs {
 public:
  enum Kind { kOutAct, kOutGrad, kInAct, kInGrad, kKinds };

  // Tensors for `held`, the rank's own stages (of `num_stages`), only: every tensor handed
  // between its actions is keyed by one of them and a micro-batch, and only those waiting
  // are kept. A slot for every (stage, micro-batch) made each rank keep stages x micro-batches
  // of them (1024 stages and micro-batches: hundreds of GB before the first step), and one
  // for every micro-batch of its own stages still micro-batches x ranks (16384 x 1024: GBs).
  Handoffs(const std::vector<int>& held, int num_stages, int microbatches)
      : m_(microbatches), local_(static_cast<size_t>(num_stages), -1) {
    int count = 0;
    for (const int s : held) {
      if (s < 0 || s >= num_stages)
        throw std::logic_error("stage " + std::to_string(s) + " is not one of the pipeline's " +
                               std::to_string(num_stages));
      if (local_[static_cast<size_t>(s)] < 0) local_[static_cast<size_t>(s)] = count++;
    }
  }
  void put(Kind kind, int stage, int mb, Tensor tensor, Event* ready = nullptr) {
    const auto [at, added] = waiting_[kind].try_emplace(key(stage, mb));
    if (!added)
      throw std::logic_error("a second tensor for stage " + std::to_string(stage) +
                             ", micro-batch " + std::to_string(mb));
    bytes_ += CachingAllocator::round_size(tensor.nbytes());
    at->second = {std::move(tensor), ready};
  }
  // The tensor, or throws naming the action that needed it.
  Handoff take(Kind kind, int stage, int mb, const schedule::Action& needed_by) {
    const auto found = waiting_[kind].find(key(stage, mb));
    if (found == waiting_[kind].end())
      throw std::logic_error("no input ready for " + schedule::to_string(needed_by));
    Handoff h = std::move(found->second);
    waiting_[kind].erase(found);
    bytes_ -= CachingAllocator::round_size(h.tensor.nbytes());
    return h;
  }
  // Whether a tensor is waiting: the producer ran (or the receive completed) and no one has
  // taken it yet.
  bool has(Kind kind, int stage, int mb) const { return waiting_[kind].count(key(stage, mb)) > 0; }
  size_t bytes() const { return bytes_; }

 private:
  uint64_t key(int stage, int mb) const {
    const int local = stage >= 0 && static_cast<size_t>(stage) < local_.size() ? local_[stage] : -1;
    if (local < 0)
      throw std::logic_error("stage " + std::to_string(stage) + " is not one of this rank's");
    return static_cast<uint64_t>(local) * static_cast<uint64_t>(m_) + static_cast<uint64_t>(mb);
  }
  int m_;
  std::vector<int> local_;  // per stage of the pipeline: its index among the held, or -1
  std::unordered_map<uint64_t, Handoff> waiting_[kKinds];
  size_t bytes_ = 0;
};

}  // namespace conveyor
