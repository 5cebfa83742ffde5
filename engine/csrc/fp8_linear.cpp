// A few rows of activations times a DeepSeek FP8 weight, read a byte a weight.
//
// The weight is FP8 E4M3 codes q [N, K] with a float32 scale per row and block
// of 128 columns (engine/layers/quantization/fp8.py keeps one row of block scales
// per weight row). Each task takes some output rows; for each it decodes 16 codes
// at a time into float32 in registers (never into memory), multiplies them by
// every activation row, and sums each block of 128 products in float32 before
// multiplying the block's sum by its scale and adding it to the row's total:
// DeepGEMM's promotion, one scale per 128 products, on a CPU. A decode step is
// bound by reading the weight, and this reads a byte where bfloat16 reads two.
//
// E4M3's codes are decoded by bit arithmetic: a normal code's exponent and
// mantissa bits, shifted into float32's places, with the bias difference (127 - 7)
// added to the exponent; a subnormal code (exponent 0) is its mantissa times 2^-9.
// The two NaN codes (0x7f, 0xff) read as +-480: a weight is never NaN.

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

using i32x16 = int32_t __attribute__((vector_size(64)));
using u8x16 = uint8_t __attribute__((vector_size(16)));
constexpr int64_t kBlock = 128;  // columns that share a scale
constexpr int64_t kRows = 8;     // activation rows multiplied per pass over a weight row

#if defined(__AVX512F__)
inline f32x16 decode16(const uint8_t* p) {  // the same steps in AVX-512's own instructions:
  // GCC lowers the generic byte widening below to one extract per byte
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(v, _mm512_set1_epi32(0x80)), 24);
  const __m512i em = _mm512_and_si512(v, _mm512_set1_epi32(0x7F));
  const __m512i normal = _mm512_add_epi32(_mm512_slli_epi32(em, 20), _mm512_set1_epi32(120 << 23));
  const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(em), _mm512_set1_ps(0x1p-9f));
  const __mmask16 is_sub = _mm512_cmplt_epi32_mask(em, _mm512_set1_epi32(8));
  const __m512i bits = _mm512_mask_blend_epi32(is_sub, normal, _mm512_castps_si512(sub));
  return reinterpret_cast<f32x16>(_mm512_castsi512_ps(_mm512_or_si512(bits, sign)));
}
#else
inline f32x16 decode16(const uint8_t* p) {
  u8x16 bytes;
  std::memcpy(&bytes, p, sizeof bytes);
  const u32x16 v = __builtin_convertvector(bytes, u32x16);
  const u32x16 sign = (v & 0x80u) << 24;
  const u32x16 em = v & 0x7Fu;
  const u32x16 normal = (em << 20) + (120u << 23);
  const f32x16 sub = __builtin_convertvector(reinterpret_cast<i32x16>(em), f32x16) * 0x1p-9f;
  const u32x16 is_sub = reinterpret_cast<u32x16>(em < 8u);  // all ones where subnormal
  const u32x16 bits = (is_sub & reinterpret_cast<u32x16>(sub)) | (~is_sub & normal);
  return reinterpret_cast<f32x16>(bits | sign);
}
#endif

inline float decode1(uint8_t code) {
  uint8_t padded[kLanes] = {code};
  return decode16(padded)[0];
}

