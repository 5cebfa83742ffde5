// DeepSeek-V4's FP4 experts, read half a byte a weight.
//
// A weight row is K e2m1 codes packed two to a byte (column 2j in the low four
// bits of byte j, column 2j + 1 in the high four), with one scale per group of 32
// columns: a float32, or a float8_e8m0fnu byte (2^(b - 127)). Each group of 16
// bytes is decoded into 32 float32 values in registers (a 16-entry table looked
// up by each nibble), multiplied by the group's scale (exact for a power of two)
// and used at once: multiplied by every activation row, four weight rows at a
// time, so that each activation vector is loaded once for four (fp4_gemv, a decode step),
// or stored as float32 or bfloat16 (fp4_dequantize, the tiles of a many-token
// matmul, engine/layers/quantization/fp4.py). A row whose columns are not a
// multiple of 32 ends in a partial group, decoded a byte at a time.

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

constexpr int64_t kGroup = 32;  // columns that share a scale
constexpr int64_t kRows = 4;    // activation rows multiplied per pass over the weight rows
constexpr float kE2M1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                             -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

// The 32 values of 16 bytes, columns 0-15 in lo and 16-31 in hi.
#if defined(__AVX512F__)
inline void decode32(const uint8_t* p, f32x16& lo, f32x16& hi) {
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512 table = _mm512_loadu_ps(kE2M1);
  const __m512 even = _mm512_permutexvar_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)), table);
  const __m512 odd = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
  const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i second =
      _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  lo = reinterpret_cast<f32x16>(_mm512_permutex2var_ps(even, first, odd));
  hi = reinterpret_cast<f32x16>(_mm512_permutex2var_ps(even, second, odd));
}
#else
inline void decode32(const uint8_t* p, f32x16& lo, f32x16& hi) {
  for (int64_t j = 0; j < 8; ++j) {
    lo[2 * j] = kE2M1[p[j] & 15];
    lo[2 * j + 1] = kE2M1[p[j] >> 4];
    hi[2 * j] = kE2M1[p[8 + j] & 15];
    hi[2 * j + 1] = kE2M1[p[8 + j] >> 4];
  }
}
#endif

// Group g's scale: float32, or an e8m0 byte b, 2^(b - 127) (b = 0 is a float32
// subnormal; 255, NaN, is refused at load).
inline float scale_of(const uint8_t* scales, bool e8m0, int64_t g) {
  if (!e8m0) {
    float s;
    std::memcpy(&s, scales + 4 * g, sizeof s);
    return s;
  }
  const uint32_t b = scales[g];
  const uint32_t bits = b == 0 ? 0x00400000u : b << 23;
  float s;
  std::memcpy(&s, &bits, sizeof s);
  return s;
}

// R rows of x (float32, K apart) times W consecutive packed weight rows (K / 2
// bytes apart, their scales row_bytes apart), written to out[m * N + w]. Each group
// of every weight row is decoded once and each activation vector loaded once for
// all W rows: W * R sums in registers (R and W are template parameters).
template <int R, int W>
void rows_times(const float* x, int64_t K, const uint8_t* q, const uint8_t* scales,
                int64_t row_bytes, bool e8m0, float* out, int64_t N) {
  f32x16 acc[W][R] = {};
  float tail[W][R] = {};
  const int64_t full = K / kGroup * kGroup;
  for (int64_t k = 0; k < full; k += kGroup) {
    f32x16 lo[W], hi[W];
    for (int w = 0; w < W; ++w) {
      decode32(q + w * (K / 2) + k / 2, lo[w], hi[w]);
      const float s = scale_of(scales + w * row_bytes, e8m0, k / kGroup);
      lo[w] *= s;
      hi[w] *= s;
    }
    for (int m = 0; m < R; ++m) {
      const f32x16 xa = load16(x + m * K + k), xb = load16(x + m * K + k + kLanes);
      for (int w = 0; w < W; ++w) acc[w][m] += lo[w] * xa + hi[w] * xb;
    }
  }
  for (int w = 0; full < K && w < W; ++w) {
    const float s = scale_of(scales + w * row_bytes, e8m0, full / kGroup);
    for (int64_t k = full; k < K; k += 2) {
      const uint8_t b = q[w * (K / 2) + k / 2];
      const float w0 = kE2M1[b & 15] * s, w1 = kE2M1[b >> 4] * s;
      for (int m = 0; m < R; ++m) tail[w][m] += w0 * x[m * K + k] + w1 * x[m * K + k + 1];
    }
  }
  for (int w = 0; w < W; ++w) {
    for (int m = 0; m < R; ++m) {
      float total = tail[w][m];
      for (int64_t i = 0; i < kLanes; ++i) total += acc[w][m][i];
      out[m * N + w] = total;
    }
  }
}

constexpr int kWeightRows = 4;  // weight rows a pass: 16 sums, 8 weight and 2 input vectors
using RowsTimes = void (*)(const float*, int64_t, const uint8_t*, const uint8_t*, int64_t, bool,
                           float*, int64_t);
