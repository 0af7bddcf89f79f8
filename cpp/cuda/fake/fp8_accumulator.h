// The FP8 tensor cores' accumulator, as the fake computes an FP8 GEMM (the fake
// cuBLASLt's, fake_cublaslt.cc, and any tile-level fake of an FP8 kernel): one
// place, so that every fake FP8 GEMM adds its products as the GPU it pretends to
// be does.
//
// What is documented:
//  * DeepSeek-V3 technical report (arXiv 2412.19437), §3.3.2: "the accumulation
//    precision of FP8 GEMM on NVIDIA H800 GPUs is limited to retaining around 14
//    bits"; §3.5.2: "After aligning 32 mantissa products by right-shifting based
//    on the maximum exponent, the Tensor Core only uses the highest 14 bits of
//    each mantissa product for addition, and truncates bits exceeding this range.
//    The accumulation of addition results into registers also employs 14-bit
//    precision."
//  * Khattak and Mikaitis, "Accurate Models of NVIDIA Tensor Cores" (arXiv
//    2512.07004), and its released bit-accurate models
//    (github.com/north-numerical-computing/MATLAB-tensor-core at b12b5a7,
//    models/H100TC.m, L40STC.m, AdaTC.m, B200TC.m, RTXPRO6000TC.m and
//    models/tools/Generic_BFMA_TC.m, GEMM.m): per tensor-core step ("block FMA")
//    the products of a block of K elements and the running sum c are aligned to
//    the largest exponent among them (global_alignment = 1), each aligned
//    significand truncated (no sticky bit) to 23 + neab bits below it, the exact
//    sum of those normalised and truncated (rounded toward zero, frmode 'rz' for
//    a float32 result) to 23 + min(neab, 0) fraction bits; c is the previous
//    step's result (recursive accumulation). FP8 inputs: H100 block 32, neab
//    -10 (13 fraction bits: DeepSeek's "14 bits" with the leading one); L40S
//    and Ada (compute capability 8.9) block 16, neab -10; B200 (and the RTX PRO
//    6000, which the models map to it) block 32, neab 2 (float32's 23 fraction
//    bits, still truncating). Products are exact (an fp8 significand has at most
//    4 bits), kept denormalised (denorm_prd = 1: a product's exponent is the sum
//    of its factors', each at least the format's smallest normal exponent).
//  * Promotion: cuBLASLt documents only that without fast accumulation
//    "intermediate results will ... periodically be promoted to a higher
//    precision" (cublasLt.h, CUBLASLT_MATMUL_DESC_FAST_ACCUM, whose default 0
//    the executor keeps); the interval is not documented. CUTLASS's sm90 FP8
//    mainloop promotes every `mma_promotion_interval = 4` MMAs (CUTLASS 4.2,
//    include/cutlass/gemm/collective/sm90_mma_tma_gmma_ss_warpspecialized_fp8.hpp,
//    and fp8_accumulation.hpp: the tensor-core accumulator is added to a float32
//    one and zeroed), 4 x K 32 = 128 elements, the interval the DeepSeek-V3
//    report chose (N_C = 128). The fake promotes every 128 K elements, adding
//    the tensor-core sum into a float32 accumulator (round to nearest) and
//    restarting it at zero, and at the end; a GPU whose cuBLASLt promotes less
//    often is less accurate for K > 128 (the selftest's FP8 rows have K 48).
// Exact float32 accumulation is modelled nowhere: no source says any of these
// GPUs has it. Split-K (partial sums of K ranges reduced in float32) is not
// modelled: it can only promote more often.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace jo::fake {

// One GPU generation's FP8 block FMA.
struct Fp8TensorCore {
  int block = 32;        // products added in one step, with the running sum
  int extra_bits = -10;  // neab: aligned significands keep 23 + extra_bits bits
  int promotion = 128;   // K elements between promotions into float32
  // Fraction bits of a step's result (its own leading one not counted).
  int FractionBits() const { return 23 + std::min(extra_bits, 0); }
};

// The tensor core of compute capability `arch` (10 * major + minor) for FP8 inputs.
inline Fp8TensorCore Fp8TensorCoreOf(int arch) {
  Fp8TensorCore core;
  if (arch < 90) {
    core.block = 16;  // Ada (L40STC.m, AdaTC.m)
  } else if (arch >= 100) {
    core.extra_bits = 2;  // B200TC.m (RTXPRO6000TC.m calls it)
  }
  return core;  // Hopper (H100TC.m)
}

