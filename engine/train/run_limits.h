#pragma once
// The largest layout counts a training run takes: the command line's flags and TrainConfig
// accept no more, and a checkpoint's manifest, which records them, is refused with more, so
// that a file edited (and re-sealed with fresh checksums) cannot pass a count no run wrote.
#include <cstdint>

namespace conveyor {

inline constexpr int64_t kMaxBatchTokens = int64_t{1} << 31;  // --batch-tokens
inline constexpr int64_t kMaxMicrobatches = 65536;            // --microbatches
inline constexpr int64_t kMaxStages = 1024;                   // --stages: pipeline ranks
inline constexpr int64_t kMaxChunks = 64;                     // --chunks: virtual stages per rank
inline constexpr int64_t kMaxReplicas = 1024;                 // --dp: data-parallel replicas

}  // namespace conveyor
