// The libraries are compiled for the x86-64 level CONVEYOR_CPU_BASELINE names (the command
// line's own code, this file included, for the plain baseline). On a CPU without that level's
// instructions the first vector instruction of a library would end the process with SIGILL
// and no word of why; this check runs before main() and before every other static
// initialiser of the binary (priority 101, the first one a program may use), and says which
// instruction set is missing and how to build for this machine.
#include <cstdio>
#include <cstdlib>

namespace {

#if defined(__x86_64__) && defined(CONVEYOR_CPU_LEVEL) && (defined(__GNUC__) || defined(__clang__))

// The first feature of the binary's level this CPU lacks, or nullptr. For the test of the
// refusal only, CONVEYOR_TEST_CPU_LACKS=<feature> in the environment pretends one is missing.
const char* missing_feature() {
  if (const char* pretend = std::getenv("CONVEYOR_TEST_CPU_LACKS")) return pretend;
  __builtin_cpu_init();
  if (CONVEYOR_CPU_LEVEL >= 3) {
    if (!__builtin_cpu_supports("avx2")) return "AVX2";
    if (!__builtin_cpu_supports("fma")) return "FMA";
    if (!__builtin_cpu_supports("bmi2")) return "BMI2";
  }
  if (CONVEYOR_CPU_LEVEL >= 4) {
    if (!__builtin_cpu_supports("avx512f")) return "AVX-512F";
    if (!__builtin_cpu_supports("avx512bw")) return "AVX-512BW";
    if (!__builtin_cpu_supports("avx512dq")) return "AVX-512DQ";
    if (!__builtin_cpu_supports("avx512vl")) return "AVX-512VL";
  }
  return nullptr;
}

__attribute__((constructor(101))) void refuse_a_cpu_below_the_baseline() {
  const char* missing = missing_feature();
  if (missing == nullptr) return;
  std::fprintf(stderr,
               "conveyor: error: this build is for x86-64-v%d, and this CPU has no %s; rebuild "
               "with -DCONVEYOR_CPU_BASELINE=%s\n",
               CONVEYOR_CPU_LEVEL, missing, CONVEYOR_CPU_LEVEL >= 4 ? "x86-64-v3" : "generic");
  std::_Exit(1);
}

#endif

}  // namespace
