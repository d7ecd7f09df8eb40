#pragma once
// NCCL unique ids as a bootstrap hands them out (rank 0 makes them, every process gets the
// list): one per slot of a clique of `ranks` ranks with `groups` replica groups.
#include <nccl.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "comm/nccl.h"

namespace conveyor::testing {

inline std::vector<std::string> make_unique_ids(int ranks, int groups = 0) {
  std::vector<std::string> ids;
  for (int i = 0; i < comm::nccl_slot_count(ranks, groups); ++i) {
    ncclUniqueId id;
    if (ncclGetUniqueId(&id) != ncclSuccess) throw std::runtime_error("ncclGetUniqueId failed");
    ids.emplace_back(id.internal, sizeof id);
  }
  return ids;
}

}  // namespace conveyor::testing
