// Paged decode attention for the CPU, reading K and V blocks where they lie.
//
// The torch backend gathers each sequence's blocks into a padded dense tensor,
// then calls scaled_dot_product_attention: every key is copied once and read
// twice, and padding is read only to be masked. This op follows the block table
// instead. Each task is one (sequence, KV head): it loads a key row once and
// scores it against all the query heads that share that KV head (GQA), then
// folds the block into a running softmax, so no score matrix is stored.
// Accumulation is in float32 whatever the cache's dtype.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <type_traits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// The running max before any score: finite, so that the build's -ffast-math
// (which vectorizes exp) never meets an infinity; exp(kNoScore - x) is 0.
constexpr float kNoScore = -1e30f;

// Eight float32 lanes. GCC and Clang lower this type to the target's vectors
// (an AVX2 register, half an AVX-512 one, two NEON ones), so the arithmetic
// below is vectorized whatever the auto-vectorizer would decide: it left the
// plain loops this file first had scalar.
using f32x8 = float __attribute__((vector_size(32)));
using u16x8 = uint16_t __attribute__((vector_size(16)));
using u32x8 = uint32_t __attribute__((vector_size(32)));
constexpr int64_t kLanes = 8;
constexpr int64_t kMaxChunks = 72;  // head_dim at most 576: MLA's latent and rope rows

inline f32x8 load8(const float* p) {
  f32x8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline f32x8 load8(const at::BFloat16* p) {  // a bfloat16 is a float32's top half
#if defined(__AVX2__)  // one widening instruction, where the generic code takes three
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return reinterpret_cast<f32x8>(_mm256_slli_epi32(w, 16));
#else
  u16x8 h;
  std::memcpy(&h, p, sizeof h);
  return reinterpret_cast<f32x8>(__builtin_convertvector(h, u32x8) << 16);
#endif
}
// A quantized cache's codes (engine/kv/quant.py): an int8 code is its own number,
// an FP8 E4M3 code is found in a table of its 256 values. Either is then scaled by
// its row's float32 scale, once per row, outside the vector loops.
struct Fp8 {
  uint8_t bits;
};
inline float fp8_e4m3_value(uint8_t b) {
  const int sign = b >> 7, exp = (b >> 3) & 15, man = b & 7;
  float v = exp ? std::ldexp(1.f + man / 8.f, exp - 7) : std::ldexp(man / 8.f, -6);
  if (exp == 15 && man == 7) v = std::numeric_limits<float>::quiet_NaN();
  return sign ? -v : v;
}
const float* fp8_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(256);
    for (int b = 0; b < 256; ++b) t[b] = fp8_e4m3_value(static_cast<uint8_t>(b));
    return t;
  }();
  return table.data();
}
inline f32x8 load8(const Fp8* p) {
  const float* table = fp8_table();
  f32x8 v;
  for (int i = 0; i < kLanes; ++i) v[i] = table[p[i].bits];
  return v;
}
using i8x8 = int8_t __attribute__((vector_size(8)));
inline f32x8 load8(const int8_t* p) {
  i8x8 c;
  std::memcpy(&c, p, sizeof c);
  return __builtin_convertvector(c, f32x8);
}

inline float hsum(f32x8 v) {
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

// Ask for a block's rows (this head's `dim` values of each) before they are
// needed: the block table jumps about the cache, which defeats the hardware
// prefetcher, since it follows strides. Into L2 (locality hint 1): that measured
// faster in the engine's decode step than prefetching into L1, which a block's
// lines, arriving early, crowd.
template <typename T>
inline void prefetch_rows(const T* k, const T* v, int64_t rows, int64_t row_stride, int64_t dim) {
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t b = 0; b < dim * static_cast<int64_t>(sizeof(T)); b += 64) {
      __builtin_prefetch(reinterpret_cast<const char*>(k + t * row_stride) + b, 0, 1);
      __builtin_prefetch(reinterpret_cast<const char*>(v + t * row_stride) + b, 0, 1);
    }
}

