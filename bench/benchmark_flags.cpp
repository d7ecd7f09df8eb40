#include "bench/benchmark_flags.h"

#include <benchmark/benchmark.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <initializer_list>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

namespace conveyor::bench {
namespace {

// A reporter that lets Google Benchmark find the benchmarks a filter selects, and count them,
// without running any: it declines the run in ReportContext, and what the library would
// print (a list, its own message for a filter that matches nothing) goes to a string.
class CountOnly : public benchmark::BenchmarkReporter {
 public:
  CountOnly() {
    SetOutputStream(&said_);
    SetErrorStream(&said_);
  }
  bool ReportContext(const Context&) override { return false; }
  void ReportRuns(const std::vector<Run>&) override {}
  std::string said() const { return said_.str(); }

 private:
  std::ostringstream said_;
};

// The value of `arg` when it is `--name=VALUE` (or `--name` alone, for a flag whose value may
// be left out), as Google Benchmark reads its flags; nothing when it is another argument.
std::optional<std::string_view> flag_value(std::string_view arg, std::string_view name,
                                           bool value_optional = false) {
  if (!arg.starts_with("--") || arg.substr(2, name.size()) != name) return std::nullopt;
  const std::string_view rest = arg.substr(2 + name.size());
  if (rest.empty() && value_optional) return rest;
  if (!rest.starts_with('=')) return std::nullopt;
  return rest.substr(1);
}

// A value Google Benchmark reads as true or false (it takes any other word for true).
bool boolean(std::string_view value) {
  constexpr std::array<std::string_view, 13> kWords = {
      "", "true", "false", "yes", "no", "on", "off", "1", "0", "t", "f", "y", "n"};
  std::string lower(value);
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return std::find(kWords.begin(), kWords.end(), lower) != kWords.end();
}

bool whole_number(std::string_view text, long min) {
  const std::string s(text);
  char* end = nullptr;
  errno = 0;
  const long value = std::strtol(s.c_str(), &end, 10);
  return !s.empty() && *end == '\0' && errno == 0 && value >= min && value <= 1'000'000'000;
}

bool seconds(std::string_view text) {
  const std::string s(text);
  char* end = nullptr;
  const double value = std::strtod(s.c_str(), &end);
  return !s.empty() && *end == '\0' && std::isfinite(value) && value >= 0;
}

// A value Google Benchmark reads as --benchmark_context: empty, or comma-separated pieces of
// one '=' each (it leaves any other value in argv, which would be refused as unknown).
bool key_value_pairs(std::string_view text) {
  if (text.empty()) return true;
  size_t start = 0;
  while (true) {
    const size_t comma = text.find(',', start);
    const std::string_view piece = text.substr(start, comma - start);
    if (std::count(piece.begin(), piece.end(), '=') != 1) return false;
    if (comma == std::string_view::npos) return true;
    start = comma + 1;
  }
}

// What is wrong with the value of one of Google Benchmark's flags in `arg`, as "expects ...,
// got ..." after the flag's name; empty when the value is right or `arg` is not such a flag.
std::string bad_value(std::string_view arg) {
  const auto got = [](std::string_view value) {
    return value.empty() ? std::string("got an empty one") : "got '" + std::string(value) + "'";
  };
  for (const char* name : {"benchmark_min_time", "benchmark_min_warmup_time"})
    if (const auto v = flag_value(arg, name); v && !seconds(*v))
      return std::string("--") + name + " expects a number of seconds of at least 0, " + got(*v);
  if (const auto v = flag_value(arg, "benchmark_repetitions"); v && !whole_number(*v, 1))
    return "--benchmark_repetitions expects a whole number of at least 1, " + got(*v);
  if (const auto v = flag_value(arg, "v"); v && !whole_number(*v, 0))
    return "--v expects a whole number of at least 0, " + got(*v);
  for (const char* name : {"benchmark_format", "benchmark_out_format"})
    if (const auto v = flag_value(arg, name); v && *v != "console" && *v != "json" && *v != "csv")
      return std::string("--") + name + " expects console, json or csv, " + got(*v);
  if (const auto v = flag_value(arg, "benchmark_time_unit");
      v && *v != "ns" && *v != "us" && *v != "ms" && *v != "s")
    return "--benchmark_time_unit expects ns, us, ms or s, " + got(*v);
  if (const auto v = flag_value(arg, "benchmark_color");
      v && (v->empty() || !(boolean(*v) || *v == "auto")))
    return "--benchmark_color expects auto, true or false, " + got(*v);
  if (const auto v = flag_value(arg, "benchmark_context"); v && !key_value_pairs(*v))
    return "--benchmark_context expects key=value pairs separated by commas, " + got(*v);
  for (const char* name : {"benchmark_list_tests", "benchmark_enable_random_interleaving",
                           "benchmark_report_aggregates_only", "benchmark_display_aggregates_only",
                           "benchmark_counters_tabular"})
    if (const auto v = flag_value(arg, name, true); v && !boolean(*v))
      return std::string("--") + name + " expects true or false, " + got(*v);
  if (const auto v = flag_value(arg, "benchmark_out"); v && !v->empty()) {
    // Google Benchmark opens it only after the run is set up and then exits 1; opened here
    // for appending, which changes nothing in a file that is there.
    namespace fs = std::filesystem;
    const std::string path(*v);
    std::error_code ec;
    const bool existed = fs::exists(path, ec);
    std::FILE* file = std::fopen(path.c_str(), "a");
    if (file == nullptr)
      return "--benchmark_out cannot write '" + path + "': " + std::strerror(errno);
    std::fclose(file);
    if (!existed) fs::remove(path, ec);
  }
  return {};
}

// The flags bad_value checks, each of which Google Benchmark also reads from the environment
// variable of its name in capitals (BENCHMARK_FORMAT for --benchmark_format) when the command
// line leaves it out.
constexpr std::array<const char*, 15> kCheckedFlags = {"benchmark_min_time",
                                                       "benchmark_min_warmup_time",
                                                       "benchmark_repetitions",
                                                       "v",
                                                       "benchmark_format",
                                                       "benchmark_out_format",
                                                       "benchmark_time_unit",
                                                       "benchmark_color",
                                                       "benchmark_list_tests",
                                                       "benchmark_enable_random_interleaving",
                                                       "benchmark_report_aggregates_only",
                                                       "benchmark_display_aggregates_only",
                                                       "benchmark_counters_tabular",
                                                       "benchmark_context",
                                                       "benchmark_out"};

// What is wrong with the environment's value of a checked flag the command line leaves out,
// said of the variable; empty when every such value is right (or empty, which is as unset).
std::string bad_environment_value(int argc, char** argv) {
  for (const char* name : kCheckedFlags) {
    bool given = false;
    for (int i = 1; i < argc && !given; ++i) given = flag_value(argv[i], name, true).has_value();
    std::string variable(name);
    std::transform(variable.begin(), variable.end(), variable.begin(),
                   [](unsigned char c) { return static_cast<char>(std::toupper(c)); });
    const char* value = std::getenv(variable.c_str());
    if (given || value == nullptr || *value == '\0') continue;
    const std::string flag = std::string("--") + name;
    const std::string bad = bad_value(flag + "=" + value);
    if (!bad.empty())
      return variable + " in the environment, which stands for " + flag + "," +
             bad.substr(flag.size());
  }
  return {};
}

std::string program_name(const char* argv0) {
  return std::filesystem::path(argv0 != nullptr ? argv0 : "benchmark").filename().string();
}

}  // namespace

std::optional<int> take_benchmark_flags(int* argc, char** argv, bool report) {
  const std::string program = program_name(argv[0]);
  const auto refuse = [&](const std::string& sentence) {
    if (report) std::fprintf(stderr, "%s: %s\n", program.c_str(), sentence.c_str());
    return 2;
  };
  std::string filter = benchmark::GetBenchmarkFilter();  // BENCHMARK_FILTER, or "."
  for (int i = 1; i < *argc; ++i) {
    const std::string_view arg = argv[i];
    // Google Benchmark prints its usage and exits 0 at --help, whatever else is given.
    if (flag_value(arg, "help", true)) {
      benchmark::Initialize(argc, argv);
      return 0;
    }
    if (const std::string bad = bad_value(arg); !bad.empty()) return refuse(bad);
    if (const auto v = flag_value(arg, "benchmark_filter")) filter = *v;
  }
  if (const std::string bad = bad_environment_value(*argc, argv); !bad.empty()) return refuse(bad);
  // Counted before benchmark::Initialize reads --benchmark_out, which a run, even one that
  // runs nothing, opens and empties.
  CountOnly selected;
  if (benchmark::RunSpecifiedBenchmarks(&selected, filter) == 0) {
    std::string said = selected.said();
    while (!said.empty() && said.back() == '\n') said.pop_back();
    constexpr std::string_view kBadRegex = "Could not compile benchmark re: ";
    if (said.starts_with(kBadRegex))
      return refuse("--benchmark_filter '" + filter + "' is not a regular expression (" +
                    said.substr(kBadRegex.size()) + ")");
    CountOnly all;
    const size_t total = benchmark::RunSpecifiedBenchmarks(&all, ".");
    return refuse("--benchmark_filter '" + filter + "' matches none of the " +
                  std::to_string(total) + " benchmarks (--benchmark_list_tests lists them)");
  }
  benchmark::Initialize(argc, argv);
  if (*argc > 1) {
    std::string unknown;
    for (int i = 1; i < *argc; ++i) unknown += (i > 1 ? ", '" : "'") + std::string(argv[i]) + "'";
    return refuse(std::string(*argc > 2 ? "unknown arguments " : "unknown argument ") + unknown +
                  ": the flags are --benchmark_NAME=VALUE, listed by --help");
  }
  return std::nullopt;
}

bool gpu_expected() {
  const char* value = std::getenv("CONVEYOR_EXPECT_GPU");
  return value != nullptr && *value != '\0' && std::string_view(value) != "0";
}

}  // namespace conveyor::bench
