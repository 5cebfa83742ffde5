// A few rows of bfloat16 activations times a bfloat16 weight in PyTorch's
// row-major order: a tied output head's decode step for a few requests
// (engine/layers/linear.py's SharedWeightLinear, which says when it is taken).
//
// A tied head reads the embedding table, which cannot be packed for oneDNN
// without a second copy, and F.linear on a row-major weight reorders it on every
// call. A decode step reads every weight once and does two flops a weight for
// each of its few rows, so it is bound by how fast the weight streams from
// memory. This reads the rows in order, once for up to eight activation rows:
// each task takes some output rows, and multiplies 32 weights at a time by every
// activation row with AVX-512's bfloat16 dot product (each product exact, summed
// in float32), or, on a CPU without it, widens 16 at a time to float32 and
// multiplies them there. The sum is rounded to bfloat16 once, at the end.

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

using u16x16 = uint16_t __attribute__((vector_size(32)));
constexpr int64_t kRows = 8;  // activation rows multiplied per pass over a weight row

// 16 bfloat16 values widened to float32: their bits are a float32's top half.
inline f32x16 widen16(const uint16_t* p) {
  u16x16 half;
  std::memcpy(&half, p, sizeof half);
  const u32x16 bits = __builtin_convertvector(half, u32x16) << 16;
  f32x16 v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// R rows of x (K apart) times weight row w, written to out (N apart). With one
// or two rows, consecutive blocks of 32 go to separate sums (four chains in all),
// so that each dot product need not wait for the one before. With three or more,
// the weight is fetched 1 KB ahead: at Qwen3's head, 8 rows took 26 to 28 ms
// without it and 15 to 17 with, where 1 row took longer with it.
template <int R>
void row_times(const uint16_t* x, int64_t K, const uint16_t* w, float* out, int64_t N) {
  constexpr int kSums = R == 1 ? 4 : (R == 2 ? 2 : 1);
  __m512 part[kSums][R];
  for (int s = 0; s < kSums; ++s)
    for (int m = 0; m < R; ++m) part[s][m] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + kSums * 32 <= K; k += kSums * 32) {
    for (int s = 0; s < kSums; ++s) {
      if constexpr (R >= 3) _mm_prefetch(reinterpret_cast<const char*>(w + k) + 1024, _MM_HINT_T0);
      const __m512bh wv = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + k + s * 32));
      for (int m = 0; m < R; ++m) {
        const __m512i xv = _mm512_loadu_si512(x + m * K + k + s * 32);
        part[s][m] = _mm512_dpbf16_ps(part[s][m], wv, reinterpret_cast<__m512bh>(xv));
      }
    }
  }
  float tail[R] = {};
  for (; k < K; ++k) {
    for (int m = 0; m < R; ++m) tail[m] += bf16_value(w[k]) * bf16_value(x[m * K + k]);
  }
  for (int m = 0; m < R; ++m) {
    __m512 sum = part[0][m];
    for (int s = 1; s < kSums; ++s) sum = _mm512_add_ps(sum, part[s][m]);
    out[m * N] = _mm512_reduce_add_ps(sum) + tail[m];
  }
}
#else
template <int R>
void row_times(const uint16_t* x, int64_t K, const uint16_t* w, float* out, int64_t N) {
  f32x16 part[R] = {};
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    const f32x16 wv = widen16(w + k);
    for (int m = 0; m < R; ++m) part[m] += wv * widen16(x + m * K + k);
  }
  float tail[R] = {};
  for (; k < K; ++k) {
    for (int m = 0; m < R; ++m) tail[m] += bf16_value(w[k]) * bf16_value(x[m * K + k]);
  }
  for (int m = 0; m < R; ++m) out[m * N] = sum16(part[m]) + tail[m];
}
#endif

using RowTimes = void (*)(const uint16_t*, int64_t, const uint16_t*, float*, int64_t);
constexpr RowTimes kRowTimes[kRows] = {row_times<1>, row_times<2>, row_times<3>, row_times<4>,
                                       row_times<5>, row_times<6>, row_times<7>, row_times<8>};

at::Tensor bf16_gemv(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "bf16_gemv: x and w 2-d");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16,
              "bf16_gemv: bfloat16 x and w");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K, "bf16_gemv: x has ", K, " columns, w ", w.size(1));
  const at::Tensor xc = x.contiguous(), wc = w.contiguous();
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(wc.data_ptr());
  at::Tensor sums = at::empty({M, N}, x.options().dtype(at::kFloat));
  float* sp = sums.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t m = 0; m < M; m += kRows) {
        const int64_t rows = std::min(kRows, M - m);
        kRowTimes[rows - 1](xp + m * K, K, wp + n * K, sp + m * N + n, N);
      }
    }
  });
  return sums.to(at::kBFloat16);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deepinfer, m) { m.def("bf16_gemv(Tensor x, Tensor w) -> Tensor"); }

TORCH_LIBRARY_IMPL(deepinfer, CPU, m) { m.impl("bf16_gemv", &bf16_gemv); }
