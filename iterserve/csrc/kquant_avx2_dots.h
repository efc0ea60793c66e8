// The AVX2 side of the GGUF matmul (kquant_ops.cpp), its int8 dots: a decoded tile's codes (kquant_avx2.h) times
// rows of activations (rows_of), or a single row times the codes in the decoder's registers (fused_units), in the
// same integer dots and float steps per 32-block, in the same order, so that a row's result does not depend on the
// row count: kquant_avx512.h's steps, but for Q4_K and Q5_K, whose integer sub-block scales multiply the dots
// exactly (int_step) and whose d and offsets follow once a super-block.
#pragma once

#include "kquant_avx2.h"

namespace iterserve_kquant::avx2 {

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
// vpmaddubsw: the unsigned codes (+ Bias) times the signed inputs, two products to a 16-bit sum. Q8_0's codes
// (Bias 128) go in as |q| with q's sign moved onto the input (|q| <= 128, |x| <= 127: a pair fits).
template <class C>
[[gnu::always_inline]] inline __m256i products(__m256i w, __m256i xb) {
  if constexpr (C::kBias == 128) {
    const __m256i q = _mm256_xor_si256(w, _mm256_set1_epi8(static_cast<char>(0x80)));
    return _mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(xb, q));
  } else {
    return _mm256_maddubs_epi16(w, xb);
  }
}

// How many registers of a type's products an N-register dot adds in 16 bits before widening (each pair sum at most
// 2 * Most * 127).
template <class C, int N>
constexpr int per_widening() {
  constexpr int fit = C::kBias == 128 ? 1 : 32767 / (2 * C::kMost * 127);
  return fit < N ? fit : N;
}

// The int32 dot of N registers of codes (+ Bias), w(j), with the broadcast inputs xb(j), exactly; the Bias term
// follows in the float steps. Widened by vpmaddwd with `by`: ones, or a lane's integer scale (Bias 0 only).
template <class C, int N, class W, class X>
[[gnu::always_inline]] inline __m256i dot(const W& w, const X& xb, __m256i by = _mm256_set1_epi16(1)) {
  constexpr int per = per_widening<C, N>();
  static_assert(per > 0 && N % per == 0);
  __m256i total = _mm256_setzero_si256();
  for (int j = 0; j < N; j += per) {
    __m256i p = products<C>(w(j), xb(j));
    for (int i = 1; i < per; ++i) p = _mm256_add_epi16(p, products<C>(w(j + i), xb(j + i)));
    total = _mm256_add_epi32(total, _mm256_madd_epi16(p, by));
  }
  return total;
}

// A dot less Bias * sum(x) (Q8_0's sign trick has no such term), exactly.
template <class C>
[[gnu::always_inline]] inline __m256i unbiased(__m256i dot, int32_t sum) {
  if constexpr (C::kBias == 0 || C::kBias == 128) return dot;
  else return _mm256_add_epi32(dot, _mm256_set1_epi32(-C::kBias * sum));
}

// Inputs 4 j .. 4 j + 3 of row r's 32-block from group ga on, in every lane.
[[gnu::always_inline]] inline __m256i broadcast(const Activations& x, int64_t r, int64_t ga, int j) {
  return _mm256_set1_epi32(load_i32(x.a.row(r) + ga * kGroup + 4 * j));
}

// One row's share of a 32-block (groups ga, ga + 1 of 16 inputs) for 8 columns, from its int32 dots (one for
// Pairs, else one a group; dot()'s) and group g's scales and offsets at s + g * kCols, o + g * kCols. The float
// steps of kquant_avx512.h's row_step, in its order: Pairs take one step for both groups; else the groups' scaled
// dots (and offsets) are summed, then scaled by the row's a_d once.
template <class C>
[[gnu::always_inline]] inline __m256 block_step(const __m256i* dots, const Activations& x, int64_t r, int64_t ga,
                                                const float* s, const float* o, __m256 out) {
  const float ad = x.d(r, ga);
  if constexpr (C::kPairs) {
    const int32_t sum = x.a.sum[r * x.a.blocks + ga / 2];
    const __m256 dot8 = _mm256_cvtepi32_ps(unbiased<C>(dots[0], sum));
    out = _mm256_fmadd_ps(dot8, _mm256_mul_ps(_mm256_loadu_ps(s), _mm256_set1_ps(ad)), out);
    if constexpr (C::kOffset)
      out = _mm256_fmadd_ps(_mm256_loadu_ps(o), _mm256_set1_ps(x.e(r, ga)), out);
    return out;
  } else {
    __m256 acc = _mm256_setzero_ps();
    for (int h = 0; h < 2; ++h) {
      const int32_t sum = x.sum(r, ga + h);
      const __m256 dot4 = _mm256_cvtepi32_ps(unbiased<C>(dots[h], sum));
      const __m256 sh = _mm256_loadu_ps(s + h * kCols);
      acc = h == 0 ? _mm256_mul_ps(dot4, sh) : _mm256_fmadd_ps(dot4, sh, acc);
      if constexpr (C::kOffset)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(o + h * kCols), _mm256_set1_ps(static_cast<float>(sum)), acc);
    }
    return _mm256_fmadd_ps(acc, _mm256_set1_ps(ad), out);
  }
}

