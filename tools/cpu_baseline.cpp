// The libraries are compiled for the x86-64 level CONVEYOR_CPU_BASELINE names (the command
// line's own code, this file included, for the plain baseline). On a CPU without that level's
// instructions the first vector instruction of a library would end the process with SIGILL
// and no word of why; this check runs before main() and before every other static
// initialiser of the binary (priority 101, the first one a program may use), and says which
// instruction set is missing and how to build for this machine.
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace {

#if defined(__x86_64__) && defined(CONVEYOR_CPU_LEVEL) && (defined(__GNUC__) || defined(__clang__))

struct Feature {
  int level;  // the x86-64 level that brings it
  bool (*present)();
  const char* name;
};

// __builtin_cpu_supports takes a string literal only, hence one function per feature.
#define CONVEYOR_FEATURE(level, id, name)                       \
  Feature {                                                     \
    level, [] { return __builtin_cpu_supports(id) != 0; }, name \
  }

// clang-format off
const Feature kFeatures[] = {
    CONVEYOR_FEATURE(2, "sse3", "SSE3"),
    CONVEYOR_FEATURE(2, "ssse3", "SSSE3"),
    CONVEYOR_FEATURE(2, "sse4.1", "SSE4.1"),
    CONVEYOR_FEATURE(2, "sse4.2", "SSE4.2"),
    CONVEYOR_FEATURE(2, "popcnt", "POPCNT"),
    CONVEYOR_FEATURE(3, "avx", "AVX"),
    CONVEYOR_FEATURE(3, "avx2", "AVX2"),
    CONVEYOR_FEATURE(3, "bmi", "BMI1"),
    CONVEYOR_FEATURE(3, "bmi2", "BMI2"),
    CONVEYOR_FEATURE(3, "f16c", "F16C"),
    CONVEYOR_FEATURE(3, "fma", "FMA"),
    CONVEYOR_FEATURE(3, "lzcnt", "LZCNT"),
    CONVEYOR_FEATURE(3, "movbe", "MOVBE"),
    CONVEYOR_FEATURE(4, "avx512f", "AVX-512F"),
    CONVEYOR_FEATURE(4, "avx512bw", "AVX-512BW"),
    CONVEYOR_FEATURE(4, "avx512cd", "AVX-512CD"),
    CONVEYOR_FEATURE(4, "avx512dq", "AVX-512DQ"),
    CONVEYOR_FEATURE(4, "avx512vl", "AVX-512VL"),
};
// clang-format on

#undef CONVEYOR_FEATURE

// The first feature of the binary's level this CPU lacks (the lowest level first), or
// nullptr. For the test of the refusal only, CONVEYOR_TEST_CPU_LACKS=<feature> in the
// environment pretends the feature of that name is missing.
const Feature* missing_feature() {
  const char* pretend = std::getenv("CONVEYOR_TEST_CPU_LACKS");
  __builtin_cpu_init();
  for (const Feature& f : kFeatures) {
    if (f.level > CONVEYOR_CPU_LEVEL) continue;
    const bool lacks = pretend ? std::strcmp(pretend, f.name) == 0 : !f.present();
    if (lacks) return &f;
  }
  return nullptr;
}

__attribute__((constructor(101))) void refuse_a_cpu_below_the_baseline() {
  const Feature* missing = missing_feature();
  if (missing == nullptr) return;
  // The highest level this CPU may still have: the one below the missing feature's.
  std::fprintf(stderr,
               "conveyor: error: this build is for x86-64-v%d, and this CPU has no %s; rebuild "
               "with -DCONVEYOR_CPU_BASELINE=%s\n",
               CONVEYOR_CPU_LEVEL, missing->name, missing->level == 4 ? "x86-64-v3" : "generic");
  std::_Exit(1);
}

#endif

}  // namespace
