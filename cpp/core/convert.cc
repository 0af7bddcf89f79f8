#include "core/convert.h"

#include <cmath>
#include <cstring>

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

}  // namespace

float LoadElement(DType dtype, const void* base, int64_t i) {
  switch (dtype) {
    case DType::kF32:
      return static_cast<const float*>(base)[i];
    case DType::kBF16:
      return Bf16ToF32(static_cast<const uint16_t*>(base)[i]);
    case DType::kF16:
      return F16ToF32(static_cast<const uint16_t*>(base)[i]);
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

}  // namespace jo
