#include "comm/report_channel.h"

#include <stdexcept>
#include <string>
#include <utility>

namespace conveyor::comm {
namespace {

class ReportChannelTransport : public Transport {
 public:
  // The data transport's waits also ask the report transport whether another rank aborted:
  // its notice comes over the reports (NCCL cannot carry it), and should end the wait now
  // rather than at its deadline.
  ReportChannelTransport(std::unique_ptr<Transport> data, std::unique_ptr<Transport> reports)
      : reports_(std::move(reports)), data_(std::move(data)) {
    ask_reports_while_waiting(nullptr);
  }

  int rank() const override { return data_->rank(); }
  int size() const override { return data_->size(); }
  void send(const Tensor& tensor, int peer, const Stream& stream) override {
    data_->send(tensor, peer, stream);
  }
  void recv(const Tensor& tensor, int peer, const Stream& stream) override {
    data_->recv(tensor, peer, stream);
  }
  bool try_recv(const Tensor& tensor, int peer, const Stream& stream) override {
    return data_->try_recv(tensor, peer, stream);
  }
  void all_reduce_sum(std::vector<double>& values) override { data_->all_reduce_sum(values); }
  bool queues_kernels_that_wait_on_peers() const override {
    return data_->queues_kernels_that_wait_on_peers();
  }
  std::unique_ptr<PendingGroupCall> start_group_sum(std::vector<float>& values,
                                                    const std::vector<int>& group) override {
    return data_->start_group_sum(values, group);
  }
  std::unique_ptr<PendingGroupCall> start_group_reduce_scatter(
      std::vector<float>& values, const std::vector<int>& group,
      const std::vector<size_t>& bounds) override {
    return data_->start_group_reduce_scatter(values, group, bounds);
  }
  std::unique_ptr<PendingGroupCall> start_group_gather(std::vector<float>& values,
                                                       const std::vector<int>& group,
                                                       const std::vector<size_t>& bounds) override {
    return data_->start_group_gather(values, group, bounds);
  }
  void synchronize(const Stream& stream) override { data_->synchronize(stream); }

  // The data transport first: its waits are the ones holding up this rank's work.
  void abort(const std::string& reason) override {
    data_->abort(reason);
    reports_->abort(reason);
  }

  void poll_abort() override {
    data_->poll_abort();
    reports_->poll_abort();
  }
  void check_while_waiting(std::function<void()> check) override {
    ask_reports_while_waiting(std::move(check));
  }

  std::map<int, std::vector<std::byte>> collect_failure_reports(
      const std::vector<std::byte>& report, int collector,
      std::chrono::milliseconds grace) override {
    return reports_->collect_failure_reports(report, collector, grace);
  }

 private:
  // The data transport's waits ask the report transport for an abort notice, then `also`.
  void ask_reports_while_waiting(std::function<void()> also) {
    Transport* reports = reports_.get();
    data_->check_while_waiting([reports, also = std::move(also)] {
      reports->poll_abort();
      if (also) also();
    });
  }

  // Declared first, so gone last: the data transport's check points to it.
  std::unique_ptr<Transport> reports_;
  std::unique_ptr<Transport> data_;
};

}  // namespace

std::unique_ptr<Transport> with_reports_over(std::unique_ptr<Transport> data,
                                             std::unique_ptr<Transport> reports) {
  if (!data || !reports) throw std::invalid_argument("with_reports_over: a transport is missing");
  if (data->rank() != reports->rank() || data->size() != reports->size())
    throw std::invalid_argument(
        "with_reports_over: the data transport is rank " + std::to_string(data->rank()) + " of " +
        std::to_string(data->size()) + " but the report transport rank " +
        std::to_string(reports->rank()) + " of " + std::to_string(reports->size()));
  return std::make_unique<ReportChannelTransport>(std::move(data), std::move(reports));
}

}  // namespace conveyor::comm
