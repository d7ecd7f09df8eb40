// Linear layer on CUDA through cuBLASLt. y and dx are written (`=`); dW and db accumulate
// (`+=`).
//
// cuBLASLt is column-major; a row-major [r, c] matrix is the column-major [c, r] matrix with
// the same memory, so every product is computed transposed:
//   forward          yᵀ[out,n]  = W[in,out]ᵀ · xᵀ[in,n]      (+ bias per row of yᵀ: epilogue)
//   backward_input   dxᵀ[in,n]  = W[in,out]  · dyᵀ[out,n]
//   backward_weight  dWᵀ[in,out] += xᵀ[in,n] · (dyᵀ[out,n])ᵀ  (beta = 1)
// db += column sums of dy uses the deterministic two-stage reduction of column_sum.cuh (no
// atomics), because the BGRADB epilogue writes instead of accumulating.
// fp32 storage; CUBLAS_COMPUTE_32F, or CUBLAS_COMPUTE_32F_FAST_TF32 when ctx.allow_tf32.
// Descriptors are created per call (cheap); the heuristic query is per call too: a cache of
// chosen algorithms per (shape, epilogue) belongs in CudaContext, which does not hold one yet.
#include <string>

#include "kernels/column_sum.cuh"
#include "kernels/cuda_util.cuh"
#include "kernels/linear.h"

namespace conveyor::kernels::cuda {
namespace {

// RAII owners so that a throwing check never leaks a descriptor.
struct MatmulDesc {
  cublasLtMatmulDesc_t h = nullptr;
  MatmulDesc(cublasComputeType_t compute) {
    CONVEYOR_CUBLAS_CHECK(cublasLtMatmulDescCreate(&h, compute, CUDA_R_32F));
  }
  ~MatmulDesc() { cublasLtMatmulDescDestroy(h); }
  MatmulDesc(const MatmulDesc&) = delete;
  MatmulDesc& operator=(const MatmulDesc&) = delete;
};
struct Layout {
  cublasLtMatrixLayout_t h = nullptr;
  Layout(int64_t rows, int64_t cols, int64_t ld) {
    CONVEYOR_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&h, CUDA_R_32F, static_cast<uint64_t>(rows),
                                                     static_cast<uint64_t>(cols), ld));
  }
  ~Layout() { cublasLtMatrixLayoutDestroy(h); }
  Layout(const Layout&) = delete;
  Layout& operator=(const Layout&) = delete;
};
struct Preference {
  cublasLtMatmulPreference_t h = nullptr;
  Preference() { CONVEYOR_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&h)); }
  ~Preference() { cublasLtMatmulPreferenceDestroy(h); }
  Preference(const Preference&) = delete;
  Preference& operator=(const Preference&) = delete;
};

// Largest power of two (<= 16) dividing the address: tells the heuristic what it may assume.
// No more than 16, the widest load the kernels need: the heuristic's pick, and so the bits of
// the result, must not change with an operand's alignment beyond that (row slices of one
// tensor start at addresses aligned to different powers of two).
uint32_t alignment_of(const void* p) {
  const auto addr = reinterpret_cast<uintptr_t>(p);
  uint32_t a = 16;
  while (a > 4 && (addr % a) != 0) a >>= 1;
  return a;
}

// D[m,n] = op(A)·op(B) + beta·D (+ bias[m] per row), column-major. run_gemm returns false only
// when a bias epilogue was asked for and no algorithm supports it; the caller adds the bias.
struct Gemm {
  cublasOperation_t trans_a, trans_b;
  int64_t m, n, k;
  const float* a;
  int64_t lda;
  const float* b;
  int64_t ldb;
  float* d;
  int64_t ldd;
  float beta;
  const float* bias;  // may be null
};

