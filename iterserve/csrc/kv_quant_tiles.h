// The float32 loops of quantized decode attention (kv_quant_decode.cpp) on a tile of rows widened into L1
// (isa 1, or a head dim not a multiple of 64), the softmax's helpers, and where a head's rows lie in a pool.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include "kv_quant.h"

namespace iterserve_kv_quant {

using Vec = at::vec::Vectorized<float>;

inline float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  Vec acc(0.f);
  for (; i + Vec::size() <= n; i += Vec::size()) acc = at::vec::fmadd(Vec::loadu(a + i), Vec::loadu(b + i), acc);
  float lanes[Vec::size()];
  acc.store(lanes);
  float s = 0.f;
  for (int64_t k = 0; k < Vec::size(); ++k) s += lanes[k];
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// The largest of p[0, n), one vector at a time and one reduction (as attention_loops.h's max_of).
inline float max_of(const float* p, int64_t n) {
  Vec best(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) best = at::vec::maximum(best, Vec::loadu(p + i));
  float out = best.reduce_max();
  for (; i < n; ++i) out = std::max(out, p[i]);
  return out;
}

// p[i] = exp(p[i] - m) for i < n; returns the sum (exp_u20, as paged_decode's float path).
inline float exp_sum(float* p, float m, int64_t n) {
  const Vec vm(m);
  int64_t i = 0;
  float sum = 0.f;
  for (; i + Vec::size() <= n; i += Vec::size()) {
    const Vec e = (Vec::loadu(p + i) - vm).exp_u20();
    e.store(p + i);
    sum += e.reduce_add();
  }
  for (; i < n; ++i) sum += (p[i] = std::exp(p[i] - m));
  return sum;
}

#if defined(__AVX512F__)
// Lane j of the result is the sum of v[j]'s sixteen lanes: a transposing add tree (as attention_loops.h's sum16), far
// fewer shuffles than sixteen separate reductions.
inline __m512 sum16(const float (*v)[16]) {
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i) {
    const __m512 x = _mm512_load_ps(v[2 * i]), y = _mm512_load_ps(v[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y));
  }
  for (int i = 0; i < 4; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
  for (int i = 0; i < 2; ++i)
    d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], 0x88), _mm512_shuffle_f32x4(d[0], d[1], 0xDD));
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// Lane j of the result is the sum of v[j]'s eight lanes: sum16's add tree at AVX2's width.
inline __m256 sum8(const float (*v)[8]) {
  __m256 b[4], c[2];
  for (int i = 0; i < 4; ++i) {
    const __m256 x = _mm256_load_ps(v[2 * i]), y = _mm256_load_ps(v[2 * i + 1]);
    b[i] = _mm256_add_ps(_mm256_unpacklo_ps(x, y), _mm256_unpackhi_ps(x, y));
  }
  for (int i = 0; i < 2; ++i)
    c[i] = _mm256_add_ps(_mm256_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44),
                         _mm256_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
  return _mm256_add_ps(_mm256_permute2f128_ps(c[0], c[1], 0x20), _mm256_permute2f128_ps(c[0], c[1], 0x31));
}
#endif

