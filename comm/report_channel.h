#pragma once
// A transport whose tensors go over one transport and whose failure reports go over another.
// GPU ranks that are MPI processes move tensors over NCCL, which has no way to hand a rank's
// position to rank 0 once a step has failed; MPI has, so those reports go over an MPI
// transport beside it. Every call but collect_failure_reports goes to the data transport;
// abort() goes to both, so every other process's report transport knows the reason too, and
// the data transport's waits ask the report transport for such a notice (check_while_waiting),
// so another process's failure ends them at once rather than at their deadline.
#include <memory>

#include "comm/transport.h"

namespace conveyor::comm {

// `data` and `reports` must be endpoints of the same rank among the same number of ranks
// (std::invalid_argument otherwise); the result is that rank's endpoint.
std::unique_ptr<Transport> with_reports_over(std::unique_ptr<Transport> data,
                                             std::unique_ptr<Transport> reports);

}  // namespace conveyor::comm
