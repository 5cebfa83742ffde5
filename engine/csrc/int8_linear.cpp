// A few rows of activations times an int8 weight with one scale per output row
// (weight-only int8, engine/layers/quantization/int_weight.py), read a byte a weight.
//
// torch's own kernel for this, aten::_weight_int8pack_mm, read Qwen3-0.6B's output
// head at 12.1 GB/s for one row on an AMD Zen 4, and this at 22.3
// (benchmarks/weight_linear.py measures both; int_weight.py's int8_linear says more).
// Each task here takes some output rows; for each it widens 16 codes at a time to
// float32 in registers (never into memory), multiplies them by every activation
// row, and sums in float32; the row's sum is multiplied by its scale once, at
// the end. A decode step is bound by reading the weight, and this reads it once.
// With bfloat16 activations on a CPU that has AVX-512's bfloat16 dot product, 32
// codes at a time are widened to bfloat16 instead, and multiplied pairwise.

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

using i8x16 = int8_t __attribute__((vector_size(16)));
constexpr int64_t kRows = 8;  // activation rows multiplied per pass over a weight row

inline f32x16 widen16(const int8_t* p) {
#if defined(__AVX512F__)  // GCC lowers the generic widening to one extract per byte
  const __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return reinterpret_cast<f32x16>(_mm512_cvtepi32_ps(v));
#else
  i8x16 bytes;
  std::memcpy(&bytes, p, sizeof bytes);
  return __builtin_convertvector(bytes, f32x16);
#endif
}

// R rows of x (float32, K apart) times code row q, times its scale, written to out
// (one float per activation row, N apart). With one row, even and odd vectors go
// to two sums, so that consecutive multiply-adds do not wait for each other.
template <int R>
void row_times(const float* x, int64_t K, const int8_t* q, float scale, float* out, int64_t N) {
  constexpr int kSums = R == 1 ? 2 : 1;
  f32x16 part[kSums][R] = {};
  float tail[R] = {};
  int64_t k = 0;
  for (; k + kSums * kLanes <= K; k += kSums * kLanes) {
    for (int s = 0; s < kSums; ++s) {
      const f32x16 w = widen16(q + k + s * kLanes);
      for (int m = 0; m < R; ++m) part[s][m] += w * load16(x + m * K + k + s * kLanes);
    }
  }
  for (; k + kLanes <= K; k += kLanes) {
    const f32x16 w = widen16(q + k);
    for (int m = 0; m < R; ++m) part[0][m] += w * load16(x + m * K + k);
  }
  for (; k < K; ++k) {
    for (int m = 0; m < R; ++m) tail[m] += static_cast<float>(q[k]) * x[m * K + k];
  }
  for (int m = 0; m < R; ++m) {
    const f32x16 sum = kSums == 2 ? part[0][m] + part[kSums - 1][m] : part[0][m];
    out[m * N] = (sum16(sum) + tail[m]) * scale;
  }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// bfloat16 activations: 32 codes widened to bfloat16 (exactly: |q| <= 127 needs 7
// bits) and multiplied pairwise by the CPU's bfloat16 dot product, each product
// exact, summed in float32. Half the multiply-adds of the float32 path, and the
// activation rows take half the cache, which is what several rows are short of.
inline __m512bh widen32_bf16(const int8_t* p) {
  const __m128i* v = reinterpret_cast<const __m128i*>(p);
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(v)));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(v + 1)));
  return _mm512_cvtne2ps_pbh(hi, lo);  // columns 0-15 from lo, 16-31 from hi
}

template <int R>
void row_times_bf16(const uint16_t* x, int64_t K, const int8_t* q, float scale, float* out,
                    int64_t N) {
  __m512 part[R];
  for (int m = 0; m < R; ++m) part[m] = _mm512_setzero_ps();
  float tail[R] = {};
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    const __m512bh w = widen32_bf16(q + k);
    for (int m = 0; m < R; ++m) {
      const __m512i xs = _mm512_loadu_si512(x + m * K + k);
      part[m] = _mm512_dpbf16_ps(part[m], w, reinterpret_cast<__m512bh>(xs));
    }
  }
  for (; k < K; ++k) {
    for (int m = 0; m < R; ++m) tail[m] += static_cast<float>(q[k]) * bf16_value(x[m * K + k]);
  }
  for (int m = 0; m < R; ++m) out[m * N] = (_mm512_reduce_add_ps(part[m]) + tail[m]) * scale;
}

using RowTimesBf16 = void (*)(const uint16_t*, int64_t, const int8_t*, float, float*, int64_t);
constexpr RowTimesBf16 kRowTimesBf16[kRows] = {
    row_times_bf16<1>, row_times_bf16<2>, row_times_bf16<3>, row_times_bf16<4>,
    row_times_bf16<5>, row_times_bf16<6>, row_times_bf16<7>, row_times_bf16<8>};
#define DEEPINFER_INT8_BF16_DOT 1
#endif

using RowTimes = void (*)(const float*, int64_t, const int8_t*, float, float*, int64_t);
constexpr RowTimes kRowTimes[kRows] = {row_times<1>, row_times<2>, row_times<3>, row_times<4>,
                                       row_times<5>, row_times<6>, row_times<7>, row_times<8>};

// Every weight row times every activation row, kRows activation rows a pass, the
// weight rows spread over torch's threads.
template <typename X, typename Rows>
void over_rows(const Rows& table, const X* xp, const int8_t* qp, const float* sp, float* op,
               int64_t M, int64_t K, int64_t N) {
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t m = 0; m < M; m += kRows) {
        const int64_t rows = std::min(kRows, M - m);
        table[rows - 1](xp + m * K, K, qp + n * K, sp[n], op + m * N + n, N);
      }
    }
  });
}

at::Tensor int8_gemv(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && scales.dim() == 1, "int8_gemv: x, q 2-d, scales 1-d");
  TORCH_CHECK(q.scalar_type() == at::kChar, "int8_gemv: int8 codes");
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  TORCH_CHECK(q.size(1) == K && scales.size(0) == N, "int8_gemv: shapes do not agree");
  const at::Tensor qc = q.contiguous();
  const at::Tensor sc = scales.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({M, N}, x.options().dtype(at::kFloat));
  const int8_t* qp = qc.data_ptr<int8_t>();
  const float* sp = sc.data_ptr<float>();
  float* op = out.data_ptr<float>();
#if defined(DEEPINFER_INT8_BF16_DOT)
  if (x.scalar_type() == at::kBFloat16) {
    const at::Tensor xc = x.contiguous();
    const uint16_t* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr());
    over_rows(kRowTimesBf16, xp, qp, sp, op, M, K, N);
    return out.to(x.scalar_type());
  }
#endif
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  over_rows(kRowTimes, xf.data_ptr<float>(), qp, sp, op, M, K, N);
  return out.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deepinfer, m) {
  m.def("int8_gemv(Tensor x, Tensor q, Tensor scales) -> Tensor");
}

TORCH_LIBRARY_IMPL(deepinfer, CPU, m) { m.impl("int8_gemv", &int8_gemv); }
