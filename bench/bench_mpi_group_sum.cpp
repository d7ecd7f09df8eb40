// The MPI transport's group sum over every process of the launch, as data parallelism
// runs it for a stage's gradient bucket: run under mpirun, e.g.
//   mpirun -np 4 build/bench/bench_mpi_group_sum --benchmark_repetitions=3
// Every process runs the same fixed number of iterations (a collective cannot take the
// adaptive count Google Benchmark would pick per process), each started together after a
// barrier that is not timed. Rank 0 reports; `bytes_per_second` counts the values summed
// (N x 4 bytes per iteration), not the bytes moved.
#include <benchmark/benchmark.h>
#include <mpi.h>

#include <chrono>
#include <memory>
#include <string_view>
#include <vector>

#include "bench/benchmark_flags.h"
#include "comm/mpi_transport.h"

namespace conveyor::comm {
namespace {

// Made after MPI_Init and gone before MPI_Finalize.
std::unique_ptr<Transport> g_transport;

void BM_MpiGroupSum(benchmark::State& state) {
  Transport& t = *g_transport;
  std::vector<int> everyone;
  for (int r = 0; r < t.size(); ++r) everyone.push_back(r);
  const size_t floats = static_cast<size_t>(state.range(0));
  std::vector<float> values(floats, 1.0f);
  for (auto _ : state) {
    state.PauseTiming();
    std::fill(values.begin(), values.end(), 1.0f);
    MPI_Barrier(MPI_COMM_WORLD);
    state.ResumeTiming();
    t.start_group_sum(values, everyone)->wait();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * floats * sizeof(float)));
  state.counters["members"] = t.size();
}
BENCHMARK(BM_MpiGroupSum)
    ->Arg(1 << 10)
    ->Arg(1 << 16)
    ->Arg(1 << 20)
    ->Arg(1 << 22)
    ->Iterations(30)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// Ranks other than 0 run every benchmark and report nothing.
class SilentReporter : public benchmark::BenchmarkReporter {
 public:
  bool ReportContext(const Context&) override { return true; }
  void ReportRuns(const std::vector<Run>&) override {}
};

}  // namespace
}  // namespace conveyor::comm

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_SERIALIZED, &provided);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  // Google Benchmark prints its usage and exits on --help: on rank 0 alone, and after
  // MPI_Finalize, so that mpirun does not take the exit for an abort.
  for (int i = 1; i < argc; ++i) {
    if (std::string_view(argv[i]) != "--help") continue;
    MPI_Finalize();
    if (rank == 0) benchmark::Initialize(&argc, argv);
    return 0;
  }
  // A flag refused is refused by every process (rank 0 says why), rather than ignored.
  if (const auto status = conveyor::bench::take_benchmark_flags(&argc, argv, rank == 0)) {
    MPI_Finalize();
    return *status;
  }
  conveyor::comm::g_transport = conveyor::comm::make_mpi_transport(std::chrono::seconds(120));
  if (rank == 0) {
    benchmark::RunSpecifiedBenchmarks();
  } else {
    conveyor::comm::SilentReporter silent;
    benchmark::RunSpecifiedBenchmarks(&silent);
  }
  benchmark::Shutdown();
  conveyor::comm::g_transport.reset();
  MPI_Finalize();
  return 0;
}