// One attempt with one compute type; false when cuBLASLt has no algorithm for it.
bool try_gemm(const CudaContext& ctx, const Gemm& g, cublasComputeType_t compute) {
  MatmulDesc desc(compute);
  CONVEYOR_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc.h, CUBLASLT_MATMUL_DESC_TRANSA,
                                                       &g.trans_a, sizeof(g.trans_a)));
  CONVEYOR_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc.h, CUBLASLT_MATMUL_DESC_TRANSB,
                                                       &g.trans_b, sizeof(g.trans_b)));
  if (g.bias != nullptr) {
    const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
    CONVEYOR_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc.h, CUBLASLT_MATMUL_DESC_EPILOGUE,
                                                         &epilogue, sizeof(epilogue)));
    CONVEYOR_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc.h, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                         &g.bias, sizeof(g.bias)));
  }
  const bool ta = g.trans_a == CUBLAS_OP_T, tb = g.trans_b == CUBLAS_OP_T;
  Layout a_layout(ta ? g.k : g.m, ta ? g.m : g.k, g.lda);
  Layout b_layout(tb ? g.n : g.k, tb ? g.k : g.n, g.ldb);
  Layout d_layout(g.m, g.n, g.ldd);

  Preference pref;
  const uint64_t workspace_bytes = ctx.workspace != nullptr ? ctx.workspace_bytes : 0;
  CONVEYOR_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref.h, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes, sizeof(workspace_bytes)));
  const uint32_t align_a = alignment_of(g.a), align_b = alignment_of(g.b),
                 align_d = alignment_of(g.d);
  CONVEYOR_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref.h, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_a, sizeof(align_a)));
  CONVEYOR_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref.h, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_b, sizeof(align_b)));
  CONVEYOR_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref.h, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_d, sizeof(align_d)));
  CONVEYOR_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref.h, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_d, sizeof(align_d)));

  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t status =
      cublasLtMatmulAlgoGetHeuristic(ctx.cublaslt, desc.h, a_layout.h, b_layout.h, d_layout.h,
                                     d_layout.h, pref.h, 1, &result, &found);
  if (status == CUBLAS_STATUS_NOT_SUPPORTED || (status == CUBLAS_STATUS_SUCCESS && found == 0))
    return false;
  CONVEYOR_CUBLAS_CHECK(status);
  const float alpha = 1.0f;
  CONVEYOR_CUBLAS_CHECK(cublasLtMatmul(ctx.cublaslt, desc.h, &alpha, g.a, a_layout.h, g.b,
                                       b_layout.h, &g.beta, g.d, d_layout.h, g.d, d_layout.h,
                                       &result.algo, ctx.workspace, workspace_bytes, ctx.stream));
  return true;
}

// TF32 first when allowed; plain fp32 if no TF32 kernel fits (e.g. 4-byte aligned operands).
bool run_gemm(const CudaContext& ctx, const Gemm& g) {
  detail::require(ctx.cublaslt != nullptr, "linear: CudaContext has no cuBLASLt handle");
  // The heuristic has no preference for the bias pointer's alignment, and the BIAS epilogue
  // kernels load it with vector loads: a bias view at a 4-byte offset passes the heuristic
  // and then fails (or faults) in cublasLtMatmul. Such a bias is added by our own kernel.
  if (g.bias != nullptr && !detail::aligned16(g.bias)) return false;
  if (ctx.allow_tf32 && try_gemm(ctx, g, CUBLAS_COMPUTE_32F_FAST_TF32)) return true;
  // With TF32 allowed, a bias no TF32 kernel fuses is added by our kernel after a TF32 GEMM,
  // rather than fused into a plain fp32 one many times slower on tensor-core GPUs.
  if (g.bias != nullptr && ctx.allow_tf32) return false;
  if (try_gemm(ctx, g, CUBLAS_COMPUTE_32F)) return true;
  if (g.bias != nullptr) return false;
  throw std::runtime_error(
      "linear: cuBLASLt found no algorithm for a " + std::to_string(g.m) + "x" +
      std::to_string(g.n) + "x" + std::to_string(g.k) + " fp32 GEMM (workspace " +
      std::to_string(ctx.workspace != nullptr ? ctx.workspace_bytes : 0) +
      " bytes, operand alignments " + std::to_string(alignment_of(g.a)) + "/" +
      std::to_string(alignment_of(g.b)) + "/" + std::to_string(alignment_of(g.d)) + " bytes)");
}

