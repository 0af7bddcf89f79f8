// The fake cuBLASLt: descriptors, layouts and preferences holding exactly
// the attributes the executor sets, and a reference GEMM honouring them.
//
// The rules it enforces are cuBLAS's (docs.nvidia.com/cuda/cublas, section
// "cublasLtMatmul()", "Datatypes Supported", and cublasLtMatmulDescAttributes_t),
// FP8 among them (FP8 section: "To use tensor- or block-scaled FP8 kernels,
// the following set of requirements must be satisfied"):
//  * types: A/B/C/D of one type; A/B bf16 or f16 with C/D f32; FP8 A/B
//    (e4m3 x e4m3, e4m3 x e5m2, e5m2 x e4m3 — no e5m2 x e5m2) with C = D of
//    bf16, f16 or f32 (the FP8 table's rows with an fp8-free output);
//  * FP8: compute type CUBLAS_COMPUTE_32F, scale type CUDA_R_32F; "A must be
//    transposed and B non-transposed (The TN format) on Ada (compute
//    capability 8.9), Hopper (compute capability 9.0), and Blackwell GeForce
//    (compute capability 12.x)"; no FP8 kernel below 8.9; "pointers and matrix
//    dimension must support 16-byte alignment" (Tensor Core Usage: the rows
//    of op(A) or k, k or the columns of op(B), m of C, every leading
//    dimension, every pointer);
//  * A/B scale pointers: "Device pointer to the scale factor value ... must
//    have the same type as the compute type" (float32 here), for FP8 matrices
//    only ("If set for an unsupported matrix data, scale, and compute type
//    combination, calling cublasLtMatmul() will return CUBLAS_INVALID_VALUE");
//  * FAST_ACCUM: only 0 (the executor's choice) is modeled.
//  * Block scaling (MXFP8; cublasLtMatmulDescAttributes_t: CUBLASLT_MATMUL_DESC_A_SCALE_MODE /
//    B_SCALE_MODE, cublasLtMatmulMatrixScale_t; the cublasLtMatmul section's "Scaling Modes
//    Support Overview" and "1D Block Scaling Factors Layout",
//    docs.nvidia.com/cuda/cublas/index.html#d-block-scaling-factors-layout): modes SCALAR_32F
//    (the default) and VEC32_UE8M0 are modeled ("a dedicated scaling factor stored as an 8-bit
//    ... CUDA_R_8F_UE8M0 value for each 32-element block in the innermost dimension",
//    cublasLt.h). VEC32_UE8M0 is for FP8 A and B (the scale pointers' rule above), on both A
//    and B (the overview's MXFP8 row scales both), on Blackwell (compute capability 10.0 and
//    newer: block-scaled MMA is a fifth-generation tensor core instruction, PTX ISA
//    tcgen05.mma ... .block_scale, sm_100a). Its scale tensor is the 128x4-tiled layout:
//    op(A)'s rows (B's columns) the outer dimension padded to 128, K/32 blocks the inner one
//    padded to 4; tile (r/128, j/4) of 512 bytes in row-of-tiles order, element (r, j) at
//    (r % 32) * 16 + (r % 128 / 32) * 4 + j % 4 within it; "starting addresses must be 16-byte
//    aligned". Batched block-scaled GEMMs are not modeled.
// The reference GEMM multiplies in float32 and accumulates in float32 in K
// order — except FP8 GEMMs, which accumulate as the device's FP8 tensor cores
// do (fp8_accumulator.h: a truncating block FMA, promoted into float32 every
// 128 K elements) —, applies alpha * scaleA * scaleB once, then adds beta * C
// and rounds once to D's type (cublasLtMatmul: D = alpha * scaleA * scaleB *
// op(A) op(B) + beta * C without C and D scales). The scales are read when the
// matmul runs on its stream, as the kernel reads them on a GPU.
#include <cstring>

#include "core/convert.h"
#include "cuda/fake/fake_internal.h"
#include "cuda/fake/fake_waits.h"
#include "cuda/fake/fp8_accumulator.h"
#include "cuda/gemm/block_scales.h"