// --8<-- [start:one_kv_head]
// One sequence, one KV head, its `group` query heads: attention over `len`
// cached tokens, read block by block through `table`. A head is C vectors of 8
// lanes: a constant for the common head sizes, so that the compiler unrolls the
// loops over it and keeps vectors in registers (see attend_all); else `chunks`.
// A quantized cache (K, the codes, not T) has a scale per row in k_scale and
// v_scale, `kv_heads` apart: a score is the codes' dot product times its key's
// scale, and a value row's weight is its probability times its scale.
template <typename T, typename K, int64_t N>
void attend_one(const T* q, const K* k_cache, const K* v_cache, const float* k_scale,
                const float* v_scale, const int32_t* table, int64_t len, int64_t bs,
                int64_t row_stride, int64_t kv_heads, int64_t group, int64_t chunks,
                float scale, T* out, std::vector<f32x8>& work, std::vector<float>& p) {
  constexpr bool quantized = !std::is_same_v<T, K>;
  const int64_t C = N ? N : chunks;
  work.assign(2 * group * C, f32x8{});
  p.assign(group * bs + 2 * group + bs, 0.f);
  f32x8* qs = work.data();             // [group, C] the queries, scaled
  f32x8* acc = qs + group * C;         // [group, C] running sum of p * v
  float* max = p.data() + group * bs;  // [group] running max score
  float* sum = max + group;            // [group] running sum of exp(score - max)
  float* vs = sum + group;             // [bs] this block's value scales
  const int64_t dim = C * kLanes;
  for (int64_t i = 0; i < group * C; ++i) qs[i] = scale * load8(q + i * kLanes);
  std::fill(max, max + group, kNoScore);
  for (int64_t start = 0; start < len; start += bs) {
    const int64_t n = std::min(bs, len - start);  // the last block may be partial
    const int64_t slot0 = static_cast<int64_t>(table[start / bs]) * bs;
    const K* k = k_cache + slot0 * row_stride;
    const K* v = v_cache + slot0 * row_stride;
    if (start + bs < len) {  // ask for the next block while this one is worked on
      const int64_t next = static_cast<int64_t>(table[start / bs + 1]) * bs * row_stride;
      prefetch_rows(k_cache + next, v_cache + next, bs, row_stride, dim);
    }
    for (int64_t t = 0; t < n; ++t) {  // each key row is loaded once for the whole group
      f32x8 kt[N ? N : kMaxChunks];
      for (int64_t c = 0; c < C; ++c) kt[c] = load8(k + t * row_stride + c * kLanes);
      const float ks = quantized ? k_scale[(slot0 + t) * kv_heads] : 1.f;
      for (int64_t g = 0; g < group; ++g) {
        f32x8 s0 = qs[g * C] * kt[0], s1 = f32x8{};  // two chains, half as long
        for (int64_t c = 1; c < C; ++c) (c % 2 ? s1 : s0) += qs[g * C + c] * kt[c];
        p[g * bs + t] = hsum(s0 + s1) * ks;
      }
      vs[t] = quantized ? v_scale[(slot0 + t) * kv_heads] : 1.f;
    }
    for (int64_t g = 0; g < group; ++g) {
      // Online softmax: rescale what came before to the new max, then add this block.
      float* s = p.data() + g * bs;
      const float new_max = std::max(max[g], *std::max_element(s, s + n));
      const float keep = std::exp(max[g] - new_max);
      float block_sum = 0.f;
      for (int64_t t = 0; t < n; ++t) {
        s[t] = std::exp(s[t] - new_max);
        block_sum += s[t];
      }
      sum[g] = sum[g] * keep + block_sum;
      max[g] = new_max;
      f32x8 a[N ? N : kMaxChunks];  // this head's sum, in registers while values stream by
      for (int64_t c = 0; c < C; ++c) a[c] = acc[g * C + c] * keep;
      for (int64_t t = 0; t < n; ++t) {
        const float w = s[t] * vs[t];  // its probability, times the value row's scale
        for (int64_t c = 0; c < C; ++c) a[c] += w * load8(v + t * row_stride + c * kLanes);
      }
      for (int64_t c = 0; c < C; ++c) acc[g * C + c] = a[c];
    }
  }
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < dim; ++d)
      out[g * dim + d] = static_cast<T>(acc[g * C + d / kLanes][d % kLanes] / sum[g]);
}
// --8<-- [end:one_kv_head]

template <typename T, typename K>
void attend_all(const at::Tensor& q, const K* kp, const K* vp, const float* ksp,
                const float* vsp, const at::Tensor& k_cache, const at::Tensor& tables,
                const at::Tensor& lens, double scale, at::Tensor& out) {
  const int64_t seqs = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  const int64_t group = heads / kv_heads, row_stride = kv_heads * dim;
  const T* qp = q.data_ptr<T>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  T* op = out.data_ptr<T>();
  const int64_t table_width = tables.size(1);
  at::parallel_for(0, seqs * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<f32x8> work;  // scratch buffers per thread, reused across its tasks
    std::vector<float> p;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / kv_heads, h = task % kv_heads;
      const int64_t at = (s * heads + h * group) * dim;  // this head's query rows
      const T* qh = qp + at;
      const int32_t* table = tp + s * table_width;
      const float* ks = ksp ? ksp + h : nullptr;  // this head's scales, if quantized
      const float* vs = vsp ? vsp + h : nullptr;
      auto one = [&](auto n) {
        attend_one<T, K, decltype(n)::value>(qh, kp + h * dim, vp + h * dim, ks, vs, table,
                                             lp[s], block_size, row_stride, kv_heads, group,
                                             dim / kLanes, static_cast<float>(scale), op + at,
                                             work, p);
      };
      if (dim == 64) {  // the head sizes most models use, compiled with loops unrolled
        one(std::integral_constant<int64_t, 8>{});
      } else if (dim == 128) {
        one(std::integral_constant<int64_t, 16>{});
      } else {
        one(std::integral_constant<int64_t, 0>{});
      }
    }
  });
}