// y[r, j] = (add ? y[r, j] : 0) + (bias ? bias[j] : 0) over [n, out].
__global__ void bias_rows_kernel(float* __restrict__ y, const float* __restrict__ bias, int64_t n,
                                 int64_t out, bool add) {
  const int64_t total = n * out;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += stride) {
    const float b = bias != nullptr ? bias[i % out] : 0.0f;
    y[i] = add ? y[i] + b : b;
  }
}

void launch_bias_rows(const CudaContext& ctx, float* y, const float* bias, int64_t n, int64_t out,
                      bool add) {
  bias_rows_kernel<<<detail::grid_for(n * out, 256), 256, 0, ctx.stream>>>(y, bias, n, out, add);
  CONVEYOR_CUDA_CHECK_LAUNCH();
}

// db += Σ_rows dy. Read-only loads, as __restrict__ would allow.
struct BiasGradTerm {
  const float* dy;
  int64_t out;
  __device__ void operator()(float (&acc)[1], int64_t row, int64_t col) const {
    acc[0] += __ldg(dy + row * out + col);
  }
};

}  // namespace

void linear_forward(const CudaContext& ctx, float* y, const float* x, const float* weight,
                    const float* bias, int64_t n, int64_t in, int64_t out) {
  detail::require_nonnegative("linear_forward", "n", n);
  detail::require_nonnegative("linear_forward", "in", in);
  detail::require_nonnegative("linear_forward", "out", out);
  if (n == 0 || out == 0) return;
  if (in == 0) {  // empty product: y = bias (or 0)
    launch_bias_rows(ctx, y, bias, n, out, false);
    return;
  }
  Gemm g{CUBLAS_OP_T, CUBLAS_OP_N, out, n, in, weight, in, x, in, y, out, 0.0f, bias};
  if (!run_gemm(ctx, g)) {  // no fused-bias algorithm: plain GEMM, then add the bias
    g.bias = nullptr;
    run_gemm(ctx, g);
    launch_bias_rows(ctx, y, bias, n, out, true);
  }
}

void linear_backward_input(const CudaContext& ctx, float* dx, const float* dy, const float* weight,
                           int64_t n, int64_t in, int64_t out) {
  detail::require_nonnegative("linear_backward_input", "n", n);
  detail::require_nonnegative("linear_backward_input", "in", in);
  detail::require_nonnegative("linear_backward_input", "out", out);
  if (n == 0 || in == 0) return;
  if (out <= 0) {  // empty product: dx = 0
    launch_bias_rows(ctx, dx, nullptr, n, in, false);
    return;
  }
  const Gemm g{CUBLAS_OP_N, CUBLAS_OP_N, in, n, out, weight, in, dy, out, dx, in, 0.0f, nullptr};
  run_gemm(ctx, g);
}

void linear_backward_weight(const CudaContext& ctx, float* dweight, float* dbias, const float* dy,
                            const float* x, int64_t n, int64_t in, int64_t out) {
  detail::require_nonnegative("linear_backward_weight", "n", n);
  detail::require_nonnegative("linear_backward_weight", "in", in);
  detail::require_nonnegative("linear_backward_weight", "out", out);
  if (n == 0 || out == 0) return;  // nothing to add
  if (in > 0) {
    const Gemm g{CUBLAS_OP_N, CUBLAS_OP_T, in, out, n, x, in, dy, out, dweight, in, 1.0f, nullptr};
    run_gemm(ctx, g);
  }
  // Runs after the GEMM on the same stream, so it may reuse the cuBLASLt workspace.
  if (dbias != nullptr)
    detail::accumulate_column_sums<1>(ctx, "linear", "out", {{dbias}}, n, out,
                                      BiasGradTerm{dy, out});
}

}  // namespace conveyor::kernels::cuda
