#include "core/convert.h"

#include <array>
#include <cmath>
#include <cstring>
#include <limits>

namespace jo {
namespace {

uint32_t Bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}
float FromBits(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

float Bf16ToF32(uint16_t h) { return FromBits(static_cast<uint32_t>(h) << 16); }

uint16_t F32ToBf16(float value) {
  uint32_t bits = Bits(value);
  if (std::isnan(value)) return static_cast<uint16_t>((bits >> 16) | 0x40);  // keep it a NaN
  bits += 0x7fff + ((bits >> 16) & 1);  // round to nearest even
  return static_cast<uint16_t>(bits >> 16);
}

float F16ToF32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exponent = (h >> 10) & 0x1f;
  const uint32_t mantissa = h & 0x3ff;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24
    const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
    return sign ? -magnitude : magnitude;
  }
  if (exponent == 31) return FromBits(sign | 0x7f800000 | (mantissa << 13));  // inf / nan
  return FromBits(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

uint16_t F32ToF16(float value) {
  const uint32_t bits = Bits(value);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000);
  const float magnitude = std::fabs(value);
  if (std::isnan(value)) return static_cast<uint16_t>(sign | 0x7e00);
  if (magnitude >= 65520.0f) return static_cast<uint16_t>(sign | 0x7c00);  // rounds to inf
  if (magnitude < 6.103515625e-05f) {
    // Subnormal range: round magnitude / 2^-24 to the nearest even integer.
    const float scaled = std::nearbyint(std::ldexp(magnitude, 24));  // FE_TONEAREST default
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(scaled));
  }
  const uint32_t abs_bits = bits & 0x7fffffff;
  // Rebias the exponent (127 -> 15) and round the 13 dropped bits to nearest even.
  uint32_t rounded = abs_bits + 0xfff + ((abs_bits >> 13) & 1);
  return static_cast<uint16_t>(sign | ((rounded >> 13) - (112u << 10)));
}

// OCP 8-bit floating point (OFP8, "OCP 8-bit Floating Point Specification"
// v1.0), as JAX's float8_e4m3fn and float8_e5m2 (ml_dtypes): E4M3 has bias 7,
// no infinities and one NaN per sign (S.1111.111), largest 448; E5M2 is
// IEEE-like (bias 15, S.11111.00 infinite, S.11111.xx NaN), largest 57344.
struct Fp8Format {
  int mantissa_bits;
  int bias;
  bool ieee;  // E5M2: an all-ones exponent is inf / NaN; E4M3: only S.1111.111 is NaN
};
constexpr Fp8Format kE4M3{3, 7, false};
constexpr Fp8Format kE5M2{2, 15, true};

float DecodeFp8(const Fp8Format& f, uint8_t bits) {
  const int m = f.mantissa_bits;
  const bool negative = (bits & 0x80) != 0;
  const int exponent = (bits & 0x7f) >> m;
  const int mantissa = bits & ((1 << m) - 1);
  const int top = (1 << (7 - m)) - 1;  // the all-ones exponent
  float magnitude;
  if (f.ieee && exponent == top) {
    magnitude = mantissa == 0 ? INFINITY : NAN;
  } else if (!f.ieee && exponent == top && mantissa == (1 << m) - 1) {
    magnitude = NAN;
  } else if (exponent == 0) {  // zero or subnormal: mantissa * 2^(1 - bias - m)
    magnitude = std::ldexp(static_cast<float>(mantissa), 1 - f.bias - m);
  } else {
    magnitude = std::ldexp(static_cast<float>((1 << m) + mantissa), exponent - f.bias - m);
  }
  return negative ? -magnitude : magnitude;
}

