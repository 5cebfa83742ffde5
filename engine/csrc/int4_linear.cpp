// A few rows of activations times an int4 weight with one scale per group of a
// row (weight-only int4, engine/layers/quantization/int_weight.py), read half a
// byte a weight; and the weight itself, dequantized, for a prompt's many rows.
//
// The codes are q + 8, two to a byte: column 2i in the low four bits of byte i,
// column 2i + 1 in the high four. Each task takes some output rows, and widens
// 32 codes at a time (16 bytes) in registers, multiplying them by every
// activation row; a group's sum is multiplied by its scale, and added to the
// row's sum. A decode step is bound by reading the weight, and this reads it once
// for up to eight activation rows. With bfloat16 activations and AVX-512's
// bfloat16 dot product, the codes become bfloat16 values in column order and meet
// the activations as they are; otherwise the activations are split once, per
// call, into their even and odd columns, in float32, and the codes widened to
// two vectors of float32.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "vec16.h"

namespace {

using namespace deepinfer_vec16;

using u8x16 = uint8_t __attribute__((vector_size(16)));
using i32x16 = int32_t __attribute__((vector_size(64)));
constexpr int64_t kRows = 8;  // activation rows multiplied per pass over a weight row
constexpr int64_t kChunk = 32;  // columns (16 bytes) widened at a time

// The codes of 16 bytes as q, widened to float32: columns 2i (low) and 2i + 1 (high).
inline void widen32(const uint8_t* p, f32x16& even, f32x16& odd) {
#if defined(__AVX512F__)  // GCC lowers the generic widening to one extract per byte
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  i32x16 codes;
  std::memcpy(&codes, &v, sizeof codes);
#else
  u8x16 bytes;
  std::memcpy(&bytes, p, sizeof bytes);
  const i32x16 codes = __builtin_convertvector(bytes, i32x16);
#endif
  even = __builtin_convertvector((codes & 15) - 8, f32x16);
  odd = __builtin_convertvector((codes >> 4) - 8, f32x16);
}

// R rows of split activations (xe even columns, xo odd, each K / 2 a row) times
// one code row c (K / 2 bytes) with its G scales s, written to out (N apart).
template <int R>
void row_times(const float* xe, const float* xo, int64_t K, const uint8_t* c, const float* s,
               int64_t G, float* out, int64_t N) {
  const int64_t half = K / 2, group = K / G;
  f32x16 total[R] = {};
  for (int64_t g = 0; g < G; ++g) {
    f32x16 part[R] = {};
    for (int64_t k = g * group; k < (g + 1) * group; k += kChunk) {
      f32x16 even, odd;
      widen32(c + k / 2, even, odd);
      for (int m = 0; m < R; ++m) {
        part[m] += even * load16(xe + m * half + k / 2) + odd * load16(xo + m * half + k / 2);
      }
    }
    for (int m = 0; m < R; ++m) total[m] += part[m] * s[g];
  }
  for (int m = 0; m < R; ++m) out[m * N] = sum16(total[m]);
}

// What each code c (0..15) stands for in a group of this scale: (c - 8) times
// the scale, formed in float32 and rounded once to T; written twice over, 32
// values, so that a 16-bit permute can index the table with a code's 5 low bits.
template <typename T>
void code_values(float scale, T* value) {
  for (int i = 0; i < 32; ++i) value[i] = static_cast<T>(static_cast<float>((i & 15) - 8) * scale);
}

#if defined(__AVX512BW__)
// The 16-bit values that the 32 codes of 16 bytes pick from table, in column
// order: each 32-bit lane holds columns 2i and 2i + 1, its byte's low four bits
// in the low half and its high four in the high half, then one permute looks
// all 32 up.
inline __m512i look_up32(const uint8_t* p, __m512i table) {
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i split = _mm512_or_si512(_mm512_and_si512(v, _mm512_set1_epi32(0xF)),
                                        _mm512_and_si512(_mm512_slli_epi32(v, 12),
                                                         _mm512_set1_epi32(0xF0000)));
  return _mm512_permutexvar_epi16(split, table);
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// bfloat16 activations, on a CPU with AVX-512's bfloat16 dot product: the codes
// of 16 bytes become the bfloat16 values of q (a table of scale 1: exact, small
// whole numbers) in column order, so that they meet the activations as they are,
// and each pair is multiplied and summed exactly by the dot product.
inline __m512bh codes_bf16(const uint8_t* p, __m512i table) {
  return reinterpret_cast<__m512bh>(look_up32(p, table));
}

inline __m512i q_table() {
  at::BFloat16 value[32];
  code_values(1.0f, value);
  return _mm512_loadu_si512(value);
}

template <int R>
void row_times_bf16(const uint16_t* x, int64_t K, const uint8_t* c, const float* s, int64_t G,
                    float* out, int64_t N, __m512i table) {
  const int64_t group = K / G;
  __m512 total[R];
  for (int m = 0; m < R; ++m) total[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512 part[R];
    for (int m = 0; m < R; ++m) part[m] = _mm512_setzero_ps();
    for (int64_t k = g * group; k < (g + 1) * group; k += kChunk) {
      const __m512bh w = codes_bf16(c + k / 2, table);
      for (int m = 0; m < R; ++m) {
        const __m512i xs = _mm512_loadu_si512(x + m * K + k);
        part[m] = _mm512_dpbf16_ps(part[m], w, reinterpret_cast<__m512bh>(xs));
      }
    }
    const __m512 scale = _mm512_set1_ps(s[g]);
    for (int m = 0; m < R; ++m) total[m] = _mm512_fmadd_ps(part[m], scale, total[m]);
  }
  for (int m = 0; m < R; ++m) out[m * N] = _mm512_reduce_add_ps(total[m]);
}

using RowTimesBf16 = void (*)(const uint16_t*, int64_t, const uint8_t*, const float*, int64_t,
                              float*, int64_t, __m512i);
constexpr RowTimesBf16 kRowTimesBf16[kRows] = {
    row_times_bf16<1>, row_times_bf16<2>, row_times_bf16<3>, row_times_bf16<4>,
    row_times_bf16<5>, row_times_bf16<6>, row_times_bf16<7>, row_times_bf16<8>};
#define DEEPINFER_INT4_BF16_DOT 1
#endif

using RowTimes = void (*)(const float*, const float*, int64_t, const uint8_t*, const float*,
                          int64_t, float*, int64_t);
constexpr RowTimes kRowTimes[kRows] = {row_times<1>, row_times<2>, row_times<3>, row_times<4>,
                                       row_times<5>, row_times<6>, row_times<7>, row_times<8>};

at::Tensor int4_gemv(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && codes.dim() == 2 && scales.dim() == 2,
              "int4_gemv: x, codes and scales 2-d");
  TORCH_CHECK(codes.scalar_type() == at::kByte, "int4_gemv: codes two to a byte (uint8)");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0), G = scales.size(1);
  TORCH_CHECK(codes.size(1) * 2 == K && scales.size(0) == N, "int4_gemv: shapes do not agree");
  TORCH_CHECK(G > 0 && K % G == 0 && (K / G) % kChunk == 0,
              "int4_gemv: groups of a multiple of 32 columns");
  const at::Tensor cc = codes.contiguous(), sc = scales.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({M, N}, x.options().dtype(at::kFloat));
  const uint8_t* cp = cc.data_ptr<uint8_t>();
  const float* sp = sc.data_ptr<float>();
  float* yp = out.data_ptr<float>();
#if defined(DEEPINFER_INT4_BF16_DOT)
  if (x.scalar_type() == at::kBFloat16) {
    const at::Tensor xc = x.contiguous();
    const uint16_t* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr());
    const __m512i table = q_table();
    at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) {
        for (int64_t m = 0; m < M; m += kRows) {
          const int64_t rows = std::min(kRows, M - m);
          kRowTimesBf16[rows - 1](xp + m * K, K, cp + n * (K / 2), sp + n * G, G,
                                  yp + m * N + n, N, table);
        }
      }
    });
    return out.to(x.scalar_type());
  }
