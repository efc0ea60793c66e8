// Attention on the paged KV cache: decode attention that reads K/V blocks in place, and the KV-cache write.
// Every op has a PyTorch reference path (iterserve/attention/reference.py).
//
// All arithmetic is float32 with one rounding to the storage dtype at the end; bf16 decode attention on a
// CPU with AVX512-BF16 also rounds its softmax weights to bf16 for P . V, as PyTorch's CPU attention does.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include "ops.h"
#include "parallel.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

namespace {

using namespace iterserve::vec;

// Keys scored per online-softmax step. 32 rows of 64-128 floats stay in L1 and amortise the
// per-tile rescale; 16 and 64 measured within noise of 32 on the decode benchmark.
constexpr int64_t kTile = 32;

// K in key groups: where the CPU has AVX512-BF16, a bf16 K cache with a head dim that is a multiple of 32 and
// blocks of a multiple of 16 keys is [blocks, kv_heads, block_size / 16, head_dim / 2, 16, 2]: each 16 keys of
// a block's head keep their dimension pairs side by side, so that one vdpbf16ps scores sixteen keys on one
// pair of the query (group_scores_keyed) and no sum crosses lanes. V keeps rows. K in rows is scored a key at a
// time, with sixteen keys' lanes summed by shuffles after, which costs more (docs/benchmarks-history.md).
constexpr int64_t kKeyGroup = 16;

bool keys_in_groups(at::ScalarType dtype, int64_t head_dim, int64_t block_size) {
#if defined(ITERSERVE_DPBF16) && defined(CPU_CAPABILITY_AVX512)
  return dtype == at::kBFloat16 && head_dim % 32 == 0 && block_size % kKeyGroup == 0;
#else
  return false;
#endif
}

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

#if defined(ITERSERVE_DPBF16) && defined(CPU_CAPABILITY_AVX512)
// group_values for bf16 V on AVX512-BF16: acc_g += sum_j p[g][j] v_j with the weights rounded to bf16 (as
// PyTorch's CPU flash attention rounds them before its P @ V), two keys a vdpbf16ps: the rows of keys j and
// j + 1 are interleaved element by element, so each 32-bit lane holds one dimension's pair of values: half the
// multiply instructions of widening each key to float32.
template <int G, int D>
void group_values_pairs(const float* scores, const c10::BFloat16* const* rows, int64_t n, int64_t dim, float* acc) {
  alignas(64) uint16_t pb[G][kTile + 2];  // each head's weights in bf16, a zero after the last
  for (int g = 0; g < G; ++g) {
    for (int64_t j = 0; j < kTile; j += 32) {
      const __m512 lo = _mm512_loadu_ps(scores + g * kTile + j), hi = _mm512_loadu_ps(scores + g * kTile + j + 16);
      _mm512_storeu_si512(pb[g] + j, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
    pb[g][n] = 0;
  }
  // Word i of the first (second) half: dimension i (16 + i) of key j, then of key j + 1.
  const __m512i lo_idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38,
                                          6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
  __m512 a[G][2 * D];
  for (int g = 0; g < G; ++g)
    for (int d = 0; d < 2 * D; ++d) a[g][d] = _mm512_loadu_ps(acc + g * dim + 16 * d);
  for (int64_t j = 0; j < n; j += 2) {
    const c10::BFloat16* r0 = rows[j];
    const c10::BFloat16* r1 = j + 1 < n ? rows[j + 1] : r0;  // weighed by the zero after the last
    __m512bh p[G];
    for (int g = 0; g < G; ++g) {
      uint32_t pair;
      std::memcpy(&pair, pb[g] + j, sizeof(pair));
      p[g] = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
    }
    for (int d = 0; d < D; ++d) {
      const __m512i x = _mm512_loadu_si512(r0 + 32 * d), y = _mm512_loadu_si512(r1 + 32 * d);
      const __m512bh lo = (__m512bh)_mm512_permutex2var_epi16(x, lo_idx, y);
      const __m512bh hi = (__m512bh)_mm512_permutex2var_epi16(x, hi_idx, y);
      for (int g = 0; g < G; ++g) {
        a[g][2 * d] = _mm512_dpbf16_ps(a[g][2 * d], p[g], lo);
        a[g][2 * d + 1] = _mm512_dpbf16_ps(a[g][2 * d + 1], p[g], hi);
      }
    }
  }
  for (int g = 0; g < G; ++g)
    for (int d = 0; d < 2 * D; ++d) _mm512_storeu_ps(acc + g * dim + 16 * d, a[g][d]);
}

// Scores over K stored in key groups (keys_in_groups): NG groups of 16 keys from `base[i]`, for G heads whose
// query pairs are q_stride words apart, U chains of dot products per head and group. Lane l of out[i][g] is
// scale * (q_g . key l of group i): each vdpbf16ps takes one dimension pair of sixteen keys against that pair
// of the query, broadcast, so nothing is summed across lanes. The next tile's rows are asked for a few per
// step, 16 x NG in all (RowPrefetch: asked for at once, they did not overlap the arithmetic).
template <int G, int NG, int U>
inline void key_group_scores(const uint32_t* q, int64_t q_stride, const c10::BFloat16* const* base, int64_t pairs,
                             __m512 scale, RowPrefetch<c10::BFloat16>& pf, __m512 (*out)[G]) {
  __m512 acc[NG][G][U];
  for (int i = 0; i < NG; ++i)
    for (int g = 0; g < G; ++g)
      for (int u = 0; u < U; ++u) acc[i][g][u] = _mm512_setzero_ps();
  const int64_t ask = (16 * NG * U + pairs - 1) / pairs;
  for (int64_t p = 0; p < pairs; p += U) {
    pf.ask(ask);
    for (int u = 0; u < U; ++u) {
      __m512bh k[NG];
      for (int i = 0; i < NG; ++i) k[i] = (__m512bh)_mm512_loadu_si512(base[i] + 32 * (p + u));
      for (int g = 0; g < G; ++g) {
        const __m512bh qp = (__m512bh)_mm512_set1_epi32(static_cast<int>(q[g * q_stride + p + u]));
        for (int i = 0; i < NG; ++i) acc[i][g][u] = _mm512_dpbf16_ps(acc[i][g][u], qp, k[i]);
      }
    }
  }
  for (int i = 0; i < NG; ++i)
    for (int g = 0; g < G; ++g) {
      __m512 sum = acc[i][g][0];
      for (int u = 1; u < U; ++u) sum = _mm512_add_ps(sum, acc[i][g][u]);
      out[i][g] = _mm512_mul_ps(sum, scale);
    }
}

// Lanes [from, to) of a group's scores into scores[0, to - from).
inline void store_lanes(float* scores, __m512 s, int from, int to) {
  if (from == 0 && to == 16) {
    _mm512_storeu_ps(scores, s);
    return;
  }
  const __mmask16 keep = static_cast<__mmask16>(((1u << to) - 1) & ~((1u << from) - 1));
  _mm512_mask_storeu_ps(scores, static_cast<__mmask16>((1u << (to - from)) - 1), _mm512_maskz_compress_ps(keep, s));
}

// group_scores for K in key groups: scores[g * kTile + j] = scale * (q_g . k_j) for keys [0, n) of the tile,
// whose first key is key `first` (0-15) of its group of 16; rows[j] is where key j's row would lie in the row
// layout, so rows[j] - (first + j) % 16 * dim is its group's start. Two groups at a time share each
// broadcast of the query.
template <int G>
void group_scores_keyed(const c10::BFloat16* q, int64_t q_stride, const c10::BFloat16* const* rows, int64_t first,
                        int64_t n, int64_t dim, float scale, float* scores, RowPrefetch<c10::BFloat16>& pf) {
  constexpr int U = G == 1 ? 4 : G <= 3 ? 2 : 1;
  const auto* q32 = reinterpret_cast<const uint32_t*>(q);
  const int64_t qs = q_stride / 2, pairs = dim / 2;
  const __m512 vscale = _mm512_set1_ps(scale);
  // Group i's keys are tile keys [16 i - first, 16 i - first + 16).
  const int64_t groups = (first + n + 15) / 16;
  auto base = [&](int64_t i) {
    const int64_t j = std::max<int64_t>(0, 16 * i - first);
    return rows[j] - (first + j) % 16 * dim;
  };
  auto store = [&](int64_t i, __m512 (*s)[G]) {
    const int64_t j = 16 * i - first;
    const int from = static_cast<int>(std::max<int64_t>(0, -j)), to = static_cast<int>(std::min<int64_t>(16, n - j));
    for (int g = 0; g < G; ++g) store_lanes(scores + g * kTile + j + from, (*s)[g], from, to);
  };
  int64_t i = 0;
  for (; i + 2 <= groups; i += 2) {
    const c10::BFloat16* b[2] = {base(i), base(i + 1)};
    __m512 s[2][G];
    key_group_scores<G, 2, U>(q32, qs, b, pairs, vscale, pf, s);
    store(i, &s[0]);
    store(i + 1, &s[1]);
  }
  if (i < groups) {
    const c10::BFloat16* b[1] = {base(i)};
    __m512 s[1][G];
    key_group_scores<G, 1, U>(q32, qs, b, pairs, vscale, pf, s);
    store(i, &s[0]);
  }
  pf.rest();
}

// group_scores_keyed for a group of any size, up to 8 heads at a time.
void scores_keyed(const c10::BFloat16* q, int64_t q_stride, const c10::BFloat16* const* rows, int64_t first,
                  int64_t n, int64_t dim, int64_t group, float scale, float* scores, RowPrefetch<c10::BFloat16>& pf) {
  static constexpr decltype(&group_scores_keyed<1>) by_heads[] = {
      group_scores_keyed<1>, group_scores_keyed<2>, group_scores_keyed<3>, group_scores_keyed<4>,
      group_scores_keyed<5>, group_scores_keyed<6>, group_scores_keyed<7>, group_scores_keyed<8>};
  for (int64_t g = 0; g < group; g += 8)
    by_heads[std::min<int64_t>(8, group - g) - 1](q + g * q_stride, q_stride, rows, first, n, dim, scale,
                                                   scores + g * kTile, pf);
}
#endif

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

template <typename T>
struct GroupKernels {
  void (*scores)(const float*, const T* const*, int64_t, int64_t, float*, RowPrefetch<T>&);
  void (*values)(const float*, const T* const*, int64_t, int64_t, float*);
};

// On AVX512-BF16, a bf16 group of dim 64 (1-8 heads) or 128 (1-4 heads) takes P . V on k-pairs.
template <typename T>
inline void use_pair_kernels([[maybe_unused]] GroupKernels<T>& k, [[maybe_unused]] int64_t group,
                             [[maybe_unused]] int64_t dim) {
#if defined(ITERSERVE_DPBF16) && defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    using Values = decltype(k.values);
    static constexpr Values v64[] = {group_values_pairs<1, 2>, group_values_pairs<2, 2>, group_values_pairs<3, 2>,
                                     group_values_pairs<4, 2>, group_values_pairs<5, 2>, group_values_pairs<6, 2>,
                                     group_values_pairs<7, 2>, group_values_pairs<8, 2>};
    static constexpr Values v128[] = {group_values_pairs<1, 4>, group_values_pairs<2, 4>, group_values_pairs<3, 4>,
                                      group_values_pairs<4, 4>};
    if (dim == 64) {
      k.values = v64[group - 1];
    } else if (dim == 128 && group <= 4) {
      k.values = v128[group - 1];
    }
  }
#endif
}

// The register-blocked kernels for groups of 1-8 heads and whole vectors; {nullptr, nullptr} for the rest,
// which take the per-head loops.
template <typename T>
inline GroupKernels<T> group_kernels(int64_t group, int64_t dim) {
  static constexpr GroupKernels<T> table[] = {
      {group_scores<1, T>, group_values<1, T>}, {group_scores<2, T>, group_values<2, T>},
      {group_scores<3, T>, group_values<3, T>}, {group_scores<4, T>, group_values<4, T>},
      {group_scores<5, T>, group_values<5, T>}, {group_scores<6, T>, group_values<6, T>},
      {group_scores<7, T>, group_values<7, T>}, {group_scores<8, T>, group_values<8, T>}};
  if (group < 1 || group > 8 || dim % kVecSize != 0) return {nullptr, nullptr};
  GroupKernels<T> k = table[group - 1];
  use_pair_kernels(k, group, dim);
  return k;
}

// Keys per piece of a context split across threads. Fixed, not sized to the batch: a row's sums then run in one
// order alone or batched (a piece's merge alone equals the unsplit path bit for bit).
constexpr int64_t kPiece = 128;

// Where one head's K or V rows [from, to) lie, walking the block table a block at a time: a division per
// row, four times per key (two prefetches, two reads), took a third of a decode task's time (perf, batch 8).
template <typename T>
inline void head_rows(const T* cache, const int64_t* table, int64_t block_size, int64_t s0, int64_t s2,
                      int64_t head_offset, int64_t from, int64_t to, const T** rows) {
  int64_t b = from / block_size, off = from % block_size;
  for (int64_t pos = from; pos < to; ++b, off = 0) {
    const T* base = cache + table[b] * s0 + head_offset;
    for (; off < block_size && pos < to; ++off, ++pos) *rows++ = base + off * s2;
  }
}

// Ask for n rows ahead of use. At batch 1 the step streams the weights between two layers' attention, so
// every layer's K/V comes from DRAM; fetched on demand, each row's latency is paid in turn, many times the
// time its bytes take at the streaming read rate.
template <typename T, int Locality = 3>
inline void prefetch_rows(const T* const* rows, int64_t n, int64_t row_bytes) {
  for (int64_t j = 0; j < n; ++j)
    for (int64_t b = 0; b < row_bytes; b += 64)
      __builtin_prefetch(reinterpret_cast<const char*>(rows[j]) + b, 0, Locality);
}

// A tile walk's per-thread state: the query widened, the running output, max and sum of exps of each head of
// the GQA group, and the K/V rows of this tile, the next, the one after it and the next task's first.
template <typename T>
struct TileWalk {
  float *qf, *acc, *rows, *scores, *m, *l;
  const T* krows[2][kTile];  // this tile's keys and values, and the next tile's
  const T* vrows[2][kTile];
  const T* far_k[kTile];  // the tile after the next one
  const T* far_v[kTile];
  const T* ahead_k[kTile];  // the next task's first tile, found and asked for by the task before it
  const T* ahead_v[kTile];
  int64_t ahead_n = 0;
};

// The task after this one in the chunk: its sequence, head and keys, and whether its second tile is still to ask for.
struct NextTask {
  int64_t s = 0, h = 0, lo = 0, hi = 0;
  bool far = false;
};

// One decode attention over paged K/V: a task per (sequence, KV head, piece of its context) reads its head's K/V
// once for the whole GQA group. Pieces of kPiece keys also keep every thread busy at small batches (3 pairs for
// SmolLM2 at batch 1); their partial softmaxes are merged after, empty ones (shorter contexts) weighing nothing.
template <typename T>
struct PagedDecode {
  const T *q_ptr, *k_ptr, *v_ptr;
  T* out_ptr;
  const int64_t *tables, *ctx_lens;
  int64_t seqs, heads, dim, kv_heads, block_size, group, sliding_window;
  int64_t q_s0, q_s1, o_s0, o_s1, kc_s0, kc_s1, kc_s2, vc_s0, vc_s1, vc_s2, table_stride, row_bytes;
  bool keyed;  // K in key groups
  float fscale;
  int64_t splits = 1, pstride = 0;
  float* partial = nullptr;  // per (sequence, head, piece): the running max, the sum of exps, the output
  GroupKernels<T> blocked{};

  int64_t first_key(int64_t s) const {
    return sliding_window > 0 ? std::max<int64_t>(0, ctx_lens[s] - sliding_window) : int64_t{0};
  }

  // Task -> its sequence, KV head and key range [lo, hi).
  void span(int64_t task, int64_t& s, int64_t& h, int64_t& lo, int64_t& hi) const {
    s = task / (kv_heads * splits);
    h = (task / splits) % kv_heads;
    lo = first_key(s) + (task % splits) * kPiece;
    hi = std::min(ctx_lens[s], lo + kPiece);
  }

  // Where keys and values [from, to) of sequence s's head h lie in the caches.
  void key_rows(int64_t s, int64_t h, int64_t from, int64_t to, const T** out) const {
    head_rows(k_ptr, tables + s * table_stride, block_size, kc_s0, kc_s2, h * kc_s1, from, to, out);
  }
  void value_rows(int64_t s, int64_t h, int64_t from, int64_t to, const T** out) const {
    head_rows(v_ptr, tables + s * table_stride, block_size, vc_s0, vc_s2, h * vc_s1, from, to, out);
  }

  // Sequence s's head h, keys [from, to) (at most a tile), asked for into L2 all at once.
  void into_l2(TileWalk<T>& w, int64_t s, int64_t h, int64_t from, int64_t to) const {
    if (to <= from) return;
    key_rows(s, h, from, to, w.far_k);
    value_rows(s, h, from, to, w.far_v);
    prefetch_rows<T, 2>(w.far_k, to - from, row_bytes);
    prefetch_rows<T, 2>(w.far_v, to - from, row_bytes);
  }

  // The tasks of a chunk run in order, so a task asks for the next one's first tile of K and V as it starts:
  // a task that started cold waited on DRAM for it.
  void run(int64_t begin, int64_t end) const {
    thread_local std::vector<float> scratch;  // per thread, grown once: a malloc per task showed at batch 64
    scratch.resize(2 * group * dim + kTile * dim + group * kTile + 2 * group);
    TileWalk<T> w;
    w.qf = scratch.data();
    w.acc = w.qf + group * dim;
    w.rows = w.acc + group * dim;
    w.scores = w.rows + kTile * dim;
    w.m = w.scores + group * kTile;
    w.l = w.m + group;
    for (int64_t task = begin; task < end; ++task) attend(w, task, task == begin, task + 1 < end);
  }

  void attend(TileWalk<T>& w, int64_t task, bool cold, bool has_next) const {
    int64_t s, h, lo, hi;
    span(task, s, h, lo, hi);
    const int64_t first = std::max<int64_t>(0, std::min(hi, lo + kTile) - lo);
    if (cold) {
      key_rows(s, h, lo, lo + first, w.krows[0]);
      value_rows(s, h, lo, lo + first, w.vrows[0]);
      prefetch_rows(w.krows[0], first, row_bytes);
      prefetch_rows(w.vrows[0], first, row_bytes);
    } else {
      std::copy(w.ahead_k, w.ahead_k + first, w.krows[0]);
      std::copy(w.ahead_v, w.ahead_v + first, w.vrows[0]);
    }
    w.ahead_n = 0;
    NextTask next;
    if (has_next) {  // asked for during this task's last tile
      span(task + 1, next.s, next.h, next.lo, next.hi);
      next.far = true;
      w.ahead_n = std::max<int64_t>(0, std::min(next.hi, next.lo + kTile) - next.lo);
      key_rows(next.s, next.h, next.lo, next.lo + w.ahead_n, w.ahead_k);
      value_rows(next.s, next.h, next.lo, next.lo + w.ahead_n, w.ahead_v);
    }
    const T* q_group = q_ptr + s * q_s0 + h * group * q_s1;
    if (!keyed) {  // the float kernels' query: widened and scaled
      for (int64_t g = 0; g < group; ++g) {
        to_float(q_group + g * q_s1, w.qf + g * dim, dim);
        scale_(w.qf + g * dim, fscale, dim);
      }
    }
    std::fill(w.acc, w.acc + group * dim, 0.f);
    std::fill(w.m, w.m + group, -std::numeric_limits<float>::infinity());
    std::fill(w.l, w.l + group, 0.f);
    for (int64_t t0 = lo, cur = 0; t0 < hi; t0 += kTile, cur ^= 1) tile(w, s, h, t0, hi, cur, q_group, next);
    store(w, s, h, task);
  }

  void tile(TileWalk<T>& w, int64_t s, int64_t h, int64_t t0, int64_t hi, int64_t cur, const T* q_group,
            NextTask& next_task) const {
    const int64_t n = std::min(kTile, hi - t0);
    // The next tile's K and V (the next task's first, after the last) arrive while this tile is computed.
    const int64_t next = std::min(hi, t0 + n + kTile);
    key_rows(s, h, t0 + n, next, w.krows[cur ^ 1]);
    value_rows(s, h, t0 + n, next, w.vrows[cur ^ 1]);
    RowPrefetch<T> pf = next > t0 + n ? RowPrefetch<T>{w.krows[cur ^ 1], w.vrows[cur ^ 1], next - t0 - n, row_bytes}
                                      : RowPrefetch<T>{w.ahead_k, w.ahead_v, w.ahead_n, row_bytes};
    // The tile after that into L2, all at once, so that the next tile's fetch finds it there rather than
    // DRAM (docs/cpu.md, "Keeping the memory busy"); past this task's end, the next task's second tile.
    if (next < hi) {
      into_l2(w, s, h, next, std::min(hi, next + kTile));
    } else if (next_task.far) {
      next_task.far = false;
      into_l2(w, next_task.s, next_task.h, next_task.lo + w.ahead_n,
              std::min(next_task.hi, next_task.lo + w.ahead_n + kTile));
    }
    scores(w, cur, n, t0, q_group, pf);
    for (int64_t g = 0; g < group; ++g) {
      float* sc = w.scores + g * kTile;
      const float new_m = std::max(w.m[g], max_of(sc, n));
      const float correction = std::exp(w.m[g] - new_m);  // 0 on the first tile (m = -inf)
      w.l[g] = w.l[g] * correction + exp_sum_(sc, new_m, n);
      if (correction != 1.f) scale_(w.acc + g * dim, correction, dim);  // 1 once the tiles' max settles
      w.m[g] = new_m;
    }
    if (blocked.values != nullptr) {
      blocked.values(w.scores, w.vrows[cur], n, dim, w.acc);
      return;
    }
    for (int64_t j = 0; j < n; ++j) to_float(w.vrows[cur][j], w.rows + j * dim, dim);
    for (int64_t g = 0; g < group; ++g)
      for (int64_t j = 0; j < n; ++j) axpy(w.acc + g * dim, w.scores[g * kTile + j], w.rows + j * dim, dim);
  }

  void scores(TileWalk<T>& w, int64_t cur, int64_t n, int64_t t0, [[maybe_unused]] const T* q_group,
              RowPrefetch<T>& pf) const {
    if (keyed) {
#if defined(ITERSERVE_DPBF16) && defined(CPU_CAPABILITY_AVX512)
      if constexpr (std::is_same_v<T, c10::BFloat16>)
        scores_keyed(q_group, q_s1, w.krows[cur], t0 % kKeyGroup, n, dim, group, fscale, w.scores, pf);
#endif
    } else if (blocked.scores != nullptr) {
      blocked.scores(w.qf, w.krows[cur], n, dim, w.scores, pf);
    } else {
      pf.rest();
      for (int64_t j = 0; j < n; ++j) to_float(w.krows[cur][j], w.rows + j * dim, dim);
      for (int64_t g = 0; g < group; ++g)
        for (int64_t j = 0; j < n; ++j) w.scores[g * kTile + j] = dot(w.qf + g * dim, w.rows + j * dim, dim);
    }
  }

  // A whole context normalised into out; a piece of one kept for the merge.
  void store(const TileWalk<T>& w, int64_t s, int64_t h, int64_t task) const {
    for (int64_t g = 0; g < group; ++g) {
      if (splits == 1) {
        scale_(w.acc + g * dim, 1.f / w.l[g], dim);
        from_float(w.acc + g * dim, out_ptr + s * o_s0 + (h * group + g) * o_s1, dim);
        continue;
      }
      float* p = partial + ((s * heads + h * group + g) * splits + task % splits) * pstride;
      p[0] = w.m[g];  // -inf for an empty piece (a shorter context than the longest): it weighs nothing
      p[1] = w.l[g];
      std::copy(w.acc + g * dim, w.acc + (g + 1) * dim, p + 2);
    }
  }

  // Merge the pieces of each (sequence, head): rescale each to the largest max and normalise once.
  void merge() const {
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
        scale_(merged.data(), 1.f / total, dim);
        from_float(merged.data(), out_ptr + (sh / heads) * o_s0 + (sh % heads) * o_s1, dim);
      }
    });
  }
};