// The cache's codes as T's cache (K = T), or as a quantized one (int8 or FP8 codes
// with their float32 scales).
template <typename T>
void attend_cache(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const c10::optional<at::Tensor>& k_scale,
                  const c10::optional<at::Tensor>& v_scale, const at::Tensor& tables,
                  const at::Tensor& lens, double scale, at::Tensor& out) {
  if (!k_scale.has_value()) {
    attend_all<T, T>(q, k_cache.data_ptr<T>(), v_cache.data_ptr<T>(), nullptr, nullptr,
                     k_cache, tables, lens, scale, out);
    return;
  }
  const float* ks = k_scale->data_ptr<float>();
  const float* vs = v_scale->data_ptr<float>();
  if (k_cache.scalar_type() == at::kChar) {
    attend_all<T, int8_t>(q, k_cache.data_ptr<int8_t>(), v_cache.data_ptr<int8_t>(), ks, vs,
                          k_cache, tables, lens, scale, out);
  } else {
    TORCH_CHECK(k_cache.scalar_type() == at::kFloat8_e4m3fn,
                "a quantized cache holds int8 or float8_e4m3fn codes, got ",
                k_cache.scalar_type());
    const auto* kb = reinterpret_cast<const Fp8*>(k_cache.data_ptr());
    const auto* vb = reinterpret_cast<const Fp8*>(v_cache.data_ptr());
    attend_all<T, Fp8>(q, kb, vb, ks, vs, k_cache, tables, lens, scale, out);
  }
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& context_lens, double scale,
                                  const c10::optional<at::Tensor>& k_scale,
                                  const c10::optional<at::Tensor>& v_scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4,
              "q [seqs, heads, dim], cache [blocks, size, kv_heads, dim]");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(q.size(2) == k_cache.size(3), "q and the cache disagree on head_dim");
  TORCH_CHECK(q.size(2) % kLanes == 0 && q.size(2) <= kLanes * kMaxChunks,
              "paged_decode_attention: head_dim must be a multiple of 8, at most 576");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(),
              "k_cache and v_cache must share a dtype");
  TORCH_CHECK(k_scale.has_value() == v_scale.has_value(), "give both scales or neither");
  TORCH_CHECK(k_scale.has_value() || q.scalar_type() == k_cache.scalar_type(),
              "q, k_cache and v_cache must share a dtype (or the cache holds codes with scales)");
  if (k_scale.has_value()) {
    TORCH_CHECK(k_scale->scalar_type() == at::kFloat && v_scale->scalar_type() == at::kFloat &&
                    k_scale->is_contiguous() && v_scale->is_contiguous(),
                "the scales must be contiguous float32");
    TORCH_CHECK(k_scale->dim() == 3 && k_scale->size(0) == k_cache.size(0) &&
                    k_scale->size(1) == k_cache.size(1) && k_scale->size(2) == k_cache.size(2) &&
                    v_scale->sizes() == k_scale->sizes(),
                "the scales must be [blocks, block_size, kv_heads], as the cache");
  }
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt,
              "block_tables and context_lens must be int32");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the caches must be contiguous");
  const at::Tensor qc = q.contiguous(), tables = block_tables.contiguous();
  const at::Tensor lens = context_lens.contiguous();
  at::Tensor out = at::empty_like(qc);
  if (q.scalar_type() == at::kFloat) {
    attend_cache<float>(qc, k_cache, v_cache, k_scale, v_scale, tables, lens, scale, out);
  } else if (q.scalar_type() == at::kBFloat16) {
    attend_cache<at::BFloat16>(qc, k_cache, v_cache, k_scale, v_scale, tables, lens, scale, out);
  } else {
    TORCH_CHECK(false, "paged_decode_attention supports float32 and bfloat16, got ",
                q.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(deepinfer, m) {
  m.def(
      "paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor context_lens, float scale, Tensor? k_scale=None, Tensor? v_scale=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(deepinfer, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
