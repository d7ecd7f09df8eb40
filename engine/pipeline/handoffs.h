#pragma once
// Tensors handed between the actions of one executor rank, per kind and (stage, micro-batch):
// stage outputs and input gradients waiting to be sent or used locally, received ones waiting
// to be used. Keeps the bytes they hold (rounded as the allocator counts them), so the
// executor's per-action memory sample costs O(1).
#include <stdexcept>
#include <string>
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

  // Slots for `held`, the rank's own stages (of `num_stages`), only: every tensor handed
  // between its actions is keyed by one of them. Slots for every stage made each rank of a
  // deep pipeline keep 4 x stages x micro-batches of them, and the ranks together a cube of
  // the depth (1024 stages and micro-batches: hundreds of GB before the first step).
  Handoffs(const std::vector<int>& held, int num_stages, int microbatches)
      : m_(microbatches), local_(static_cast<size_t>(num_stages), -1) {
    int count = 0;
    for (const int s : held) {
      if (s < 0 || s >= num_stages)
        throw std::logic_error("stage " + std::to_string(s) + " is not one of the pipeline's " +
                               std::to_string(num_stages));
      if (local_[static_cast<size_t>(s)] < 0) local_[static_cast<size_t>(s)] = count++;
    }
    for (auto& slots : slots_) slots.resize(static_cast<size_t>(count) * microbatches);
  }
  void put(Kind kind, int stage, int mb, Tensor tensor, Event* ready = nullptr) {
    Handoff& h = slots_[kind][index(stage, mb)];
    if (h.tensor.defined())
      throw std::logic_error("a second tensor for stage " + std::to_string(stage) +
                             ", micro-batch " + std::to_string(mb));
    bytes_ += CachingAllocator::round_size(tensor.nbytes());
    h = {std::move(tensor), ready};
  }
  // The tensor, or throws naming the action that needed it.
  Handoff take(Kind kind, int stage, int mb, const schedule::Action& needed_by) {
    Handoff& h = slots_[kind][index(stage, mb)];
    if (!h.tensor.defined())
      throw std::logic_error("no input ready for " + schedule::to_string(needed_by));
    bytes_ -= CachingAllocator::round_size(h.tensor.nbytes());
    return std::exchange(h, Handoff{});
  }
  // Whether a tensor is waiting: the producer ran (or the receive completed) and no one has
  // taken it yet.
  bool has(Kind kind, int stage, int mb) const {
    return slots_[kind][index(stage, mb)].tensor.defined();
  }
  size_t bytes() const { return bytes_; }

 private:
  size_t index(int stage, int mb) const {
    const int local =
        stage >= 0 && static_cast<size_t>(stage) < local_.size() ? local_[stage] : -1;
    if (local < 0)
      throw std::logic_error("stage " + std::to_string(stage) + " is not one of this rank's");
    return static_cast<size_t>(local) * m_ + mb;
  }
  int m_;
  std::vector<int> local_;  // per stage of the pipeline: its slots' index here, or -1
  std::vector<Handoff> slots_[kKinds];
  size_t bytes_ = 0;
};

}  // namespace conveyor