// R rows of x (float32, K apart) times weight row q, written to out (one float per
// activation row, N apart). R is a template parameter so that the R block sums
// stay in registers; with one row, even and odd vectors go to two sums, so that
// consecutive multiply-adds do not wait for each other.
template <int R>
void row_times(const float* x, int64_t K, const uint8_t* q, const float* scales, float* out,
               int64_t N) {
  constexpr int kSums = R == 1 ? 2 : 1;
  float total[R] = {};
  for (int64_t start = 0; start < K; start += kBlock) {
    const int64_t end = std::min(K, start + kBlock);
    f32x16 part[kSums][R] = {};
    float tail[R] = {};
    int64_t k = start;
    for (; k + kSums * kLanes <= end; k += kSums * kLanes) {
      for (int s = 0; s < kSums; ++s) {
        const f32x16 w = decode16(q + k + s * kLanes);
        for (int m = 0; m < R; ++m) part[s][m] += w * load16(x + m * K + k + s * kLanes);
      }
    }
    for (; k + kLanes <= end; k += kLanes) {
      const f32x16 w = decode16(q + k);
      for (int m = 0; m < R; ++m) part[0][m] += w * load16(x + m * K + k);
    }
    for (; k < end; ++k) {
      const float w = decode1(q[k]);
      for (int m = 0; m < R; ++m) tail[m] += w * x[m * K + k];
    }
    const float scale = scales[start / kBlock];
    for (int m = 0; m < R; ++m) {
      const f32x16 sum = kSums == 2 ? part[0][m] + part[kSums - 1][m] : part[0][m];
      total[m] += (sum16(sum) + tail[m]) * scale;
    }
  }
  for (int m = 0; m < R; ++m) out[m * N] = total[m];
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// bfloat16 activations: 32 codes decoded straight into bfloat16 (bit arithmetic,
// and a table of the 7 subnormals), and multiplied pairwise by the CPU's bfloat16
// dot product (each product exact, summed in float32). Half the instructions of
// the float32 path a weight.
inline __m512i decode32_bf16(const uint8_t* p) {
  const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i sign = _mm512_slli_epi16(_mm512_and_si512(v, _mm512_set1_epi16(0x80)), 8);
  const __m512i em = _mm512_and_si512(v, _mm512_set1_epi16(0x7F));
  const __m512i normal = _mm512_add_epi16(_mm512_slli_epi16(em, 4), _mm512_set1_epi16(120 << 7));
  // m * 2^-9 for m = 0..7, as bfloat16 bits; only the first 8 entries are read
  const __m512i table = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                         0, 0, 0, 0, 0, 0x3C60, 0x3C40, 0x3C20, 0x3C00, 0x3BC0,
                                         0x3B80, 0x3B00, 0);
  const __mmask32 is_sub = _mm512_cmplt_epu16_mask(em, _mm512_set1_epi16(8));
  const __m512i bits = _mm512_mask_blend_epi16(is_sub, normal, _mm512_permutexvar_epi16(em, table));
  return _mm512_or_si512(bits, sign);
}

template <int R>
void row_times_bf16(const uint16_t* x, int64_t K, const uint8_t* q, const float* scales,
                    float* out, int64_t N) {
  float total[R] = {};
  for (int64_t start = 0; start < K; start += kBlock) {
    const int64_t end = std::min(K, start + kBlock);
    __m512 part[R];
    for (int m = 0; m < R; ++m) part[m] = _mm512_setzero_ps();
    float tail[R] = {};
    int64_t k = start;
    for (; k + 32 <= end; k += 32) {
      const __m512bh w = reinterpret_cast<__m512bh>(decode32_bf16(q + k));
      for (int m = 0; m < R; ++m) {
        const __m512i xs = _mm512_loadu_si512(x + m * K + k);
        part[m] = _mm512_dpbf16_ps(part[m], w, reinterpret_cast<__m512bh>(xs));
      }
    }
    for (; k < end; ++k) {
      const float w = decode1(q[k]);
      for (int m = 0; m < R; ++m) tail[m] += w * bf16_value(x[m * K + k]);
    }
    const float scale = scales[start / kBlock];
    for (int m = 0; m < R; ++m) total[m] += (_mm512_reduce_add_ps(part[m]) + tail[m]) * scale;
  }
  for (int m = 0; m < R; ++m) out[m * N] = total[m];
}

using RowTimesBf16 = void (*)(const uint16_t*, int64_t, const uint8_t*, const float*, float*,
                              int64_t);
constexpr RowTimesBf16 kRowTimesBf16[kRows] = {
    row_times_bf16<1>, row_times_bf16<2>, row_times_bf16<3>, row_times_bf16<4>,
    row_times_bf16<5>, row_times_bf16<6>, row_times_bf16<7>, row_times_bf16<8>};
#define DEEPINFER_FP8_BF16_DOT 1
#endif

using RowTimes = void (*)(const float*, int64_t, const uint8_t*, const float*, float*, int64_t);
constexpr RowTimes kRowTimes[kRows] = {row_times<1>, row_times<2>, row_times<3>, row_times<4>,
                                       row_times<5>, row_times<6>, row_times<7>, row_times<8>};

