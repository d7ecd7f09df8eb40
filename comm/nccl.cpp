#include "comm/nccl.h"

#include <set>
#include <stdexcept>
#include <string>

#include "engine/core/device.h"

#ifdef CONVEYOR_WITH_CUDA
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <functional>
#include <mutex>
#include <optional>

#include "comm/nccl_check.h"
#include "comm/nccl_clique.h"
#include "comm/nccl_staging.h"
#include "engine/core/cuda_device_guard.h"
#include "kernels/cuda_check.h"
#endif

namespace conveyor::comm {

#ifndef CONVEYOR_WITH_CUDA

bool nccl_available() { return false; }

#else

bool nccl_available() {
  int version = 0;
  return cuda_device_count() > 0 && ncclGetVersion(&version) == ncclSuccess;
}

void throw_nccl_error(ncclResult_t result, const char* call, const char* file, int line) {
  std::string message = std::string("NCCL error: ") + call + " failed at " + file + ":" +
                        std::to_string(line) + ": " + ncclGetErrorString(result);
  const char* last = ncclGetLastError(nullptr);
  if (last && *last) message += " (" + std::string(last) + ")";
  throw TransportError(message);
}

namespace detail {

ncclDataType_t nccl_type(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return ncclFloat;
    case DType::kI32:
      return ncclInt32;
    default:
      return ncclChar;
  }
}

size_t nccl_count(const Tensor& t) {
  return nccl_type(t.dtype()) == ncclChar ? t.nbytes() : static_cast<size_t>(t.numel());
}

}  // namespace detail

using conveyor::detail::CudaDeviceGuard;
using detail::cuda_stream;
using detail::make_current_if_possible;
using detail::nccl_count;
using detail::nccl_type;
using detail::NcclClique;
using detail::NcclComm;
using detail::with_comm;

NcclTransport::NcclTransport(std::shared_ptr<NcclClique> clique, int rank)
    : clique_(std::move(clique)), rank_(rank), device_(clique_->device(rank)) {
  reduce_stream_ = std::make_unique<Stream>(Device::cuda(device_));
  group_stream_ = std::make_unique<Stream>(Device::cuda(device_));
  staging_ = std::make_unique<detail::NcclStaging>();
}

NcclTransport::~NcclTransport() {
  std::optional<CudaDeviceGuard> guard;
  make_current_if_possible(guard, device_);
  // Freeing waits for the device: first make sure no all-reduce kernel can still be waiting
  // for a peer (only after an error: every successful call waited for its stream). A stream
  // that cannot even be asked is treated as busy.
  auto done = [](const Stream& stream) {
    try {
      return stream.query();
    } catch (...) {
      return false;
    }
  };
  if (!done(*reduce_stream_))
    clique_->abort_all("rank " + std::to_string(rank_) +
                       ": transport destroyed during an all-reduce");
  if (!done(*group_stream_))
    clique_->abort_all("rank " + std::to_string(rank_) +
                       ": transport destroyed during a group call");
  if (reduce_device_) retired_reduce_device_.push_back(reduce_device_);
  if (reduce_host_) retired_reduce_host_.push_back(reduce_host_);
  for (double* d : retired_reduce_device_) (void)cudaFree(d);
  for (double* h : retired_reduce_host_) (void)cudaFreeHost(h);
  reduce_stream_.reset();
  // After an abort the aborted kernels end; the stream is waited for so that no copy still
  // reads the buffers when they go.
  try {
    group_stream_->synchronize();
  } catch (...) {
  }
  staging_->release();
  group_stream_.reset();
}

int NcclTransport::size() const { return clique_->size(); }

void NcclTransport::throw_if_aborted() const {
  if (clique_->aborted()) throw TransportAborted(rank_, clique_->abort_reason());
}

void NcclTransport::check_tensor(const Tensor& tensor, const char* what) const {
  if (!tensor.defined() || !tensor.device().is_cuda() || tensor.device().index != device_)
    throw TransportError(
        "rank " + std::to_string(rank_) + ": cannot " + what + " " +
        (tensor.defined() ? tensor.describe() : std::string("an undefined tensor")) +
        ": the NCCL transport of this rank needs tensors on cuda:" + std::to_string(device_));
}