// block_step with the codes w(0..7) and the row's inputs xb(0..7) in registers.
template <class C, class W, class X>
[[gnu::always_inline]] inline __m256 row_step(const W& w, const X& xb, const Activations& x, int64_t r, int64_t ga,
                                              const float* s, const float* o, __m256 out) {
  __m256i dots[2];
  if constexpr (C::kPairs) {
    dots[0] = dot<C, 8>(w, xb);
  } else {
#pragma GCC unroll 2  // unrolled, the decoders' bit positions are constants
    for (int h = 0; h < 2; ++h)
      dots[h] = dot<C, 4>([&](int j) { return w(4 * h + j); }, [&](int j) { return xb(4 * h + j); });
  }
  return block_step<C>(dots, x, r, ga, s, o, out);
}

// Eight lanes' integer scales (Tile::sc's layout) for vpmaddwd.
[[gnu::always_inline]] inline __m256i int_scales_at(const int32_t* isc) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(isc));
}

// Integer scales (Q4_K, Q5_K): one row's 32-block dot, already times the block's integer scale (vpmaddwd by it), times
// the row's a_d into the unit's sum; d and the offsets follow once a unit (int_unit_end).
[[gnu::always_inline]] inline __m256 int_step(__m256i scaled, const Activations& x, int64_t r, int64_t ga,
                                              __m256 sum) {
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(scaled), _mm256_set1_ps(x.d(r, ga)), sum);
}

// out + the unit's sum (int_step's) times d, then its offsets, o(b) * a_d * sum(a) in block order: the same steps in
// the same order for a row alone or among others.
[[gnu::always_inline]] inline __m256 int_unit_end(const Activations& x, int64_t r, int64_t ga, const float* d,
                                                  const float* o, __m256 sum, __m256 out) {
  out = _mm256_fmadd_ps(sum, _mm256_loadu_ps(d), out);
  __m256 off = _mm256_mul_ps(_mm256_loadu_ps(o), _mm256_set1_ps(x.e(r, ga)));
  for (int b = 1; b < kUnit / 32; ++b)
    off = _mm256_fmadd_ps(_mm256_loadu_ps(o + 2 * b * kCols), _mm256_set1_ps(x.e(r, ga + 2 * b)), off);
  return _mm256_add_ps(out, off);
}

// acc[r][c] for rows [r0, r0 + MR) += the tile (unit u, codes + 128) times the rows. Per 32-block each register of
// codes (+ Bias) of both halves of the columns meets each row's broadcast inputs once, and the rows' 16-bit sums
// widen as dot() widens them, so the int32 dots, and the float steps after them, are a row's alone. Int: the tile
// holds integer scales (Tile::int_scales).
template <class C, int MR, bool Int>
void rows_of(const Tile& t, const Activations& x, int64_t u, int64_t r0, float* acc) {
  static_assert(!Int || (C::kBias == 0 && C::kPairs && C::kOffset));
  constexpr int kN = C::kPairs ? 8 : 4, kPer = per_widening<C, kN>();  // registers a dot, a 16-bit sum
  const __m256i shift = _mm256_set1_epi8(static_cast<char>(128 - C::kBias));
  __m256 out[MR][2];
  for (int r = 0; r < MR; ++r)
    for (int h = 0; h < 2; ++h)
      out[r][h] = Int ? _mm256_setzero_ps() : _mm256_loadu_ps(acc + (r0 + r) * kCols + 8 * h);
  for (int64_t g = 0; g < t.len / kGroup; g += 2) {
    const int64_t ga = u * kGroups + g;
    __m256i dots[MR][2][8 / kN], p[MR][2];
    __m256i by[2];  // what widens the 16-bit sums
    for (int h = 0; h < 2; ++h) by[h] = Int ? int_scales_at(t.sc[g / 2] + 8 * h) : _mm256_set1_epi16(1);
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      __m256i w[2];
      for (int h = 0; h < 2; ++h)
        w[h] = _mm256_sub_epi8(_mm256_load_si256(reinterpret_cast<const __m256i*>(t.q + (g * 4 + j) * 64 + 32 * h)),
                               shift);
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) {
        const __m256i xb = broadcast(x, r0 + r, ga, j);
        for (int h = 0; h < 2; ++h) {
          const __m256i a = products<C>(w[h], xb);
          p[r][h] = j % kPer == 0 ? a : _mm256_add_epi16(p[r][h], a);
        }
        asm("" : "+x"(p[r][0]), "+x"(p[r][1]));  // kept in registers: GCC would compute all products first
      }
      if (j % kPer < kPer - 1) continue;
      for (int r = 0; r < MR; ++r)
        for (int h = 0; h < 2; ++h) {
          const __m256i m = _mm256_madd_epi16(p[r][h], by[h]);
          __m256i& d = dots[r][h][j / kN];
          d = j % kN == kPer - 1 ? m : _mm256_add_epi32(d, m);
        }
    }
    for (int r = 0; r < MR; ++r)
      for (int h = 0; h < 2; ++h) {
        if constexpr (Int) out[r][h] = int_step(dots[r][h][0], x, r0 + r, ga, out[r][h]);
        else out[r][h] = block_step<C>(dots[r][h], x, r0 + r, ga, t.s[g] + 8 * h, t.o[g] + 8 * h, out[r][h]);
      }
  }
  for (int r = 0; r < MR; ++r)
    for (int h = 0; h < 2; ++h) {
      float* a = acc + (r0 + r) * kCols + 8 * h;
      if constexpr (Int)
        out[r][h] = int_unit_end(x, r0 + r, u * kGroups, t.d + 8 * h, &t.o[0][0] + 8 * h, out[r][h],
                                 _mm256_loadu_ps(a));
      _mm256_storeu_ps(a, out[r][h]);
    }
}