template <typename T>
void paged_decode_impl(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                       int64_t sliding_window) {
  const bool keyed = k_cache.dim() == 6;
  const int64_t dim = q.size(2), kv_heads = v_cache.size(1);
  PagedDecode<T> d{q.data_ptr<T>(), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(), out.data_ptr<T>(),
                   block_tables.data_ptr<int64_t>(), context_lens.data_ptr<int64_t>(),
                   q.size(0), q.size(1), dim, kv_heads, v_cache.size(2), q.size(1) / kv_heads, sliding_window,
                   q.stride(0), q.stride(1), out.stride(0), out.stride(1),
                   // in key groups, key t of a block's head lies in the group that starts where row t would
                   k_cache.stride(0), k_cache.stride(1), keyed ? dim : k_cache.stride(2),
                   v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
                   dim * static_cast<int64_t>(sizeof(T)), keyed, static_cast<float>(scale)};
  int64_t longest = 0;
  for (int64_t s = 0; s < d.seqs; ++s) longest = std::max(longest, d.ctx_lens[s] - d.first_key(s));
  d.splits = std::max<int64_t>(1, (longest + kPiece - 1) / kPiece);
  d.pstride = dim + 2;
  std::vector<float> partial(d.splits > 1 ? d.seqs * d.heads * d.splits * d.pstride : 0);
  d.partial = partial.data();
  d.blocked = group_kernels<T>(d.group, dim);
  // Four chunks a thread, as for the matmuls.
  const int64_t tasks = d.seqs * kv_heads * d.splits;
  const int64_t chunk = std::max<int64_t>(1, tasks / (4 * iterserve::ChunkPool::get().threads()));
  iterserve::parallel_chunks(tasks, chunk, [&](int64_t begin, int64_t end) { d.run(begin, end); });
  if (d.splits > 1) d.merge();
}

