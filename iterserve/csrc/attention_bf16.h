// The AVX512-BF16 loops of paged decode attention (attention.cpp): P . V on bf16 V two keys a vdpbf16ps, and
// the scores of a bf16 K cache stored in key groups (keys_in_groups, ops.h).
#pragma once

#include "attention_loops.h"

#include <cstdint>

namespace iterserve_attention {

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
inline void scores_keyed(const c10::BFloat16* q, int64_t q_stride, const c10::BFloat16* const* rows, int64_t first,
                  int64_t n, int64_t dim, int64_t group, float scale, float* scores, RowPrefetch<c10::BFloat16>& pf) {
  static constexpr decltype(&group_scores_keyed<1>) by_heads[] = {
      group_scores_keyed<1>, group_scores_keyed<2>, group_scores_keyed<3>, group_scores_keyed<4>,
      group_scores_keyed<5>, group_scores_keyed<6>, group_scores_keyed<7>, group_scores_keyed<8>};
  for (int64_t g = 0; g < group; g += 8)
    by_heads[std::min<int64_t>(8, group - g) - 1](q + g * q_stride, q_stride, rows, first, n, dim, scale,
                                                   scores + g * kTile, pf);
}
#endif

}  // namespace iterserve_attention