#endif
  // even and odd columns, each [M, K / 2], float32
  const at::Tensor pairs = x.to(at::kFloat).reshape({M, K / 2, 2});
  const at::Tensor xe = pairs.select(2, 0).contiguous(), xo = pairs.select(2, 1).contiguous();
  const float *ep = xe.data_ptr<float>(), *op = xo.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t m = 0; m < M; m += kRows) {
        const int64_t rows = std::min(kRows, M - m), at = m * (K / 2);
        kRowTimes[rows - 1](ep + at, op + at, K, cp + n * (K / 2), sp + n * G, G, yp + m * N + n,
                            N);
      }
    }
  });
  return out.to(x.scalar_type());
}

// The weight the codes stand for, in the scales' dtype, for a prompt's many rows,
// which a dense matmul then multiplies. Each group has 16 values, (c - 8) times
// its scale, formed in float32 and rounded once; every code looks its value up.
// For bfloat16, one permute looks up the 32 codes of 16 bytes, in column order.
template <typename T>
void dequantize_row(const uint8_t* c, const T* s, int64_t K, int64_t G, T* w) {
  const int64_t group = K / G;
  for (int64_t g = 0; g < G; ++g) {
    T value[32];
    code_values(static_cast<float>(s[g]), value);
    int64_t k = g * group;
#if defined(__AVX512BW__)
    if constexpr (sizeof(T) == 2) {
      const __m512i table = _mm512_loadu_si512(value);
      for (; k + kChunk <= (g + 1) * group; k += kChunk) {
        _mm512_storeu_si512(w + k, look_up32(c + k / 2, table));
      }
    }
#endif
    for (; k < (g + 1) * group; k += 2) {
      w[k] = value[c[k / 2] & 15];
      w[k + 1] = value[c[k / 2] >> 4];
    }
  }
}