// The K cache (rows [blocks, kv_heads, block_size, head_dim], or in key groups: keys_in_groups) and the V cache
// (rows) for keys k and values v; paged_decode passes its query as both, whose dtype and head_dim they share.
void check_caches(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache, const at::Tensor& v_cache) {
  TORCH_CHECK(k_cache.scalar_type() == k.scalar_type() && v_cache.scalar_type() == v.scalar_type(),
              "KV cache dtype differs from the query");
  TORCH_CHECK(v_cache.dim() == 4 && v_cache.stride(3) == 1, "V cache must be [blocks, kv_heads, block_size, head_dim]");
  TORCH_CHECK(v_cache.size(3) == v.size(-1), "KV cache head_dim differs from the query");
  TORCH_CHECK(k_cache.dim() >= 2 && k_cache.size(1) == v_cache.size(1), "K and V caches hold different kv_heads");
  if (k_cache.dim() == 6) {
    TORCH_CHECK(k_cache.is_contiguous() && k_cache.size(4) == kKeyGroup && k_cache.size(5) == 2 &&
                    k_cache.size(3) * 2 == k.size(-1) && k_cache.size(2) * kKeyGroup == v_cache.size(2),
                "K cache in key groups must be [blocks, kv_heads, block_size / 16, head_dim / 2, 16, 2]");
    TORCH_CHECK(keys_in_groups(k_cache.scalar_type(), k.size(-1), v_cache.size(2)),
                "K in key groups needs bf16 on a CPU with AVX512-BF16, head_dim % 32 == 0, block_size % 16 == 0");
    return;
  }
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.stride(3) == 1, "K cache must be [blocks, kv_heads, block_size, head_dim]");
  TORCH_CHECK(k_cache.size(3) == k.size(-1), "KV cache head_dim differs from the query");
}

}  // namespace

