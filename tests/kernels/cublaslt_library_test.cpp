// cuBLASLt is opened on the first call of one of its functions, and only then: a CPU process
// never maps it. These run without a GPU (opening the library and asking it for a status
// name needs no device), in a build with the CUDA backend.
#include "kernels/cublaslt_library.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <stdexcept>
#include <string>

#include "support/mapped_files.h"

#ifdef CONVEYOR_WITH_CUDA
#include <cublasLt.h>
#endif

namespace conveyor::testing {
namespace {

#ifdef CONVEYOR_WITH_CUDA
namespace cuda = conveyor::kernels::cuda;

TEST(CublasLtLibrary, OpensOnTheFirstCallAndForwardsToTheLibrarysOwnFunction) {
  ASSERT_FALSE(process_maps_file("libcublasLt")) << "cuBLASLt was loaded before any call";
  EXPECT_STREQ(cublasLtGetStatusName(CUBLAS_STATUS_SUCCESS), "CUBLAS_STATUS_SUCCESS");
  EXPECT_STREQ(cublasLtGetStatusName(CUBLAS_STATUS_NOT_SUPPORTED), "CUBLAS_STATUS_NOT_SUPPORTED");
  EXPECT_TRUE(process_maps_file("libcublasLt"));
  // Opened once: later calls find the same library.
  EXPECT_EQ(cuda::cublaslt_library(), cuda::cublaslt_library());
}

TEST(CublasLtLibrary, TriesTheLoadersSearchThenTheFileOfTheBuild) {
  const std::vector<std::string> files = cuda::cublaslt_library_candidates();
  ASSERT_EQ(files.size(), 2u);
  EXPECT_EQ(files[0], "libcublasLt.so." + std::to_string(CUBLAS_VER_MAJOR));
  EXPECT_TRUE(std::filesystem::exists(files[1])) << files[1];
  // The build's own file opens alone, as when the loader's search does not know the name.
  EXPECT_NE(cuda::open_first_library({files[1]}, "cuBLASLt"), nullptr);
}

// Descriptors kept by objects that outlive main. One registered before the library opened is
// destroyed at exit after the library's own teardown: its destroy call is skipped (it holds
// storage the library never allocated, which a call that reached the library would free).
// One made after the library opened (descriptors need no GPU) is destroyed before, for real.
struct DescriptorHolder {
  const char* name = "";
  cublasLtMatmulDesc_t desc = nullptr;
  ~DescriptorHolder() {
    if (desc == nullptr) return;
    const bool skipped = cuda::cublaslt_torn_down();
    const cublasStatus_t status = cublasLtMatmulDescDestroy(desc);
    std::fprintf(stderr, "%s: %s, status %d\n", name, skipped ? "skipped" : "destroyed",
                 static_cast<int>(status));
  }
};

void make_descriptors_and_exit() {
  static cublasLtMatmulDescOpaque_t not_from_the_library;
  static DescriptorHolder before_the_library;  // its destructor is registered now
  before_the_library.name = "made before the library opened";
  before_the_library.desc = &not_from_the_library;
  cublasLtMatmulDesc_t desc = nullptr;  // opens the library
  if (cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F) != CUBLAS_STATUS_SUCCESS)
    std::_Exit(3);
  static DescriptorHolder after_the_library{"made after it opened", desc};
  std::exit(0);
}

TEST(CublasLtLibraryDeathTest, AtExitAnObjectOlderThanTheLibraryDoesNotReachIt) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");  // a fresh process: the library not yet open
  EXPECT_EXIT(make_descriptors_and_exit(), ::testing::ExitedWithCode(0),
              "made after it opened: destroyed, status 0\n"
              "made before the library opened: skipped, status 0");
}

TEST(CublasLtLibrary, NoFileThatLoadsIsOneErrorNamingEachFileAndWhy) {
  const std::string missing = "libconveyor_no_such_library.so.1";
  const std::string not_a_library = std::filesystem::temp_directory_path().string();
  try {
    cuda::open_first_library({missing, not_a_library}, "the test library");
    FAIL() << "a missing library was opened";
  } catch (const std::runtime_error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("the test library could not be loaded"), std::string::npos) << what;
    EXPECT_NE(what.find(missing + ": "), std::string::npos) << what;
    EXPECT_NE(what.find(not_a_library + ": "), std::string::npos) << what;
    EXPECT_NE(what.find("LD_LIBRARY_PATH"), std::string::npos) << what;
  }
}
#else
TEST(CublasLtLibrary, OpensOnTheFirstCallAndForwardsToTheLibrarysOwnFunction) {
  GTEST_SKIP() << "built without the CUDA backend: there is no cuBLASLt to open";
}
#endif

}  // namespace
}  // namespace conveyor::testing