void NcclTransport::send(const Tensor& tensor, int peer, const Stream& stream) {
  throw_if_aborted();
  check_peer(peer, "send to");
  check_tensor(tensor, "send");
  auto s = cuda_stream(stream);
  NcclComm& link = clique_->link_sender(rank_, peer);
  with_comm(link, rank_, *clique_, [&](ncclComm_t comm) {
    CONVEYOR_NCCL_START(ncclSend(tensor.raw(), nccl_count(tensor), nccl_type(tensor.dtype()),
                                 /*peer=*/1, comm, s));
    clique_->settle(rank_, link, [&] {
      return "sending " + tensor.describe() + " to rank " + std::to_string(peer) + " over NCCL";
    });
  });
  record_stream(tensor, stream.native());
}

void NcclTransport::recv(const Tensor& tensor, int peer, const Stream& stream) {
  throw_if_aborted();
  check_peer(peer, "receive from");
  check_tensor(tensor, "receive into");
  auto s = cuda_stream(stream);
  NcclComm& link = clique_->link_receiver(peer, rank_);
  with_comm(link, rank_, *clique_, [&](ncclComm_t comm) {
    CONVEYOR_NCCL_START(ncclRecv(tensor.raw(), nccl_count(tensor), nccl_type(tensor.dtype()),
                                 /*peer=*/0, comm, s));
    clique_->settle(rank_, link, [&] {
      return "receiving " + tensor.describe() + " from rank " + std::to_string(peer) + " over NCCL";
    });
  });
  record_stream(tensor, stream.native());
}

bool NcclTransport::try_recv(const Tensor& tensor, int peer, const Stream& stream) {
  recv(tensor, peer, stream);
  return true;
}

void NcclTransport::send_recv_self(const Tensor& src, const Tensor& dst, const Stream& stream) {
  throw_if_aborted();
  check_tensor(src, "send");
  check_tensor(dst, "receive into");
  if (src.nbytes() != dst.nbytes())
    throw TransportError("rank " + std::to_string(rank_) + ": send to self of " + src.describe() +
                         " into " + dst.describe() + ": the byte counts differ");
  auto s = cuda_stream(stream);
  NcclComm& world = clique_->world(rank_);
  with_comm(world, rank_, *clique_, [&](ncclComm_t comm) {
    detail::NcclGroup group;
    CONVEYOR_NCCL_START(ncclSend(src.raw(), src.nbytes(), ncclChar, rank_, comm, s));
    CONVEYOR_NCCL_START(ncclRecv(dst.raw(), dst.nbytes(), ncclChar, rank_, comm, s));
    group.end();
    clique_->settle(rank_, world, [] { return std::string("a send to itself over NCCL"); });
  });
  record_stream(src, stream.native());
  record_stream(dst, stream.native());
}

void NcclTransport::all_reduce_sum(std::vector<double>& values) {
  throw_if_aborted();
  if (values.empty()) return;
  CudaDeviceGuard guard(device_);
  const size_t n = values.size();
  auto stream = cuda_stream(*reduce_stream_);
  if (n > reduce_capacity_) {
    // Doubling bounds the retired buffers by the live ones; the retired are freed with the
    // transport (see retired_reduce_device_).
    const size_t capacity = std::max(n, 2 * reduce_capacity_);
    double* grown_device = nullptr;
    double* grown_host = nullptr;
    CONVEYOR_CUDA_CHECK(cudaMalloc(&grown_device, capacity * sizeof(double)));
    const cudaError_t host_status = cudaMallocHost(&grown_host, capacity * sizeof(double));
    if (host_status != cudaSuccess) {
      retired_reduce_device_.push_back(grown_device);
      CONVEYOR_CUDA_CHECK(host_status);
    }
    if (reduce_device_) retired_reduce_device_.push_back(reduce_device_);
    if (reduce_host_) retired_reduce_host_.push_back(reduce_host_);
    reduce_device_ = grown_device;
    reduce_host_ = grown_host;
    reduce_capacity_ = capacity;
  }
  std::memcpy(reduce_host_, values.data(), n * sizeof(double));
  NcclComm& world = clique_->world(rank_);
  with_comm(world, rank_, *clique_, [&](ncclComm_t comm) {
    CONVEYOR_CUDA_CHECK(cudaMemcpyAsync(reduce_device_, reduce_host_, n * sizeof(double),
                                        cudaMemcpyHostToDevice, stream));
    CONVEYOR_NCCL_START(
        ncclAllReduce(reduce_device_, reduce_device_, n, ncclFloat64, ncclSum, comm, stream));
    clique_->settle(rank_, world,
                    [&] { return "starting the all-reduce of " + std::to_string(n) + " values"; });
    CONVEYOR_CUDA_CHECK(cudaMemcpyAsync(reduce_host_, reduce_device_, n * sizeof(double),
                                        cudaMemcpyDeviceToHost, stream));
  });
  clique_->wait(rank_, *reduce_stream_, "the all-reduce of " + std::to_string(n) + " values");
  std::memcpy(values.data(), reduce_host_, n * sizeof(double));
}