namespace jo::fake {

static int64_t Extent(const Layout& l) {  // elements spanned by one layout, all batches
  if (l.rows == 0 || l.cols == 0) return 0;
  return static_cast<int64_t>(l.batch - 1) * l.stride + static_cast<int64_t>(l.cols - 1) * l.ld +
         static_cast<int64_t>(l.rows);
}

// TF32: float32 with a 10-bit mantissa (NVIDIA A100 Tensor Core whitepaper,
// "TF32": 8-bit exponent, 10-bit mantissa). The fake rounds each input to it
// (to nearest, ties to even: the fake's choice; the hardware's rounding is not
// documented), so a float32 result at FAST_TF32 really is less accurate than
// at CUBLAS_COMPUTE_32F, as on a GPU.
static float ToTf32(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  if ((bits & 0x7f800000u) != 0x7f800000u) {  // finite: round away the low 13 bits
    bits += 0x0fffu + ((bits >> 13) & 1u);
    bits &= ~0x1fffu;
  }
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}

}  // namespace jo::fake

using jo::fake::Count;
using jo::fake::Fail;
using jo::fake::Lock;
using jo::fake::RtFail;
using jo::fake::S;
using jo::fake::t_device;
using jo::fake::t_last;

// ============================== cuBLASLt ==============================

const char* cublasLtGetStatusName(cublasStatus_t s) {
  jo::fake::Count("cublasLtGetStatusName");
  return s == CUBLAS_STATUS_SUCCESS ? "CUBLAS_STATUS_SUCCESS" : "CUBLAS_STATUS_FAKE_ERROR";
}
const char* cublasLtGetStatusString(cublasStatus_t) {
  jo::fake::Count("cublasLtGetStatusString");
  return "fake cuBLASLt status (see fake errors)";
}
size_t cublasLtGetVersion(void) {
  jo::fake::Count("cublasLtGetVersion");
  return CUBLAS_VERSION;
}