// scores[g * stride + j] = q_g . rows[j] for the tile's n widened rows: on AVX-512 (dim a multiple of 16) sixteen
// keys' partial sums reduced together, on AVX2 (a multiple of 8) eight, else one dot product per key.
inline void tile_scores(int64_t isa, const float* qf, const float* rows, int64_t n, int64_t dim, int64_t group,
                 int64_t stride, float* scores) {
#if defined(__AVX512F__)
  if (isa >= kAvx512 && dim % 16 == 0 && stride % 16 == 0) {
    alignas(64) float part[16][16];
    for (int64_t g = 0; g < group; ++g)
      for (int64_t j0 = 0; j0 < n; j0 += 16) {
        for (int64_t j = 0; j < 16; ++j) {
          __m512 acc = _mm512_setzero_ps();
          if (j0 + j < n)
            for (int64_t i = 0; i < dim; i += 16)
              acc = _mm512_fmadd_ps(_mm512_loadu_ps(qf + g * dim + i), _mm512_loadu_ps(rows + (j0 + j) * dim + i), acc);
          _mm512_store_ps(part[j], acc);
        }
        _mm512_storeu_ps(scores + g * stride + j0, sum16(part));
      }
    return;
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (isa >= kAvx2 && dim % 8 == 0 && stride % 8 == 0) {
    alignas(32) float part[8][8];
    for (int64_t g = 0; g < group; ++g)
      for (int64_t j0 = 0; j0 < n; j0 += 8) {
        for (int64_t j = 0; j < 8; ++j) {
          __m256 acc = _mm256_setzero_ps();
          if (j0 + j < n)
            for (int64_t i = 0; i < dim; i += 8)
              acc = _mm256_fmadd_ps(_mm256_loadu_ps(qf + g * dim + i), _mm256_loadu_ps(rows + (j0 + j) * dim + i), acc);
          _mm256_store_ps(part[j], acc);
        }
        _mm256_storeu_ps(scores + g * stride + j0, sum8(part));
      }
    return;
  }
#endif
  for (int64_t g = 0; g < group; ++g)
    for (int64_t j = 0; j < n; ++j) scores[g * stride + j] = dot(qf + g * dim, rows + j * dim, dim);
}

inline void axpy(float* y, float a, const float* x, int64_t n) {
  int64_t i = 0;
  const Vec va(a);
  for (; i + Vec::size() <= n; i += Vec::size()) at::vec::fmadd(va, Vec::loadu(x + i), Vec::loadu(y + i)).store(y + i);
  for (; i < n; ++i) y[i] += a * x[i];
}

// acc_g += sum_j scores[g * stride + j] * rows[j] for the tile's n widened V rows.
inline void tile_values(const float* scores, const float* rows, int64_t n, int64_t dim, int64_t group, int64_t stride,
                        float* acc) {
  for (int64_t g = 0; g < group; ++g)
    for (int64_t j = 0; j < n; ++j) axpy(acc + g * dim, scores[g * stride + j], rows + j * dim, dim);
}

// One pool of a quantized cache, [blocks, kv_heads, block_size, head_dim] bytes, and for int8 its float16 scales
// [blocks, kv_heads, block_size] (contiguous).
struct Pool {
  const uint8_t* data;
  const c10::Half* scale;
  int64_t s0, s1, s2, heads, block_size;

  Pool(const at::Tensor& t, const c10::optional<at::Tensor>& sc)
      : data(static_cast<const uint8_t*>(t.data_ptr())),
        scale(sc.has_value() ? sc->data_ptr<c10::Half>() : nullptr),
        s0(t.stride(0)), s1(t.stride(1)), s2(t.stride(2)), heads(t.size(1)), block_size(t.size(2)) {}

  // Where rows [from, from + n) of head h of the sequence whose block table is `table` lie, and for int8 their
  // scales as float32; walked a block at a time (as attention.cpp's head_rows): no division per row.
  void locate(const int64_t* table, int64_t h, int64_t from, int64_t n, const uint8_t** rows, float* scales) const {
    for (int64_t j = 0, i = from / block_size, off = from % block_size; j < n; ++j) {
      const int64_t b = table[i];
      rows[j] = data + b * s0 + h * s1 + off * s2;
      if (scale) scales[j] = static_cast<float>(scale[(b * heads + h) * block_size + off]);
      if (++off == block_size) off = 0, ++i;
    }
  }
};

constexpr int64_t kTile = 32;  // keys scored per online-softmax step (as attention_loops.h's kTile)
// Keys per piece of a context, as attention.cpp's kPiece: fixed, so that a row's sums run in one order whether it
// is decoded alone or batched (platforms/invariance.py); the pieces also keep both threads busy at batch 1.
constexpr int64_t kPiece = 128;

}  // namespace iterserve_kv_quant
