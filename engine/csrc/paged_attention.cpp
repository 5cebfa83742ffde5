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

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

// The running max before any score: finite, so that the build's -ffast-math
// (which vectorizes exp) never meets an infinity; exp(kNoScore - x) is 0.
constexpr float kNoScore = -1e30f;

template <typename T>
inline float dot(const float* q, const T* k, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t d = 0; d < n; ++d) s += q[d] * static_cast<float>(k[d]);
  return s;
}

// --8<-- [start:one_kv_head]
// One sequence, one KV head, its `group` query heads: attention over `len`
// cached tokens, read block by block through `table`.
template <typename T>
void attend_one(const T* q, const T* k_cache, const T* v_cache, const int32_t* table,
                int64_t len, int64_t bs, int64_t row_stride, int64_t group, int64_t dim,
                float scale, T* out, std::vector<float>& work) {
  work.assign(group * (2 * dim + bs + 2), 0.f);
  float* qs = work.data();            // [group, dim] the queries, scaled
  float* acc = qs + group * dim;      // [group, dim] running sum of p * v
  float* p = acc + group * dim;       // [group, bs] this block's scores, then weights
  float* max = p + group * bs;        // [group] running max score
  float* sum = max + group;           // [group] running sum of exp(score - max)
  for (int64_t i = 0; i < group * dim; ++i) qs[i] = scale * static_cast<float>(q[i]);
  std::fill(max, max + group, kNoScore);
  for (int64_t start = 0; start < len; start += bs) {
    const int64_t n = std::min(bs, len - start);  // the last block may be partial
    const int64_t row0 = static_cast<int64_t>(table[start / bs]) * bs * row_stride;
    const T* k = k_cache + row0;
    const T* v = v_cache + row0;
    for (int64_t t = 0; t < n; ++t)  // each key row is loaded once for the whole group
      for (int64_t g = 0; g < group; ++g)
        p[g * bs + t] = dot(qs + g * dim, k + t * row_stride, dim);
    for (int64_t g = 0; g < group; ++g) {
      // Online softmax: rescale what came before to the new max, then add this block.
      float* s = p + g * bs;
      const float new_max = std::max(max[g], *std::max_element(s, s + n));
      const float keep = std::exp(max[g] - new_max);
      float block_sum = 0.f;
#pragma omp simd reduction(+ : block_sum)
      for (int64_t t = 0; t < n; ++t) {
        s[t] = std::exp(s[t] - new_max);
        block_sum += s[t];
      }
      sum[g] = sum[g] * keep + block_sum;
      max[g] = new_max;
      float* a = acc + g * dim;
      for (int64_t t = 0; t < n; ++t) {
        const T* vt = v + t * row_stride;
        const float w = t == 0 ? keep : 1.f;  // the rescale rides on the first token's pass
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) a[d] = a[d] * w + s[t] * static_cast<float>(vt[d]);
      }
    }
  }
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < dim; ++d) out[g * dim + d] = static_cast<T>(acc[g * dim + d] / sum[g]);
}
// --8<-- [end:one_kv_head]

template <typename T>
void attend_all(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                const at::Tensor& tables, const at::Tensor& lens, double scale, at::Tensor& out) {
  const int64_t seqs = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  const int64_t group = heads / kv_heads, row_stride = kv_heads * dim;
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  T* op = out.data_ptr<T>();
  const int64_t table_width = tables.size(1);
  at::parallel_for(0, seqs * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> work;  // one scratch buffer per thread, reused across its tasks
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / kv_heads, h = task % kv_heads;
      const int64_t at = (s * heads + h * group) * dim;  // this head's query rows
      attend_one<T>(qp + at, kp + h * dim, vp + h * dim, tp + s * table_width, lp[s], block_size,
                    row_stride, group, dim, static_cast<float>(scale), op + at, work);
    }
  });
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4,
              "q [seqs, heads, dim], cache [blocks, size, kv_heads, dim]");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(q.size(2) == k_cache.size(3), "q and the cache disagree on head_dim");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() &&
                  k_cache.scalar_type() == v_cache.scalar_type(),
              "q, k_cache and v_cache must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt,
              "block_tables and context_lens must be int32");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the caches must be contiguous");
  const at::Tensor qc = q.contiguous(), tables = block_tables.contiguous();
  const at::Tensor lens = context_lens.contiguous();
  at::Tensor out = at::empty_like(qc);
  if (q.scalar_type() == at::kFloat) {
    attend_all<float>(qc, k_cache, v_cache, tables, lens, scale, out);
  } else if (q.scalar_type() == at::kBFloat16) {
    attend_all<at::BFloat16>(qc, k_cache, v_cache, tables, lens, scale, out);
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
      "Tensor context_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(deepinfer, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