// The smallest normal exponent of an FP8 format (1 - bias): e4m3 -6, e5m2 -14.
constexpr int kE4M3MinExponent = -6;
constexpr int kE5M2MinExponent = -14;

// sum_p a[p] * b[p] over K in order, as the tensor cores of `core` compute it:
// Add() every pair, then Result().
class Fp8Accumulator {
 public:
  // `a_min_exponent`, `b_min_exponent`: the formats' smallest normal exponents.
  Fp8Accumulator(const Fp8TensorCore& core, int a_min_exponent, int b_min_exponent)
      : core_(core), a_min_(a_min_exponent), b_min_(b_min_exponent) {}

  void Add(float a, float b) { AddScaled(a, b, 0); }

  // a * b * 2^shift: an MXFP8 product, its operands' e8m0 block scales 2^shift together
  // (their exponents added: the block FMA aligns the dequantized products).
  void AddScaled(float a, float b, int shift) {
    if (!std::isfinite(a) || !std::isfinite(b)) non_finite_ = true;
    naive_ += static_cast<float>(static_cast<double>(a) * b * std::ldexp(1.0, shift));
    if (a != 0.0f && b != 0.0f) {
      products_[count_] = static_cast<double>(a) * static_cast<double>(b) *
                          std::ldexp(1.0, shift);  // exact (|shift| <= 254: a double's range)
      exponents_[count_] = Exponent(a, a_min_) + Exponent(b, b_min_) + shift;
      ++count_;
    }
    if (++in_block_ == core_.block) Step();
    if (++in_window_ == core_.promotion) Promote();
  }

  float Result() {
    if (non_finite_) return naive_;
    Step();
    Promote();
    return main_;
  }

 private:
  static constexpr int kMaxBlock = 32;

  // floor(log2 |v|), at least `min_exponent` (a subnormal's exponent is the format's smallest).
  static int Exponent(double v, int min_exponent) {
    int e = 0;
    (void)std::frexp(v, &e);
    return std::max(e - 1, min_exponent);
  }

  // One block FMA: the block's products and c aligned to their largest exponent, truncated,
  // summed exactly, the sum truncated to FractionBits().
  void Step() {
    if (count_ == 0 && c_ == 0.0f) {
      in_block_ = 0;
      return;
    }
    int top = std::numeric_limits<int>::min();
    for (int i = 0; i < count_; ++i) top = std::max(top, exponents_[i]);
    if (c_ != 0.0f) top = std::max(top, Exponent(c_, -126));
    const double ulp = std::ldexp(1.0, top - 23 - core_.extra_bits);
    const auto truncated = [&](double v) {
      return std::copysign(std::floor(std::fabs(v) / ulp), v);
    };
    double units = c_ != 0.0f ? truncated(c_) : 0.0;  // integers below 2^40: exact
    for (int i = 0; i < count_; ++i) units += truncated(products_[i]);
    double sum = units * ulp;
    if (sum != 0.0) {
      int e = 0;
      (void)std::frexp(sum, &e);
      const double quantum = std::ldexp(1.0, e - 1 - core_.FractionBits());
      sum = std::trunc(sum / quantum) * quantum;
    }
    c_ = static_cast<float>(sum);  // at most 24 significant bits: exact
    count_ = 0;
    in_block_ = 0;
  }

  // The tensor-core sum added into the float32 accumulator, and restarted.
  void Promote() {
    Step();
    main_ += c_;
    c_ = 0.0f;
    in_window_ = 0;
  }

  Fp8TensorCore core_;
  int a_min_, b_min_;
  double products_[kMaxBlock] = {};
  int exponents_[kMaxBlock] = {};
  int count_ = 0;      // nonzero products of the current block
  int in_block_ = 0;   // K elements of the current block
  int in_window_ = 0;  // K elements since the last promotion
  float c_ = 0.0f;     // the tensor-core accumulator
  float main_ = 0.0f;  // the float32 accumulator promotions add into
  float naive_ = 0.0f;
  bool non_finite_ = false;
};

}  // namespace jo::fake