constexpr RowsTimes kBlockTimes[kRows] = {rows_times<1, 4>, rows_times<2, 4>, rows_times<3, 4>,
                                          rows_times<4, 4>};
constexpr RowsTimes kRowTimes[kRows] = {rows_times<1, 1>, rows_times<2, 1>, rows_times<3, 1>,
                                        rows_times<4, 1>};

void check(const at::Tensor& q, const at::Tensor& scales, const char* op) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kByte && scales.dim() == 2, op,
              ": 2-d uint8 packed codes and 2-d scales");
  TORCH_CHECK(scales.scalar_type() == at::kFloat || scales.element_size() == 1, op,
              ": float32 or e8m0 scales");
  const int64_t K = 2 * q.size(1);
  TORCH_CHECK(scales.size(0) == q.size(0) && scales.size(1) == (K + kGroup - 1) / kGroup, op,
              ": shapes do not agree");
}

at::Tensor fp4_gemv(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales) {
  check(q, scales, "fp4_gemv");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == 2 * q.size(1), "fp4_gemv: x is [tokens, 2 * bytes]");
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  const at::Tensor xf = x.to(at::kFloat).contiguous(), qc = q.contiguous();
  const at::Tensor sc = scales.contiguous();
  const bool e8m0 = sc.element_size() == 1;
  const int64_t row_bytes = sc.size(1) * sc.element_size();
  at::Tensor out = at::empty({M, N}, x.options().dtype(at::kFloat));
  const float* xp = xf.data_ptr<float>();
  const uint8_t* qp = qc.data_ptr<uint8_t>();
  const uint8_t* sp = reinterpret_cast<const uint8_t*>(sc.data_ptr());
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end;) {
      const bool block = n + kWeightRows <= end;
      for (int64_t m = 0; m < M; m += kRows) {
        const int64_t rows = std::min(kRows, M - m);
        (block ? kBlockTimes : kRowTimes)[rows - 1](xp + m * K, K, qp + n * (K / 2),
                                                    sp + n * row_bytes, row_bytes, e8m0,
                                                    op + m * N + n, N);
      }
      n += block ? kWeightRows : 1;
    }
  });
  return out.to(x.scalar_type());
}

// bfloat16 bits of a float32, rounded to nearest even (no value here is NaN).
inline uint16_t bf16_bits(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

inline void store(float v, int64_t i, float* of, uint16_t* ob) {
  if (ob != nullptr) {
    ob[i] = bf16_bits(v);
  } else {
    of[i] = v;
  }
}

at::Tensor fp4_dequantize(const at::Tensor& q, const at::Tensor& scales, bool bf16) {
  check(q, scales, "fp4_dequantize");
  const int64_t N = q.size(0), K = 2 * q.size(1);
  const at::Tensor qc = q.contiguous(), sc = scales.contiguous();
  const bool e8m0 = sc.element_size() == 1;
  const int64_t row_bytes = sc.size(1) * sc.element_size();
  at::Tensor out = at::empty({N, K}, q.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
  const uint8_t* qp = qc.data_ptr<uint8_t>();
  const uint8_t* sp = reinterpret_cast<const uint8_t*>(sc.data_ptr());
  float* of = bf16 ? nullptr : out.data_ptr<float>();
  uint16_t* ob = bf16 ? reinterpret_cast<uint16_t*>(out.data_ptr()) : nullptr;
  const int64_t full = K / kGroup * kGroup;
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* row = qp + n * (K / 2);
      const uint8_t* srow = sp + n * row_bytes;
      for (int64_t k = 0; k < full; k += kGroup) {
        f32x16 lo, hi;
        decode32(row + k / 2, lo, hi);
        const float s = scale_of(srow, e8m0, k / kGroup);
        lo *= s;
        hi *= s;
        if (ob == nullptr) {
          std::memcpy(of + n * K + k, &lo, sizeof lo);
          std::memcpy(of + n * K + k + kLanes, &hi, sizeof hi);
        } else {
          for (int64_t i = 0; i < kLanes; ++i) {
            ob[n * K + k + i] = bf16_bits(lo[i]);
            ob[n * K + k + kLanes + i] = bf16_bits(hi[i]);
          }
        }
      }
      if (full < K) {
        const float s = scale_of(srow, e8m0, full / kGroup);
        for (int64_t k = full; k < K; k += 2) {
          store(kE2M1[row[k / 2] & 15] * s, n * K + k, of, ob);
          store(kE2M1[row[k / 2] >> 4] * s, n * K + k + 1, of, ob);
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deepinfer, m) {
  m.def("fp4_gemv(Tensor x, Tensor q, Tensor scales) -> Tensor");
  m.def("fp4_dequantize(Tensor q, Tensor scales, bool bf16) -> Tensor");
}

TORCH_LIBRARY_IMPL(deepinfer, CPU, m) {
  m.impl("fp4_gemv", &fp4_gemv);
  m.impl("fp4_dequantize", &fp4_dequantize);
}
