// Sixteen float32 lanes in GCC's vector extension (one AVX-512 register where the
// CPU has them, else what the compiler makes of them), and bfloat16's bits read
// as float32, shared by the linear operators: fp8_linear.cpp, fp4_linear.cpp and
// int8_linear.cpp.
#pragma once

#include <cstdint>
#include <cstring>

namespace deepinfer_vec16 {

using f32x16 = float __attribute__((vector_size(64)));
using u32x16 = uint32_t __attribute__((vector_size(64)));
constexpr int64_t kLanes = 16;

inline f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline float sum16(f32x16 v) {
  float total = 0.0f;
  for (int64_t i = 0; i < kLanes; ++i) total += v[i];
  return total;
}

// The float32 value of bfloat16 bits (its top half).
inline float bf16_value(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &wide, sizeof f);
  return f;
}

}  // namespace deepinfer_vec16