void NcclTransport::synchronize(const Stream& stream) {
  throw_if_aborted();
  CudaDeviceGuard guard(device_);
  clique_->wait(rank_, stream, "stream " + std::to_string(stream.id()));
}

void NcclTransport::abort(const std::string& reason) { clique_->abort_all(reason); }

void NcclTransport::check_while_waiting(std::function<void()> check) {
  clique_->set_abort_watch(std::move(check));
}

namespace {

void check_device(int rank, int device) {
  const int available = cuda_device_count();
  if (device < 0 || device >= available)
    throw std::invalid_argument("rank " + std::to_string(rank) +
                                " asks for cuda:" + std::to_string(device) + ", but " +
                                std::to_string(available) + " CUDA device(s) are usable");
}

}  // namespace

std::vector<std::unique_ptr<Transport> > make_nccl_transports(
    const std::vector<int>& cuda_device_per_rank, std::chrono::milliseconds timeout,
    const NcclGroups& groups) {
  if (cuda_device_per_rank.empty())
    throw std::invalid_argument("the NCCL transport needs at least one rank");
  check_timeout(timeout, "the NCCL transport's timeout");
  check_nccl_groups(groups, static_cast<int>(cuda_device_per_rank.size()));
  std::set<int> seen;
  for (size_t r = 0; r < cuda_device_per_rank.size(); ++r) {
    const int d = cuda_device_per_rank[r];
    check_device(static_cast<int>(r), d);
    if (!seen.insert(d).second)
      throw std::invalid_argument("rank " + std::to_string(r) +
                                  " asks for cuda:" + std::to_string(d) +
                                  ", which another rank already has: NCCL needs one GPU per "
                                  "rank (use the in-process transport to share a GPU)");
  }
  auto clique = std::make_shared<NcclClique>(cuda_device_per_rank, timeout, groups);
  std::vector<std::unique_ptr<Transport> > out;
  for (int r = 0; r < clique->size(); ++r)
    out.push_back(std::make_unique<NcclTransport>(clique, r));
  return out;
}

std::unique_ptr<Transport> make_nccl_transport_from_ids(int rank, int ranks, int cuda_device,
                                                        const std::vector<std::string>& unique_ids,
                                                        std::chrono::milliseconds timeout,
                                                        const NcclGroups& groups) {
  check_timeout(timeout, "the NCCL transport's timeout");
  detail::check_clique_rank(rank, ranks, "rank");
  check_nccl_groups(groups, ranks);
  const int slots = nccl_slot_count(ranks, static_cast<int>(groups.size()));
  check_device(rank, cuda_device);
  if (static_cast<int>(unique_ids.size()) != slots)
    throw std::invalid_argument("a clique of " + std::to_string(ranks) + " rank(s) and " +
                                std::to_string(groups.size()) + " group(s) needs " +
                                std::to_string(slots) + " NCCL unique ids, got " +
                                std::to_string(unique_ids.size()));
  std::vector<ncclUniqueId> ids(unique_ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    if (unique_ids[i].size() != sizeof(ncclUniqueId))
      throw std::invalid_argument("NCCL unique id " + std::to_string(i) + " has " +
                                  std::to_string(unique_ids[i].size()) + " bytes, expected " +
                                  std::to_string(sizeof(ncclUniqueId)));
    std::memcpy(ids[i].internal, unique_ids[i].data(), sizeof(ncclUniqueId));
  }
  auto clique = std::make_shared<NcclClique>(rank, ranks, cuda_device, ids, timeout, groups);
  return std::make_unique<NcclTransport>(clique, rank);
}

#endif  // CONVEYOR_WITH_CUDA

}  // namespace conveyor::comm