at::Tensor int4_dequantize(const at::Tensor& codes, const at::Tensor& scales) {
  TORCH_CHECK(codes.dim() == 2 && scales.dim() == 2 && codes.size(0) == scales.size(0),
              "int4_dequantize: codes [rows, cols / 2], scales [rows, groups]");
  TORCH_CHECK(codes.scalar_type() == at::kByte, "int4_dequantize: codes two to a byte (uint8)");
  const int64_t N = codes.size(0), K = 2 * codes.size(1), G = scales.size(1);
  TORCH_CHECK(G > 0 && K % G == 0 && (K / G) % 2 == 0, "int4_dequantize: whole groups");
  const at::Tensor cc = codes.contiguous(), sc = scales.contiguous();
  at::Tensor out = at::empty({N, K}, scales.options());
  // Not float16: under -ffast-math, c10's float-to-half rounding goes wrong on a CPU
  // without F16C (a portable build); int_weight.py takes torch's way for it.
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, out.scalar_type(), "int4_dequantize", [&] {
    const uint8_t* cp = cc.data_ptr<uint8_t>();
    const scalar_t* sp = sc.data_ptr<scalar_t>();
    scalar_t* wp = out.data_ptr<scalar_t>();
    at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) {
        dequantize_row(cp + n * (K / 2), sp + n * G, K, G, wp + n * K);
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deepinfer, m) {
  m.def("int4_gemv(Tensor x, Tensor codes, Tensor scales) -> Tensor");
  m.def("int4_dequantize(Tensor codes, Tensor scales) -> Tensor");
}

TORCH_LIBRARY_IMPL(deepinfer, CPU, m) {
  m.impl("int4_gemv", &int4_gemv);
  m.impl("int4_dequantize", &int4_dequantize);
}