// out[s, head] = softmax(q[s, head] . K_s^T * scale) V_s over the context of sequence s, K_s/V_s read
// from the blocks listed in block_tables[s]; sliding_window <= 0 means no window.
void paged_decode(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                  int64_t sliding_window) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && out.stride(2) == 1, "q/out must be [seqs, heads, head_dim]");
  check_caches(q, q, k_cache, v_cache);
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "heads must be a multiple of kv_heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "block tables and context lengths must be int64");
  TORCH_CHECK(block_tables.stride(1) == 1 && context_lens.is_contiguous(), "block tables must be row-major");
  DISPATCH_FLOAT_TYPES(q.scalar_type(), "paged_decode", [&] {
    paged_decode_impl<scalar_t>(out, q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window);
  });
}

// k_cache[blocks[i], :, offsets[i]] = k[i] (and the same for v); k/v may be strided views of the QKV output.
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
              const at::Tensor& slot_blocks, const at::Tensor& slot_offsets) {
  check_caches(k, v, k_cache, v_cache);
  TORCH_CHECK(k.dim() == 3 && k.stride(2) == 1 && v.stride(2) == 1, "k/v must be [tokens, kv_heads, head_dim]");
  TORCH_CHECK(slot_blocks.is_contiguous() && slot_offsets.is_contiguous() && slot_blocks.scalar_type() == at::kLong,
              "slots must be contiguous int64");
  const int64_t tokens = k.size(0), kv_heads = k.size(1), dim = k.size(2);
  const int64_t* blocks = slot_blocks.data_ptr<int64_t>();
  const int64_t* offsets = slot_offsets.data_ptr<int64_t>();
  const int64_t bytes = dim * k.element_size();
  auto* kp = static_cast<const char*>(k.data_ptr());
  auto* vp = static_cast<const char*>(v.data_ptr());
  auto* kc = static_cast<char*>(k_cache.data_ptr());
  auto* vc = static_cast<char*>(v_cache.data_ptr());
  const int64_t es = k.element_size();
  const bool keyed = k_cache.dim() == 6;
  iterserve::parallel_chunks(tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      for (int64_t h = 0; h < kv_heads; ++h) {
        const char* src = kp + (i * k.stride(0) + h * k.stride(1)) * es;
        if (keyed) {  // dimension pair p of key t at word p * 16 + t % 16 of t's group
          auto* group = reinterpret_cast<uint32_t*>(
              kc + (blocks[i] * k_cache.stride(0) + h * k_cache.stride(1) + offsets[i] / kKeyGroup * k_cache.stride(2)) * es);
          for (int64_t p = 0; p < dim / 2; ++p)
            std::memcpy(group + p * kKeyGroup + offsets[i] % kKeyGroup, src + p * 2 * es, 2 * es);
        } else {
          std::memcpy(kc + (blocks[i] * k_cache.stride(0) + h * k_cache.stride(1) + offsets[i] * k_cache.stride(2)) * es,
                      src, bytes);
        }
        std::memcpy(vc + (blocks[i] * v_cache.stride(0) + h * v_cache.stride(1) + offsets[i] * v_cache.stride(2)) * es,
                    vp + (i * v.stride(0) + h * v.stride(1)) * es, bytes);
      }
    }
  });
}

TORCH_LIBRARY_FRAGMENT(iterserve, m) {
  m.def("paged_decode(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor context_lens, float scale, int sliding_window) -> ()");
  m.def("write_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_blocks, "
        "Tensor slot_offsets) -> ()");
  // Whether paged_decode and write_kv take a K cache of this kind in key groups (no tensor: any backend)
  m.def("keys_in_groups(ScalarType dtype, int head_dim, int block_size) -> bool", &keys_in_groups);
}

TORCH_LIBRARY_IMPL(iterserve, CPU, m) {
  m.impl("paged_decode", &paged_decode);
  m.impl("write_kv", &write_kv);
}