template <class C, bool Int>
void rows_by(const Tile& t, const Activations& x, int64_t u, int64_t mr, float* acc) {
  using Kernel = void (*)(const Tile&, const Activations&, int64_t, int64_t, float*);
  static constexpr Kernel by_rows[] = {rows_of<C, 1, Int>, rows_of<C, 2, Int>, rows_of<C, 3, Int>, rows_of<C, 4, Int>};
  constexpr int64_t most = sizeof(by_rows) / sizeof(by_rows[0]);
  for (int64_t r = 0; r < mr; r += most) by_rows[std::min(most, mr - r) - 1](t, x, u, r, acc);
}

template <class C>
void rows_any(const Tile& t, const Activations& x, int64_t u, int64_t mr, float* acc) {
  if constexpr (C::kIntScales) {  // a tile of an untiled weight has the portable decoder's float scales
    if (t.int_scales) return rows_by<C, true>(t, x, u, mr, acc);
  }
  rows_by<C, false>(t, x, u, mr, acc);
}

// -- decoded in registers -------------------------------------------------------------------------------------

// The tiled weight's 16 columns times one row (a batch-1 decode step), every unit decoded in registers and
// multiplied at once: per half and 32-block the same integer dots and float steps, in the same order, as rows_of
// (a row's result does not depend on which of the two multiplied it). Both halves of a unit are taken while its
// bytes are in L1, so the prefetch of the units ahead runs beside all of the compute. More rows decode a tile
// once: at 4 rows decoding again for each was slower.
template <class D>
void fused_units(const uint8_t* tile, int64_t k, const Activations& x, float* acc) {
  alignas(32) float s[kGroups][kCols], o[kGroups][kCols], d[kCols];
  alignas(32) int32_t isc[kGroups / 2][kCols];
  __m256 out[2] = {_mm256_loadu_ps(acc), _mm256_loadu_ps(acc + 8)};
  for (int64_t u = 0; u * kUnit < k; ++u) {
    const int64_t len = std::min(kUnit, k - u * kUnit);
    const uint8_t* p = tile + u * unit_stride<D>() * kCols;
    prefetch_ahead(p, unit_stride<D>() * kCols);
    // a K-quant's unit is always whole: a constant count unrolls, and each code's bit positions become constants
    const int64_t blocks = D::kBlock == kUnit ? kUnit / 32 : len / 32;
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const Half src{p, h};
      if constexpr (D::kIntScales) D::int_scales(src, p, &isc[0][0], d, &o[0][0]);
      else D::scales(src, p, len, &s[0][0], &o[0][0]);
      __m256 sum = _mm256_setzero_ps();  // int_step's
#pragma GCC unroll 8
      for (int b = 0; b < blocks; ++b) {
        asm volatile("" ::: "memory");  // each block loads its codes: kept from the block before, they were spilled
        const int64_t ga = u * kGroups + 2 * b;
        const auto w = [&](int j) { return D::codes(src, p, 8 * b + j); };
        const auto xb = [&](int j) { return broadcast(x, 0, ga, j); };
        if constexpr (D::kIntScales) sum = int_step(dot<D, 8>(w, xb, int_scales_at(isc[b])), x, 0, ga, sum);
        else out[h] = row_step<D>(w, xb, x, 0, ga, s[2 * b], o[2 * b], out[h]);
      }
      if constexpr (D::kIntScales) out[h] = int_unit_end(x, 0, u * kGroups, d, &o[0][0], sum, out[h]);
    }
  }
  _mm256_storeu_ps(acc, out[0]);
  _mm256_storeu_ps(acc + 8, out[1]);
}

// acc[r][c] for rows [0, mr) += the tile (unit u, codes + 128) times the rows; false for a type without codes.
inline bool rows(int64_t type, const Tile& t, const Activations& x, int64_t u, int64_t mr, float* acc) {
  return with_codes(type, [&](auto c) { rows_any<decltype(c)>(t, x, u, mr, acc); });
}

// The whole tile (all of its units) times x's one row into acc; false for a type without a decoder.
inline bool fused_tile(int64_t type, const uint8_t* tile, int64_t k, const Activations& x, float* acc) {
  return with_decoder(type, [&](auto d) {
    fused_units<decltype(d)>(tile, k, x, acc);
  });
}
#endif

}  // namespace iterserve_kquant::avx2