at::Tensor fp8_block_gemv(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && scales.dim() == 2, "fp8_block_gemv: 2-d tensors");
  TORCH_CHECK(q.element_size() == 1 && scales.scalar_type() == at::kFloat,
              "fp8_block_gemv: one-byte codes and float32 scales");
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  TORCH_CHECK(q.size(1) == K && scales.size(0) == N && scales.size(1) == (K + kBlock - 1) / kBlock,
              "fp8_block_gemv: shapes do not agree");
  const at::Tensor qc = q.contiguous(), sc = scales.contiguous();
  at::Tensor out = at::empty({M, N}, x.options().dtype(at::kFloat));
  const uint8_t* qp = reinterpret_cast<const uint8_t*>(qc.data_ptr());
  const float* sp = sc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t blocks = sc.size(1);
#if defined(DEEPINFER_FP8_BF16_DOT)
  if (x.scalar_type() == at::kBFloat16) {
    const at::Tensor xc = x.contiguous();
    const uint16_t* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr());
    at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) {
        for (int64_t m = 0; m < M; m += kRows) {
          const int64_t rows = std::min(kRows, M - m);
          kRowTimesBf16[rows - 1](xp + m * K, K, qp + n * K, sp + n * blocks, op + m * N + n, N);
        }
      }
    });
    return out.to(x.scalar_type());
  }
#endif
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const float* xp = xf.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t m = 0; m < M; m += kRows) {
        const int64_t rows = std::min(kRows, M - m);
        kRowTimes[rows - 1](xp + m * K, K, qp + n * K, sp + n * blocks, op + m * N + n, N);
      }
    }
  });
  return out.to(x.scalar_type());
}

// bfloat16 bits of float32 values, rounded to nearest even (no value here is NaN).
inline void store_bf16(uint16_t* out, f32x16 v) {
  const u32x16 bits = reinterpret_cast<u32x16>(v);
  const u32x16 rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  for (int64_t i = 0; i < kLanes; ++i) out[i] = static_cast<uint16_t>(rounded[i]);
}

// W = q * scale, each product in float32 (DeepSeek's weight_dequant), as float32 or
// rounded once to bfloat16: the tiles a many-token matmul reads (fp8.py).
at::Tensor fp8_block_dequantize(const at::Tensor& q, const at::Tensor& scales, bool bf16) {
  TORCH_CHECK(q.dim() == 2 && q.element_size() == 1 && scales.scalar_type() == at::kFloat,
              "fp8_block_dequantize: 2-d one-byte codes and float32 scales");
  const int64_t N = q.size(0), K = q.size(1);
  TORCH_CHECK(scales.size(0) == N && scales.size(1) == (K + kBlock - 1) / kBlock,
              "fp8_block_dequantize: shapes do not agree");
  const at::Tensor qc = q.contiguous(), sc = scales.contiguous();
  at::Tensor out = at::empty({N, K}, q.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
  const uint8_t* qp = reinterpret_cast<const uint8_t*>(qc.data_ptr());
  const float* sp = sc.data_ptr<float>();
  const int64_t blocks = sc.size(1);
  float* of = bf16 ? nullptr : out.data_ptr<float>();
  uint16_t* ob = bf16 ? reinterpret_cast<uint16_t*>(out.data_ptr()) : nullptr;
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* row = qp + n * K;
      for (int64_t k = 0; k < K; ++k) {
        const float scale = sp[n * blocks + k / kBlock];
        const bool whole = k % kLanes == 0 && k + kLanes <= std::min(K, (k / kBlock + 1) * kBlock);
        if (whole) {
          const f32x16 v = decode16(row + k) * scale;
          if (bf16) {
            store_bf16(ob + n * K + k, v);
          } else {
            std::memcpy(of + n * K + k, &v, sizeof v);
          }
          k += kLanes - 1;
          continue;
        }
        f32x16 v = {};
        v[0] = decode1(row[k]) * scale;
        if (bf16) {
          uint16_t one[kLanes];
          store_bf16(one, v);
          ob[n * K + k] = one[0];
        } else {
          of[n * K + k] = v[0];
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deepinfer, m) {
  m.def("fp8_block_gemv(Tensor x, Tensor q, Tensor scales) -> Tensor");
  m.def("fp8_block_dequantize(Tensor q, Tensor scales, bool bf16) -> Tensor");
}

TORCH_LIBRARY_IMPL(deepinfer, CPU, m) {
  m.impl("fp8_block_gemv", &fp8_block_gemv);
  m.impl("fp8_block_dequantize", &fp8_block_dequantize);
}
