// The inner loops of paged decode attention (attention.cpp) on K/V rows of any float dtype: a tile's scores
// for a GQA group of heads, its values weighed into the running output, and the softmax's vector helpers. The
// AVX512-BF16 loops (bf16 K/V, K in key groups) are in attention_bf16.h.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include "ops.h"
#include "parallel.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

namespace iterserve_attention {

using namespace iterserve::vec;

// Keys scored per online-softmax step: 32 rows of 64-128 floats stay in L1 and amortise the per-tile rescale
// (16 and 64 were no faster: docs/benchmarks-history.md).
constexpr int64_t kTile = 32;

// y += a * x
inline void axpy(float* y, float a, const float* x, int64_t n) {
  const Vec va(a);
  int64_t i = 0;
  for (; i + kVecSize <= n; i += kVecSize) at::vec::fmadd(va, Vec::loadu(x + i), Vec::loadu(y + i)).store(y + i);
  for (; i < n; ++i) y[i] += a * x[i];
}

inline void scale_(float* y, float a, int64_t n) {
  const Vec va(a);
  int64_t i = 0;
  for (; i + kVecSize <= n; i += kVecSize) (Vec::loadu(y + i) * va).store(y + i);
  for (; i < n; ++i) y[i] *= a;
}

// The largest of p[0, n), one vector at a time and one reduction: one reduction instead of one per vector as
// at::vec::reduce_all's max does (equal to the bit).
inline float max_of(const float* p, int64_t n) {
  Vec best(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + kVecSize <= n; i += kVecSize) best = at::vec::maximum(best, Vec::loadu(p + i));
  float out = best.reduce_max();
  for (; i < n; ++i) out = std::max(out, p[i]);
  return out;
}

// p[i] = exp(p[i] - m) for i < n; returns the sum.
inline float exp_sum_(float* p, float m, int64_t n) {
  const Vec vm(m);
  int64_t i = 0;
  float sum = 0.f;
  for (; i + kVecSize <= n; i += kVecSize) {
    Vec e = (Vec::loadu(p + i) - vm).exp_u20();
    e.store(p + i);
    sum += e.reduce_add();
  }
  for (; i < n; ++i) {
    p[i] = std::exp(p[i] - m);
    sum += p[i];
  }
  return sum;
}

// q_g . k for P keys, one vector of partial sums per head and key: each K vector is loaded (and widened) once
// for all G heads, read where it lies in the cache, and each q vector once for the P keys.
template <int G, int P, typename T>
inline void key_partials(const float* qf, const T* const* k, int64_t dim, Vec (*acc)[G]) {
  for (int p = 0; p < P; ++p)
    for (int g = 0; g < G; ++g) acc[p][g] = Vec(0.f);
  for (int64_t i = 0; i < dim; i += kVecSize) {
    Vec kv[P];
    for (int p = 0; p < P; ++p) kv[p] = load_f(k[p] + i);
    for (int g = 0; g < G; ++g) {
      const Vec qv = Vec::loadu(qf + g * dim + i);
      for (int p = 0; p < P; ++p) acc[p][g] = at::vec::fmadd(qv, kv[p], acc[p][g]);
    }
  }
}

#if defined(CPU_CAPABILITY_AVX512)
// Lane j of the result is the sum of v[j]'s sixteen lanes: a transposing add tree, 45 shuffles and adds for
// sixteen sums where sixteen separate reductions take about 150. Each sum depends on its own vector alone.
inline __m512 sum16(const float (*v)[16]) {
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane: [v2i 0+2, v2i+1 0+2, v2i 1+3, v2i+1 1+3]
    const __m512 x = _mm512_load_ps(v[2 * i]), y = _mm512_load_ps(v[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y));
  }
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: that lane's sums of v4i .. v4i+3
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
  for (int i = 0; i < 2; ++i)  // the four lanes added in pairs
    d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], 0x88), _mm512_shuffle_f32x4(d[0], d[1], 0xDD));
}
#endif

// The next tile's K and V rows, asked for a few at a time while this tile's scores are computed. Asked for all
// at once at the start of a tile, the fetch does not overlap the arithmetic and K/V from DRAM arrive at about
// half the rate they do from cache (docs/benchmarks-history.md).
template <typename T>
struct RowPrefetch {
  const T* const* k;
  const T* const* v;
  int64_t n, row_bytes, next = 0;
  void ask(int64_t rows) {
    for (const int64_t end = std::min(n, next + rows); next < end; ++next)
      for (int64_t b = 0; b < row_bytes; b += 64) {
        __builtin_prefetch(reinterpret_cast<const char*>(k[next]) + b);
        __builtin_prefetch(reinterpret_cast<const char*>(v[next]) + b);
      }
  }
  void rest() { ask(n - next); }
};

#if defined(CPU_CAPABILITY_AVX512)
// scores[g * kTile + j] = scale * (q_g . k_j) for n keys, sixteen at a time: pair(j, count, acc) leaves in
// acc[p][g] head g's vector of partial sums for key j + p (zero for p >= count; count <= 2), and sixteen keys'
// vectors are reduced together.
template <int G, typename T, typename Pair>
inline void scores_by_sixteen(int64_t n, float scale, float* scores, RowPrefetch<T>& pf, Pair&& pair) {
  static_assert(kTile % 16 == 0, "a tile's score rows hold whole groups of sixteen");
  alignas(64) float part[G][16][16];
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int64_t keys = std::min<int64_t>(16, n - j0);
    for (int64_t j = 0; j < 16; j += 2) {
      pf.ask(2);
      __m512 acc[2][G];
      pair(j0 + j, std::clamp<int64_t>(keys - j, 0, 2), acc);
      for (int g = 0; g < G; ++g) {
        _mm512_store_ps(part[g][j], acc[0][g]);
        _mm512_store_ps(part[g][j + 1], acc[1][g]);
      }
    }
    for (int g = 0; g < G; ++g) _mm512_storeu_ps(scores + g * kTile + j0, _mm512_mul_ps(sum16(part[g]), vscale));
  }
  pf.rest();
}
#endif