// Round to nearest, ties to even (FE_TONEAREST, the default mode); past the
// largest finite value: NaN for E4M3 (it has no infinity), inf for E5M2 — as
// ml_dtypes converts.
uint8_t EncodeFp8(const Fp8Format& f, float value) {
  const int m = f.mantissa_bits;
  const uint8_t sign = std::signbit(value) ? 0x80 : 0x00;
  const int top = (1 << (7 - m)) - 1;
  const uint8_t nan = static_cast<uint8_t>(0x7f);
  const uint8_t inf = static_cast<uint8_t>(top << m);
  if (std::isnan(value)) return static_cast<uint8_t>(sign | nan);
  const double a = std::fabs(static_cast<double>(value));
  if (a == 0.0) return sign;
  int e = std::ilogb(a);  // a = 1.x * 2^e
  const int min_normal = 1 - f.bias;
  int exponent, mantissa;
  if (e < min_normal) {  // subnormal: a / 2^(min_normal - m), rounded
    const double n = std::nearbyint(std::ldexp(a, m - min_normal));
    exponent = n >= (1 << m) ? 1 : 0;  // rounded up into the normals
    mantissa = static_cast<int>(n) & ((1 << m) - 1);
  } else {
    double n = std::nearbyint(std::ldexp(a, m - e));  // in [2^m, 2^(m+1)]
    if (n >= (2 << m)) {
      ++e;
      n = 1 << m;
    }
    exponent = e + f.bias;
    mantissa = static_cast<int>(n) - (1 << m);
  }
  const bool overflow =
      f.ieee ? exponent >= top : exponent > top || (exponent == top && mantissa == (1 << m) - 1);
  if (overflow) return static_cast<uint8_t>(sign | (f.ieee ? inf : nan));
  return static_cast<uint8_t>(sign | (exponent << m) | mantissa);
}

// Every fp8 value decoded once (256 entries per format).
const float* Fp8Table(DType dtype) {
  static const auto* tables = [] {
    auto* t = new float[2][256];
    for (int b = 0; b < 256; ++b) {
      t[0][b] = DecodeFp8(kE4M3, static_cast<uint8_t>(b));
      t[1][b] = DecodeFp8(kE5M2, static_cast<uint8_t>(b));
    }
    return t;
  }();
  return tables[dtype == DType::kF8E4M3 ? 0 : 1];
}

}  // namespace

float LoadElement(DType dtype, const void* base, int64_t i) {
  switch (dtype) {
    case DType::kF32:
      return static_cast<const float*>(base)[i];
    case DType::kBF16:
      return Bf16ToF32(static_cast<const uint16_t*>(base)[i]);
    case DType::kF16:
      return F16ToF32(static_cast<const uint16_t*>(base)[i]);
    case DType::kF8E4M3:
    case DType::kF8E5M2:
      return Fp8Table(dtype)[static_cast<const uint8_t*>(base)[i]];
  }
  return 0.0f;
}

void StoreElement(DType dtype, void* base, int64_t i, float value) {
  switch (dtype) {
    case DType::kF32:
      static_cast<float*>(base)[i] = value;
      break;
    case DType::kBF16:
      static_cast<uint16_t*>(base)[i] = F32ToBf16(value);
      break;
    case DType::kF16:
      static_cast<uint16_t*>(base)[i] = F32ToF16(value);
      break;
    case DType::kF8E4M3:
      static_cast<uint8_t*>(base)[i] = EncodeFp8(kE4M3, value);
      break;
    case DType::kF8E5M2:
      static_cast<uint8_t*>(base)[i] = EncodeFp8(kE5M2, value);
      break;
  }
}

void ToF32(DType dtype, const void* src, int64_t ld, int64_t rows, int64_t cols, float* dst) {
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) dst[i * cols + j] = LoadElement(dtype, src, i * ld + j);
}

void FromF32(DType dtype, const float* src, int64_t rows, int64_t cols, void* dst, int64_t ld) {
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) StoreElement(dtype, dst, i * ld + j, src[i * cols + j]);
}

float E8m0ToF32(uint8_t bits) {
  // Every e8m0 value decoded once: the host GEMMs scale each element of their operands.
  static const std::array<float, 256> kValues = [] {
    std::array<float, 256> values{};
    for (int e = 0; e < 255; ++e) values[e] = std::ldexp(1.0f, e - 127);
    values[255] = std::numeric_limits<float>::quiet_NaN();
    return values;
  }();
  return kValues[bits];
}

void ApplyBlockScales(float* block, int64_t rows, int64_t cols, const uint8_t* scales, int64_t ld,
                      bool along_rows) {
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j)
      block[i * cols + j] *= E8m0ToF32(along_rows ? scales[(i / kScaleBlock) * ld + j]
                                                  : scales[i * ld + j / kScaleBlock]);
}

}  // namespace jo