cublasStatus_t cublasLtCreate(cublasLtHandle_t* h) {
  jo::fake::Count("cublasLtCreate");
  Lock lock(S().mu);
  auto c = std::make_unique<cublasLtContext>();
  c->device = t_device;
  *h = c.get();
  S().handles.push_back(std::move(c));
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtDestroy(cublasLtHandle_t) {
  jo::fake::Count("cublasLtDestroy");
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* d, cublasComputeType_t compute,
                                        cudaDataType_t scale) {
  jo::fake::Count("cublasLtMatmulDescCreate");
  Lock lock(S().mu);
  *d = new cublasLtMatmulDescOpaque_t();
  S().descs[*d] = jo::fake::Desc{static_cast<int32_t>(compute), static_cast<int32_t>(scale)};
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t d) {
  jo::fake::Count("cublasLtMatmulDescDestroy");
  Lock lock(S().mu);
  S().descs.erase(d);
  delete d;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t d,
                                              cublasLtMatmulDescAttributes_t attr, const void* buf,
                                              size_t size) {
  jo::fake::Count("cublasLtMatmulDescSetAttribute");
  Lock lock(S().mu);
  auto it = S().descs.find(d);
  if (it == S().descs.end()) return CUBLAS_STATUS_INVALID_VALUE;
  if ((attr == CUBLASLT_MATMUL_DESC_A_SCALE_POINTER ||
       attr == CUBLASLT_MATMUL_DESC_B_SCALE_POINTER) &&
      size == sizeof(const void*)) {
    std::memcpy(
        attr == CUBLASLT_MATMUL_DESC_A_SCALE_POINTER ? &it->second.a_scale : &it->second.b_scale,
        buf, size);
    return CUBLAS_STATUS_SUCCESS;
  }
  if ((attr == CUBLASLT_MATMUL_DESC_A_SCALE_MODE || attr == CUBLASLT_MATMUL_DESC_B_SCALE_MODE) &&
      size == sizeof(int32_t)) {
    int32_t mode;
    std::memcpy(&mode, buf, sizeof(mode));
    if (mode != CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F &&
        mode != CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0) {
      Fail("cuBLASLt: scale mode " + std::to_string(mode) + " is not modeled by the fake");
      return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    (attr == CUBLASLT_MATMUL_DESC_A_SCALE_MODE ? it->second.a_mode : it->second.b_mode) = mode;
    return CUBLAS_STATUS_SUCCESS;
  }
  if (attr == CUBLASLT_MATMUL_DESC_FAST_ACCUM && size == sizeof(int8_t)) {
    std::memcpy(&it->second.fast_accum, buf, size);
    if (it->second.fast_accum != 0) {
      Fail("cuBLASLt: FP8 fast accumulation (CUBLASLT_MATMUL_DESC_FAST_ACCUM = 1) is not modeled");
      return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    return CUBLAS_STATUS_SUCCESS;
  }
  if ((attr == CUBLASLT_MATMUL_DESC_TRANSA || attr == CUBLASLT_MATMUL_DESC_TRANSB) &&
      size == sizeof(int32_t)) {
    int32_t v;
    std::memcpy(&v, buf, sizeof(v));
    if (v != CUBLAS_OP_N && v != CUBLAS_OP_T) {
      Fail("cuBLASLt: transpose op " + std::to_string(v) + " not modeled");
      return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    (attr == CUBLASLT_MATMUL_DESC_TRANSA ? it->second.transa : it->second.transb) = v;
    return CUBLAS_STATUS_SUCCESS;
  }
  Fail("cuBLASLt: matmul descriptor attribute " + std::to_string(attr) +
       " is not modeled by the fake");
  return CUBLAS_STATUS_NOT_SUPPORTED;
}

cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* l, cudaDataType type,
                                          uint64_t rows, uint64_t cols, int64_t ld) {
  jo::fake::Count("cublasLtMatrixLayoutCreate");
  Lock lock(S().mu);
  *l = new cublasLtMatrixLayoutOpaque_t();
  jo::fake::Layout layout;
  layout.type = type;
  layout.rows = rows;
  layout.cols = cols;
  layout.ld = ld;
  S().layouts[*l] = layout;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t l) {
  jo::fake::Count("cublasLtMatrixLayoutDestroy");
  Lock lock(S().mu);
  S().layouts.erase(l);
  delete l;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatrixLayoutSetAttribute(cublasLtMatrixLayout_t l,
                                                cublasLtMatrixLayoutAttribute_t attr,
                                                const void* buf, size_t size) {
  jo::fake::Count("cublasLtMatrixLayoutSetAttribute");
  Lock lock(S().mu);
  auto it = S().layouts.find(l);
  if (it == S().layouts.end()) return CUBLAS_STATUS_INVALID_VALUE;
  jo::fake::Layout& layout = it->second;
  if (attr == CUBLASLT_MATRIX_LAYOUT_ORDER && size == sizeof(int32_t)) {
    std::memcpy(&layout.order, buf, size);
    if (layout.order != CUBLASLT_ORDER_COL && layout.order != CUBLASLT_ORDER_ROW) {
      Fail("cuBLASLt: layout order not modeled");
      return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    return CUBLAS_STATUS_SUCCESS;
  }
  if (attr == CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT && size == sizeof(int32_t)) {
    std::memcpy(&layout.batch, buf, size);
    return CUBLAS_STATUS_SUCCESS;
  }
  if (attr == CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET && size == sizeof(int64_t)) {
    std::memcpy(&layout.stride, buf, size);
    return CUBLAS_STATUS_SUCCESS;
  }
  Fail("cuBLASLt: matrix layout attribute " + std::to_string(attr) + " (size " +
       std::to_string(size) + ") is not modeled by the fake");
  return CUBLAS_STATUS_NOT_SUPPORTED;
}

cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* p) {
  jo::fake::Count("cublasLtMatmulPreferenceCreate");
  Lock lock(S().mu);
  *p = new cublasLtMatmulPreferenceOpaque_t();
  S().prefs[*p] = jo::fake::Pref{};
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t p) {
  jo::fake::Count("cublasLtMatmulPreferenceDestroy");
  Lock lock(S().mu);
  S().prefs.erase(p);
  delete p;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t p,
                                                    cublasLtMatmulPreferenceAttributes_t attr,
                                                    const void* buf, size_t size) {
  jo::fake::Count("cublasLtMatmulPreferenceSetAttribute");
  Lock lock(S().mu);
  auto it = S().prefs.find(p);
  if (it == S().prefs.end()) return CUBLAS_STATUS_INVALID_VALUE;
  if (attr == CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES && size == sizeof(uint64_t)) {
    std::memcpy(&it->second.workspace, buf, size);
    return CUBLAS_STATUS_SUCCESS;
  }
  const cublasLtMatmulPreferenceAttributes_t align[4] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  for (int i = 0; i < 4; ++i)
    if (attr == align[i] && size == sizeof(uint32_t)) {
      std::memcpy(&it->second.align[i], buf, size);
      return CUBLAS_STATUS_SUCCESS;
    }
  Fail("cuBLASLt: preference attribute " + std::to_string(attr) + " is not modeled by the fake");
  return CUBLAS_STATUS_NOT_SUPPORTED;
}

cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t, cublasLtMatmulDesc_t d,
                                              cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                                              cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t dd,
                                              cublasLtMatmulPreference_t p, int requested,
                                              cublasLtMatmulHeuristicResult_t* results,
                                              int* count) {
  Lock lock(S().mu);
  Count("cublasLtMatmulAlgoGetHeuristic");
  if (!S().descs.count(d) || !S().layouts.count(a) || !S().layouts.count(b) ||
      !S().layouts.count(c) || !S().layouts.count(dd) || !S().prefs.count(p) || requested < 1)
    return CUBLAS_STATUS_INVALID_VALUE;
  std::memset(results, 0, sizeof(*results));
  // The fake's "algorithm" carries the alignments the preference promised.
  for (int i = 0; i < 4; ++i) results->algo.data[i] = S().prefs[p].align[i];
  results->workspaceSize = 0;
  results->state = CUBLAS_STATUS_SUCCESS;
  *count = 1;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmul(cublasLtHandle_t h, cublasLtMatmulDesc_t desc, const void* alpha,
                              const void* A, cublasLtMatrixLayout_t Adesc, const void* B,
                              cublasLtMatrixLayout_t Bdesc, const void* beta, const void* C,
                              cublasLtMatrixLayout_t Cdesc, void* D, cublasLtMatrixLayout_t Ddesc,
                              const cublasLtMatmulAlgo_t* algo, void* workspace,
                              size_t workspace_bytes, cudaStream_t s) {
  using jo::fake::Layout;
  {
    // cuBLASLt's kernel for this call: with lazy loading, its first use on a device loads it
    // (fake_waits.cc). What selects the kernel an algorithm runs is not documented; the fake
    // assumes anything of the call's form may: the compute and data types, whether C and D are
    // one buffer (in place) or two, and the alignment each matrix has — of its pointer, leading
    // dimension and batch stride, the three CUBLASLT_ALGO_CAP_MIN_ALIGNMENT_* covers (cublasLt.h),
    // up to 256 bytes. So a warm-up in another form than its call does not load the call's
    // kernel (gemm.cc runs it in the call's).
    std::string kernel = "cuBLASLt kernel";
    int device = -1;
    {
      Lock lock(S().mu);
      const void* ptrs[4] = {A, B, C, D};
      const cublasLtMatrixLayout_t layouts[4] = {Adesc, Bdesc, Cdesc, Ddesc};
      bool known = jo::fake::KnownStream(s) && algo != nullptr && S().descs.count(desc) > 0;
      for (const auto l : layouts) known = known && S().layouts.count(l) > 0;
      if (known) {
        device = s->device;
        kernel += " compute " + std::to_string(S().descs[desc].compute) + " type " +
                  std::to_string(S().layouts[Adesc].type) +
                  (C == D ? " in place" : " out of place") + ", alignments";
        for (int i = 0; i < 4; ++i) {
          const jo::fake::Layout& l = S().layouts[layouts[i]];
          bool ok = false;
          const uint64_t es = static_cast<uint64_t>(jo::DTypeSize(jo::fake::FromCuda(l.type, &ok)));
          const uint64_t bits = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(ptrs[i])) |
                                static_cast<uint64_t>(l.ld) * es |
                                (l.batch > 1 ? static_cast<uint64_t>(l.stride) * es : 0);
          uint64_t align = 256;
          while (align > 1 && bits % align != 0) align /= 2;
          kernel += " " + std::to_string(align);
        }
      }
    }
    if (device >= 0 && !jo::fake::LoadFunction(device, kernel, "cublasLtMatmul"))
      return CUBLAS_STATUS_EXECUTION_FAILED;
  }
  Lock lock(S().mu);
  Count("cublasLtMatmul");
  auto fail = [](const std::string& t) {
    Fail("cublasLtMatmul: " + t);
    return CUBLAS_STATUS_NOT_SUPPORTED;
  };
  if (!jo::fake::StreamOk(s, "cublasLtMatmul")) return CUBLAS_STATUS_INVALID_VALUE;
  if (h->device != s->device || t_device != s->device)
    return fail("handle, stream and current device differ");
  if (!S().descs.count(desc) || !S().layouts.count(Adesc) || !S().layouts.count(Bdesc) ||
      !S().layouts.count(Cdesc) || !S().layouts.count(Ddesc))
    return fail("unknown descriptor");
  const jo::fake::Desc dsc = S().descs[desc];
  const Layout la = S().layouts[Adesc], lb = S().layouts[Bdesc], lc = S().layouts[Cdesc],
               ld = S().layouts[Ddesc];
  const bool tf32 = dsc.compute == CUBLAS_COMPUTE_32F_FAST_TF32;
  if ((dsc.compute != CUBLAS_COMPUTE_32F && !tf32) || dsc.scale != CUDA_R_32F)
    return fail("only CUBLAS_COMPUTE_32F(_FAST_TF32) with CUDA_R_32F scale is modeled");
  bool ok_a = false, ok_b = false, ok_c = false, ok_d = false;
  const jo::DType ta_type = jo::fake::FromCuda(la.type, &ok_a);
  const jo::DType tb_type = jo::fake::FromCuda(lb.type, &ok_b);
  const jo::DType tc_type = jo::fake::FromCuda(lc.type, &ok_c);
  const jo::DType td_type = jo::fake::FromCuda(ld.type, &ok_d);
  if (!ok_a || !ok_b || !ok_c || !ok_d) return fail("matrix type not modeled");
  const bool fp8 = jo::IsFp8(ta_type) || jo::IsFp8(tb_type);
  if (lc.type != ld.type) return fail("C and D of different types are not modeled");
  if (jo::IsFp8(td_type)) return fail("an fp8 output (D) is not modeled");
  if (fp8) {
    // The FP8 type table: both A and B fp8, never both e5m2; C = D bf16, f16 or f32.
    if (!jo::IsFp8(ta_type) || !jo::IsFp8(tb_type))
      return fail("FP8 A with a non-FP8 B (or the reverse): cuBLAS's FP8 type table has none");
    if (ta_type == jo::DType::kF8E5M2 && tb_type == jo::DType::kF8E5M2)
      return fail("CUDA_R_8F_E5M2 x CUDA_R_8F_E5M2: not in cuBLAS's FP8 type table");
    // "The compute type must be CUBLAS_COMPUTE_32F. The scale type must be CUDA_R_32F."
    if (dsc.compute != CUBLAS_COMPUTE_32F)
      return fail("FP8 with a compute type other than CUBLAS_COMPUTE_32F");
    const int arch = jo::fake::DeviceArch(s->device);
    if (arch < 89) {
      Fail("cublasLtMatmul: FP8 on device " + std::to_string(s->device) + " (sm_" +
           std::to_string(arch) + "): FP8 kernels need compute capability 8.9 or newer");
      return CUBLAS_STATUS_ARCH_MISMATCH;
    }
    // "A must be transposed and B non-transposed (The TN format) on Ada (8.9), Hopper (9.0),
    // and Blackwell GeForce (12.x)".
    if ((arch == 89 || arch == 90 || arch / 10 == 12) &&
        (dsc.transa != CUBLAS_OP_T || dsc.transb != CUBLAS_OP_N))
      return fail("FP8 on sm_" + std::to_string(arch) +
                  " needs A transposed and B non-transposed (the TN format)");
  } else {
    // One type for A and B; C = D of it, or f32 for bf16/f16 matrices (the CUBLAS_COMPUTE_32F
    // rows of "Datatypes Supported").
    if (la.type != lb.type) return fail("mixed matrix types are not modeled");
    const bool widened = ld.type == CUDA_R_32F && (la.type == CUDA_R_16BF || la.type == CUDA_R_16F);
    if (ld.type != la.type && !widened) return fail("mixed matrix types are not modeled");
    if (dsc.a_scale != nullptr || dsc.b_scale != nullptr) {
      // "If set for an unsupported matrix data, scale, and compute type combination, calling
      // cublasLtMatmul() will return CUBLAS_INVALID_VALUE."
      Fail("cublasLtMatmul: A/B scale pointers set on a GEMM without FP8 matrices");
      return CUBLAS_STATUS_INVALID_VALUE;
    }
  }
  const bool blocks = dsc.a_mode == CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0 ||
                      dsc.b_mode == CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0;
  if (blocks) {
    // The header's rule (scale pointers "for an unsupported matrix data, scale, scale mode, and
    // compute type combination ... CUBLAS_INVALID_VALUE"): 1x32 e8m0 block scales are the MX
    // formats' (FP8 A and B), on both matrices, and read from device memory.
    if (!fp8) {
      Fail("cublasLtMatmul: VEC32_UE8M0 block scales on a GEMM without FP8 matrices");
      return CUBLAS_STATUS_INVALID_VALUE;
    }
    if (dsc.a_mode != dsc.b_mode) {
      Fail(
          "cublasLtMatmul: VEC32_UE8M0 block scales on one of A and B only (the MXFP8 "
          "row of the scaling modes overview block-scales both)");
      return CUBLAS_STATUS_INVALID_VALUE;
    }
    const int arch = jo::fake::DeviceArch(s->device);
    if (arch < 100) {
      Fail("cublasLtMatmul: VEC32_UE8M0 block scales on device " + std::to_string(s->device) +
           " (sm_" + std::to_string(arch) +
           "): block-scaled GEMMs need compute capability 10.0 or newer");
      return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    if (dsc.a_scale == nullptr || dsc.b_scale == nullptr) {
      Fail("cublasLtMatmul: VEC32_UE8M0 block scales without a scale pointer");
      return CUBLAS_STATUS_INVALID_VALUE;
    }
    if (reinterpret_cast<uintptr_t>(dsc.a_scale) % 16 != 0 ||
        reinterpret_cast<uintptr_t>(dsc.b_scale) % 16 != 0)
      return fail(
          "a block scale tensor's starting address is not 16-byte aligned (1D Block "
          "Scaling Factors Layout)");
    if (la.batch > 1) return fail("batched block-scaled GEMMs are not modeled");
  }
  // FAST_TF32 is a compute type for float32 matrices ("CUBLAS_COMPUTE_32F_FAST_TF32 ... for
  // 32-bit input and output matrices", cuBLAS docs, cublasComputeType_t).
  if (tf32 && (ta_type != jo::DType::kF32 || td_type != jo::DType::kF32))
    return fail("CUBLAS_COMPUTE_32F_FAST_TF32 with matrices that are not CUDA_R_32F");
  for (const Layout* l : {&la, &lb, &lc, &ld}) {
    if (l->order != CUBLASLT_ORDER_COL) return fail("ORDER other than COL is not modeled");
    if (l->ld < static_cast<int64_t>(l->rows))
      return fail("leading dimension smaller than the rows of a column-major layout");
    if (l->batch != la.batch) return fail("batch counts differ");
  }
  const uint64_t m = dsc.transa == CUBLAS_OP_N ? la.rows : la.cols;
  const uint64_t k = dsc.transa == CUBLAS_OP_N ? la.cols : la.rows;
  const uint64_t kb = dsc.transb == CUBLAS_OP_N ? lb.rows : lb.cols;
  const uint64_t n = dsc.transb == CUBLAS_OP_N ? lb.cols : lb.rows;
  if (k != kb || lc.rows != m || lc.cols != n || ld.rows != m || ld.cols != n)
    return fail("inconsistent dimensions");
  if (C != D && (lc.ld != ld.ld || lc.stride != ld.stride))
    return fail("C != D with different layouts (cuBLASLt's out-of-place rule)");
  const size_t es[4] = {
      static_cast<size_t>(jo::DTypeSize(ta_type)), static_cast<size_t>(jo::DTypeSize(tb_type)),
      static_cast<size_t>(jo::DTypeSize(tc_type)), static_cast<size_t>(jo::DTypeSize(td_type))};
  // The promised alignment must hold for the "buffer pointer, leading dimension,
  // and possibly other strides" (cublasLt.h, CUBLASLT_ALGO_CAP_MIN_ALIGNMENT_*):
  // every batch's matrix and every column of it starts that aligned.
  const void* ptrs[4] = {A, B, C, D};
  const Layout* layouts[4] = {&la, &lb, &lc, &ld};
  for (int i = 0; i < 4; ++i) {
    const uint64_t align = algo->data[i];
    if (reinterpret_cast<uintptr_t>(ptrs[i]) % align != 0)
      return fail("a pointer is less aligned than the preference promised");
    if (static_cast<uint64_t>(layouts[i]->ld) * es[i] % align != 0)
      return fail("a leading dimension is less aligned than the preference promised");
    if (layouts[i]->batch > 1 && static_cast<uint64_t>(layouts[i]->stride) * es[i] % align != 0)
      return fail("a batch stride is less aligned than the preference promised");
    // FP8: "pointers and matrix dimension must support 16-byte alignment" (Tensor Core Usage).
    if (fp8 && (reinterpret_cast<uintptr_t>(ptrs[i]) % 16 != 0 ||
                static_cast<uint64_t>(layouts[i]->ld) * es[i] % 16 != 0 ||
                (layouts[i]->batch > 1 && static_cast<uint64_t>(layouts[i]->stride) * es[i] % 16)))
      return fail("FP8 with a pointer, leading dimension or batch stride not 16-byte aligned");
  }
  if (fp8 && ((dsc.transa == CUBLAS_OP_N ? m : k) * es[0] % 16 != 0 ||
              (dsc.transb == CUBLAS_OP_N ? k : n) * es[1] % 16 != 0 || m * es[2] % 16 != 0))
    return fail("FP8 with matrix dimensions that are not multiples of 16 bytes");
  // The scales: device float32 values the kernel reads (null: 1), or block scale tensors of
  // the tiled layout, every padded tile (outer rows to 128, K blocks to 4).
  using jo::cuda::kScaleTileBytes;
  using jo::cuda::kScaleTileRows;
  const uint64_t k_tiles = (k + kScaleTileRows - 1) / kScaleTileRows;
  const auto tiled_bytes = [&](uint64_t outer) {
    return (outer + kScaleTileRows - 1) / kScaleTileRows * k_tiles * kScaleTileBytes;
  };
  for (int i = 0; i < 2; ++i) {
    const void* scale = i == 0 ? dsc.a_scale : dsc.b_scale;
    const size_t bytes = blocks ? tiled_bytes(i == 0 ? m : n) : sizeof(float);
    if (scale != nullptr &&
        !jo::fake::CheckAccess(scale, bytes, s->device, "cublasLtMatmul scale pointer"))
      return CUBLAS_STATUS_INVALID_VALUE;
  }
  (void)workspace;
  (void)workspace_bytes;
  const float fa = *static_cast<const float*>(alpha), fb = *static_cast<const float*>(beta);
  if (!jo::fake::CheckAccess(A, static_cast<size_t>(Extent(la)) * es[0], s->device,
                             "cublasLtMatmul A") ||
      !jo::fake::CheckAccess(B, static_cast<size_t>(Extent(lb)) * es[1], s->device,
                             "cublasLtMatmul B") ||
      (fb != 0.0f && !jo::fake::CheckAccess(C, static_cast<size_t>(Extent(lc)) * es[2], s->device,
                                            "cublasLtMatmul C")) ||
      !jo::fake::CheckAccess(D, static_cast<size_t>(Extent(ld)) * es[3], s->device,
                             "cublasLtMatmul D"))
    return CUBLAS_STATUS_INVALID_VALUE;
  const int32_t ta = dsc.transa, tb = dsc.transb;
  // FP8: the accumulator of this device's tensor cores, each operand's smallest exponent.
  const jo::fake::Fp8TensorCore core = jo::fake::Fp8TensorCoreOf(jo::fake::DeviceArch(s->device));
  const auto min_exponent = [](jo::DType t) {
    return t == jo::DType::kF8E5M2 ? jo::fake::kE5M2MinExponent : jo::fake::kE4M3MinExponent;
  };
  const int a_min = min_exponent(ta_type), b_min = min_exponent(tb_type);
  const float* a_scale = static_cast<const float*>(dsc.a_scale);
  const float* b_scale = static_cast<const float*>(dsc.b_scale);
  jo::fake::EnqueueKernel(s, "cublasLtMatmul", [=] {
    auto at = [&](jo::DType dt, const void* base, const Layout& l, int64_t bt, uint64_t r,
                  uint64_t c) {  // column-major element
      return jo::LoadElement(
          dt, static_cast<const std::byte*>(base),
          bt * l.stride + static_cast<int64_t>(c) * l.ld + static_cast<int64_t>(r));
    };
    // Read now: the scale may be what an earlier task of this stream received.
    const float scale =
        blocks ? 1.0f
               : (a_scale != nullptr ? *a_scale : 1.0f) * (b_scale != nullptr ? *b_scale : 1.0f);
    // Block scales: the e8m0 exponent of (outer row r, K block j) in the tiled layout.
    const auto block_exponent = [&](const float* tensor, uint64_t r, uint64_t j) {
      const size_t at = jo::cuda::TiledScaleOffset(r, j, k_tiles);
      return static_cast<int>(reinterpret_cast<const uint8_t*>(tensor)[at]);
    };
    std::vector<float> out(m * n);
    for (int64_t bt = 0; bt < la.batch; ++bt) {
      for (uint64_t i = 0; i < m; ++i)
        for (uint64_t j = 0; j < n; ++j) {
          float acc = 0.0f;
          jo::fake::Fp8Accumulator fp8_acc(core, a_min, b_min);
          for (uint64_t p = 0; p < k; ++p) {
            const float av =
                ta == CUBLAS_OP_N ? at(ta_type, A, la, bt, i, p) : at(ta_type, A, la, bt, p, i);
            const float bv =
                tb == CUBLAS_OP_N ? at(tb_type, B, lb, bt, p, j) : at(tb_type, B, lb, bt, j, p);
            if (blocks) {  // 2^(e - 127) each; e = 0xFF is NaN
              const int ea = block_exponent(a_scale, i, p / 32);
              const int eb = block_exponent(b_scale, j, p / 32);
              if (ea == 0xFF || eb == 0xFF) {
                fp8_acc.Add(std::nanf(""), bv);
              } else {
                fp8_acc.AddScaled(av, bv, ea + eb - 254);
              }
            } else if (fp8) {
              fp8_acc.Add(av, bv);
            } else {
              acc += tf32 ? jo::fake::ToTf32(av) * jo::fake::ToTf32(bv) : av * bv;
            }
          }
          if (fp8) acc = fp8_acc.Result();
          out[i * n + j] =
              fa * scale * acc + (fb != 0.0f ? fb * at(tc_type, C, lc, bt, i, j) : 0.0f);
        }
      for (uint64_t i = 0; i < m; ++i)
        for (uint64_t j = 0; j < n; ++j)
          jo::StoreElement(
              td_type, static_cast<std::byte*>(D),
              bt * ld.stride + static_cast<int64_t>(j) * ld.ld + static_cast<int64_t>(i),
              out[i * n + j]);
    }
  });
  return CUBLAS_STATUS_SUCCESS;
}