// The tile's scores for a GQA group of G query heads sharing one KV head, scores[g * kTile + j] = q_g . k_j,
// reading key j where it lies in the cache (rows[j]). Needs dim to be a multiple of the vector width. With
// AVX-512, two keys at a time (twice the independent sums) and sixteen keys' partial sums reduced together.
template <int G, typename T>
void group_scores(const float* qf, const T* const* rows, int64_t n, int64_t dim, float* scores, RowPrefetch<T>& pf) {
#if defined(CPU_CAPABILITY_AVX512)
  scores_by_sixteen<G>(n, 1.f, scores, pf, [&](int64_t j, int64_t count, __m512 (*acc)[G]) {
    Vec v[2][G];
    if (count == 2) {
      key_partials<G, 2>(qf, rows + j, dim, v);
    } else if (count == 1) {
      key_partials<G, 1>(qf, rows + j, dim, v);
      for (int g = 0; g < G; ++g) v[1][g] = Vec(0.f);
    } else {
      for (int g = 0; g < G; ++g) v[0][g] = v[1][g] = Vec(0.f);
    }
    for (int p = 0; p < 2; ++p)
      for (int g = 0; g < G; ++g) acc[p][g] = v[p][g];
  });
#else
  for (int64_t j = 0; j < n; ++j) {
    pf.ask(1);
    Vec acc[1][G];
    key_partials<G, 1>(qf, rows + j, dim, acc);
    for (int g = 0; g < G; ++g) scores[g * kTile + j] = acc[0][g].reduce_add();
  }
  pf.rest();
#endif
}

// acc_g += sum_j p[g][j] v_j over the tile, R vectors of the head at a time with the G heads' sums held in
// registers: each V vector is loaded once and no accumulator is reloaded per key. One vector at a time, the
// G sums were G chains of n dependent FMAs, bound by the FMA's latency; G x R chains pipeline.
template <int G, int R, typename T>
void values_block(const float* scores, const T* const* rows, int64_t n, int64_t dim, float* acc) {
  for (int64_t i = 0; i < dim; i += R * kVecSize) {
    Vec a[G][R];
    for (int g = 0; g < G; ++g)
      for (int r = 0; r < R; ++r) a[g][r] = Vec::loadu(acc + g * dim + i + r * kVecSize);
    for (int64_t j = 0; j < n; ++j) {
      Vec v[R];
      for (int r = 0; r < R; ++r) v[r] = load_f(rows[j] + i + r * kVecSize);
      for (int g = 0; g < G; ++g) {
        const Vec p(scores[g * kTile + j]);
        for (int r = 0; r < R; ++r) a[g][r] = at::vec::fmadd(p, v[r], a[g][r]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int r = 0; r < R; ++r) a[g][r].store(acc + g * dim + i + r * kVecSize);
  }
}

// The widest R whose G x R sums, R V vectors and a score fit in the vector registers (32 with AVX-512, else 16).
constexpr int values_width(int g) {
  const int regs = kVecSize == 16 ? 32 : 16;
  return g * 4 + 5 <= regs ? 4 : g * 2 + 3 <= regs ? 2 : 1;
}

template <int G, typename T>
void group_values(const float* scores, const T* const* rows, int64_t n, int64_t dim, float* acc) {
  constexpr int R = values_width(G);
  if ((dim / kVecSize) % R == 0) {
    values_block<G, R, T>(scores, rows, n, dim, acc);
  } else {
    values_block<G, 1, T>(scores, rows, n, dim, acc);
  }
}

// Split-context decode's last pass, shared by the float and the quantized caches: each (sequence, head)'s pieces
// ([max, sum, dim values] each, pstride = dim + 2 apart) rescaled to the largest max, in piece order, and
// normalised once into out; a head with no keys at all gets zeros.
template <typename T>
void merge_pieces(const float* partial, int64_t seqs, int64_t heads, int64_t splits, int64_t dim, T* out,
                  int64_t o_s0, int64_t o_s1) {
  const int64_t pstride = dim + 2;
  iterserve::parallel_chunks(seqs * heads, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> merged(dim);
    for (int64_t sh = begin; sh < end; ++sh) {
      const float* p = partial + sh * splits * pstride;
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t i = 0; i < splits; ++i) top = std::max(top, p[i * pstride]);
      std::fill(merged.begin(), merged.end(), 0.f);
      float total = 0.f;
      for (int64_t i = 0; i < splits; ++i) {
        const float* pi = p + i * pstride;
        if (pi[1] == 0.f) continue;
        const float w = std::exp(pi[0] - top);
        total += w * pi[1];
        axpy(merged.data(), w, pi + 2, dim);
      }
      scale_(merged.data(), total > 0.f ? 1.f / total : 0.f, dim);
      from_float(merged.data(), out + (sh / heads) * o_s0 + (sh % heads) * o_s1, dim);
    }
  });
}

}  // namespace iterserve_attention
