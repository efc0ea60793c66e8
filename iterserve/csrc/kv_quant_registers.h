// The in-register loops of quantized decode attention (kv_quant_decode.cpp): AVX2 + F16C widening 8 stored bytes
// to float32 (isa 2) and AVX-512 widening 16 (isa 3) for the float32 arithmetic, and AVX512-BF16 + VBMI widening
// 64 bytes to exact bf16 for vdpbf16ps (isa 4), each for groups of up to 4 heads.
#pragma once

#include "kv_quant_tiles.h"

namespace iterserve_kv_quant {

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define KV_QUANT_FUSED_AVX2 1

// What the register paths of isa 2 and 3 fill in for a group of heads.
struct FusedKernels {
  void (*scores)(const float*, int64_t, const uint8_t* const*, const float*, int64_t, float*);
  void (*values)(const float*, const uint8_t* const*, int64_t, int64_t, float*);
};

// 8 stored bytes -> 8 floats in registers, as load16 below (e4m3 as its value / 256).
template <Kind K>
inline __m256 load8(const uint8_t* p) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  if constexpr (K == kInt8) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  } else if constexpr (K == kE5m2) {
    return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(b), 8));
  } else {
    return _mm256_cvtph_ps(
        _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(b), 7), _mm_set1_epi16(static_cast<int16_t>(0xBF80))));
  }
}

// fused_scores (below) at AVX2's width: eight keys' partial sums reduced together; dim % 32 == 0.
template <Kind K, int G>
void fused_scores_avx2(const float* qf, int64_t dim, const uint8_t* const* rows, const float* k_scale, int64_t n,
                       float* scores) {
  alignas(32) float part[G][8][8];
  for (int64_t j0 = 0; j0 < n; j0 += 8) {
    for (int64_t j = 0; j < 8; ++j) {
      __m256 acc[G][2];
      for (int g = 0; g < G; ++g) acc[g][0] = acc[g][1] = _mm256_setzero_ps();
      if (j0 + j < n) {
        const uint8_t* r = rows[j0 + j];
        for (int64_t i = 0; i < dim; i += 32) {
          __m256 k[4];
          for (int t = 0; t < 4; ++t) k[t] = load8<K>(r + i + 8 * t);
          for (int g = 0; g < G; ++g)
            for (int t = 0; t < 4; ++t)
              acc[g][t & 1] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + g * dim + i + 8 * t), k[t], acc[g][t & 1]);
        }
      }
      for (int g = 0; g < G; ++g) _mm256_store_ps(part[g][j], _mm256_add_ps(acc[g][0], acc[g][1]));
    }
    for (int g = 0; g < G; ++g) {
      __m256 s = sum8(part[g]);
      if constexpr (K == kInt8) s = _mm256_mul_ps(s, _mm256_loadu_ps(k_scale + j0));
      _mm256_storeu_ps(scores + g * kTile + j0, s);
    }
  }
}

// fused_values (below) at AVX2's width, R registers of each head's sums at a time so that the G x R sums and R
// widened values fit AVX2's 16 registers; dim % 64 == 0.
template <Kind K, int G>
void fused_values_avx2(const float* p, const uint8_t* const* rows, int64_t n, int64_t dim, float* acc) {
  constexpr int R = G == 1 ? 8 : G == 2 ? 4 : 2;
  for (int64_t i = 0; i < dim; i += 8 * R) {
    __m256 a[G][R];
    for (int g = 0; g < G; ++g)
      for (int t = 0; t < R; ++t) a[g][t] = _mm256_loadu_ps(acc + g * dim + i + 8 * t);
    for (int64_t j = 0; j < n; ++j) {
      __m256 v[R];
      for (int t = 0; t < R; ++t) v[t] = load8<K>(rows[j] + i + 8 * t);
      for (int g = 0; g < G; ++g) {
        const __m256 pj = _mm256_set1_ps(p[g * kTile + j]);
        for (int t = 0; t < R; ++t) a[g][t] = _mm256_fmadd_ps(pj, v[t], a[g][t]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int t = 0; t < R; ++t) _mm256_storeu_ps(acc + g * dim + i + 8 * t, a[g][t]);
  }
}

template <Kind K>
constexpr FusedKernels kFusedAvx2[4] = {
    {fused_scores_avx2<K, 1>, fused_values_avx2<K, 1>}, {fused_scores_avx2<K, 2>, fused_values_avx2<K, 2>},
    {fused_scores_avx2<K, 3>, fused_values_avx2<K, 3>}, {fused_scores_avx2<K, 4>, fused_values_avx2<K, 4>}};

// The AVX2 register kernels for up to 4 heads of a kind.
inline const FusedKernels& fused_avx2(Kind kind, int64_t heads) {
  return kind == kInt8 ? kFusedAvx2<kInt8>[heads - 1]
                       : kind == kE5m2 ? kFusedAvx2<kE5m2>[heads - 1] : kFusedAvx2<kE4m3>[heads - 1];
}
#endif

#if defined(__AVX512F__) && defined(__AVX2__)
// 16 stored bytes -> 16 floats in registers, without the row's scale: int8 as the integer, e5m2 exactly, e4m3 as
// its value / 256 (the float16 built from the sign-extended byte, bit 14 cleared; the 256 is folded into the
// query and the output instead, both exact).
template <Kind K>
inline __m512 load16(const uint8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (K == kInt8) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
  } else if constexpr (K == kE5m2) {
    return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(b), 8));
  } else {
    const __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7),
                                       _mm256_set1_epi16(static_cast<int16_t>(0xBF80)));
    return _mm512_cvtph_ps(h);
  }
}

// scores[g * kTile + j] = q_g . k_j (times k_scale[j] for int8) for the tile's n keys and G <= 4 heads, each key's
// bytes widened in registers once for the G heads, sixteen keys' partial sums reduced together; dim % 64 == 0.
template <Kind K, int G>
void fused_scores(const float* qf, int64_t dim, const uint8_t* const* rows, const float* k_scale, int64_t n,
                  float* scores) {
  alignas(64) float part[G][16][16];
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    for (int64_t j = 0; j < 16; ++j) {
      __m512 acc[G][2];
      for (int g = 0; g < G; ++g) acc[g][0] = acc[g][1] = _mm512_setzero_ps();
      if (j0 + j < n) {
        const uint8_t* r = rows[j0 + j];
        for (int64_t i = 0; i < dim; i += 64) {
          __m512 k[4];
          for (int t = 0; t < 4; ++t) k[t] = load16<K>(r + i + 16 * t);
          for (int g = 0; g < G; ++g)
            for (int t = 0; t < 4; ++t)
              acc[g][t & 1] = _mm512_fmadd_ps(_mm512_loadu_ps(qf + g * dim + i + 16 * t), k[t], acc[g][t & 1]);
        }
      }
      for (int g = 0; g < G; ++g) _mm512_store_ps(part[g][j], _mm512_add_ps(acc[g][0], acc[g][1]));
    }
    for (int g = 0; g < G; ++g) {
      __m512 s = sum16(part[g]);
      if constexpr (K == kInt8) s = _mm512_mul_ps(s, _mm512_loadu_ps(k_scale + j0));
      _mm512_storeu_ps(scores + g * kTile + j0, s);
    }
  }
}

// acc_g += sum_j p[g * kTile + j] v_j for the tile's n values and G <= 4 heads, 64 dimensions at a time with the
// G x 4 sums in registers and each value's bytes widened once for the G heads.
template <Kind K, int G>
void fused_values(const float* p, const uint8_t* const* rows, int64_t n, int64_t dim, float* acc) {
  for (int64_t i = 0; i < dim; i += 64) {
    __m512 a[G][4];
    for (int g = 0; g < G; ++g)
      for (int t = 0; t < 4; ++t) a[g][t] = _mm512_loadu_ps(acc + g * dim + i + 16 * t);
    for (int64_t j = 0; j < n; ++j) {
      __m512 v[4];
      for (int t = 0; t < 4; ++t) v[t] = load16<K>(rows[j] + i + 16 * t);
      for (int g = 0; g < G; ++g) {
        const __m512 pj = _mm512_set1_ps(p[g * kTile + j]);
        for (int t = 0; t < 4; ++t) a[g][t] = _mm512_fmadd_ps(pj, v[t], a[g][t]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int t = 0; t < 4; ++t) _mm512_storeu_ps(acc + g * dim + i + 16 * t, a[g][t]);
  }
}

template <Kind K>
constexpr FusedKernels kFused[4] = {{fused_scores<K, 1>, fused_values<K, 1>}, {fused_scores<K, 2>, fused_values<K, 2>},
                                    {fused_scores<K, 3>, fused_values<K, 3>}, {fused_scores<K, 4>, fused_values<K, 4>}};

// The fused kernels for up to 4 heads of a kind.
inline const FusedKernels& fused(Kind kind, int64_t heads) {
  return kind == kInt8 ? kFused<kInt8>[heads - 1] : kind == kE5m2 ? kFused<kE5m2>[heads - 1] : kFused<kE4m3>[heads - 1];
}
#endif

#if defined(KV_QUANT_DPBF16)
// The bf16 of every magnitude (a float8 byte's low 7 bits, an int8's absolute value), its high bytes and its low
// bytes, 128 of each in two registers (vpermi2b looks up 64 bytes at once).
struct Bf16Table {
  __m512i hi[2], lo[2];
  explicit Bf16Table(Kind kind) {
    static const auto bytes = [] {
      std::array<std::array<uint8_t, 256>, 3> b{};
      for (int k = 0; k < 3; ++k)
        for (int m = 0; m < 128; ++m) {
          const float v = k == kInt8 ? static_cast<float>(m) : fp8_table(static_cast<Kind>(k))[m];
          const uint16_t w = c10::BFloat16(v).x;
          b[k][m] = static_cast<uint8_t>(w >> 8);
          b[k][128 + m] = static_cast<uint8_t>(w & 0xFF);
        }
      return b;
    }();
    const uint8_t* t = bytes[kind].data();
    for (int i = 0; i < 2; ++i) {
      hi[i] = _mm512_loadu_si512(t + 64 * i);
      lo[i] = _mm512_loadu_si512(t + 128 + 64 * i);
    }
  }
};

// 64 stored bytes -> 64 exact bf16 values (int8 without its row's scale; -128 is never stored) in two registers,
// in unpacklo/hi_epi8's order: scrambled position s holds value scrambled(s). The dot products do not care
// (the query is scrambled alike); the output is put back in order once per task.
template <Kind K>
inline void widen64_bf16(const uint8_t* p, const Bf16Table& t, __m512i& first, __m512i& second) {
  const __m512i x = _mm512_loadu_si512(p);
  const __m512i m = K == kInt8 ? _mm512_abs_epi8(x) : x;  // vpermi2b reads bits 0-6
  const __m512i sign = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(t.hi[0], m, t.hi[1]), x, sign, 0xF8);
  const __m512i lo = _mm512_permutex2var_epi8(t.lo[0], m, t.lo[1]);
  first = _mm512_unpacklo_epi8(lo, hi);
  second = _mm512_unpackhi_epi8(lo, hi);
}

// scores[g * kTile + j] = scale * (q_g . k_j) (times k_scale[j] for int8) for G <= 4 heads of bf16 query qb
// (scrambled as widen64_bf16 scrambles), each key's bytes widened once for the G heads; sixteen keys' partial sums
// reduced together. C > 0: dim is 64 C, the query held in registers; else any multiple of 64.
template <Kind K, int G, int C>
void dp_scores(const uint16_t* qb, int64_t dim, const uint8_t* const* rows, const float* k_scale, float scale,
               int64_t n, float* scores) {
  const Bf16Table table(K);
  alignas(64) float part[G][16][16];
  const __m512 vscale = _mm512_set1_ps(scale);
  constexpr int kRegs = C > 0 ? 2 * C : 1;
  __m512bh qr[G][kRegs];
  if constexpr (C > 0)
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < kRegs; ++c) qr[g][c] = (__m512bh)_mm512_loadu_si512(qb + g * dim + 32 * c);
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    for (int64_t j = 0; j < 16; ++j) {
      __m512 acc[G];
      for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
      if (j0 + j < n)
        for (int64_t i = 0; i < (C > 0 ? 64 * C : dim); i += 64) {
          __m512i a, b;
          widen64_bf16<K>(rows[j0 + j] + i, table, a, b);
          for (int g = 0; g < G; ++g) {
            const __m512bh q0 = C > 0 ? qr[g][(i / 32) % kRegs] : (__m512bh)_mm512_loadu_si512(qb + g * dim + i);
            const __m512bh q1 = C > 0 ? qr[g][(i / 32 + 1) % kRegs] : (__m512bh)_mm512_loadu_si512(qb + g * dim + i + 32);
            acc[g] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(acc[g], q0, (__m512bh)a), q1, (__m512bh)b);
          }
        }
      for (int g = 0; g < G; ++g) _mm512_store_ps(part[g][j], acc[g]);
    }
    for (int g = 0; g < G; ++g) {
      __m512 s = _mm512_mul_ps(sum16(part[g]), vscale);
      if constexpr (K == kInt8) s = _mm512_mul_ps(s, _mm512_loadu_ps(k_scale + j0));
      _mm512_storeu_ps(scores + g * kTile + j0, s);
    }
  }
}

// acc_g += sum_j p[g * kTile + j] v_j for G <= 4 heads (acc scrambled as widen64_bf16 scrambles) with the weights
// rounded to bf16, two keys a vdpbf16ps: the widened rows of keys j and j + 1 interleaved word by word (as
// attention_bf16.h's group_values_pairs).
template <Kind K, int G>
void dp_values(const float* p, const uint8_t* const* rows, int64_t n, int64_t dim, float* acc) {
  const Bf16Table table(K);
  alignas(64) uint16_t pb[G][kTile + 2];  // each head's weights in bf16, a zero after the last
  for (int g = 0; g < G; ++g) {
    for (int64_t j = 0; j < kTile; j += 32) {
      const __m512 lo = _mm512_loadu_ps(p + g * kTile + j), hi = _mm512_loadu_ps(p + g * kTile + j + 16);
      _mm512_storeu_si512(pb[g] + j, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
    pb[g][n] = 0;
  }
  const __m512i lo_idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38,
                                          6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
  for (int64_t i = 0; i < dim; i += 64) {
    __m512 a[G][4];
    for (int g = 0; g < G; ++g)
      for (int t = 0; t < 4; ++t) a[g][t] = _mm512_loadu_ps(acc + g * dim + i + 16 * t);
    for (int64_t j = 0; j < n; j += 2) {
      const uint8_t* r1 = (j + 1 < n ? rows[j + 1] : rows[j]) + i;  // weighed by the zero after the last
      __m512i x0, x1, y0, y1;
      widen64_bf16<K>(rows[j] + i, table, x0, x1);
      widen64_bf16<K>(r1, table, y0, y1);
      const __m512bh v[4] = {(__m512bh)_mm512_permutex2var_epi16(x0, lo_idx, y0),
                             (__m512bh)_mm512_permutex2var_epi16(x0, hi_idx, y0),
                             (__m512bh)_mm512_permutex2var_epi16(x1, lo_idx, y1),
                             (__m512bh)_mm512_permutex2var_epi16(x1, hi_idx, y1)};
      for (int g = 0; g < G; ++g) {
        uint32_t pair;
        std::memcpy(&pair, pb[g] + j, sizeof(pair));
        const __m512bh pp = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
        for (int t = 0; t < 4; ++t) a[g][t] = _mm512_dpbf16_ps(a[g][t], pp, v[t]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int t = 0; t < 4; ++t) _mm512_storeu_ps(acc + g * dim + i + 16 * t, a[g][t]);
  }
}

struct DpKernels {
  void (*scores)(const uint16_t*, int64_t, const uint8_t* const*, const float*, float, int64_t, float*);
  void (*values)(const float*, const uint8_t* const*, int64_t, int64_t, float*);
};

template <Kind K, int C>
constexpr DpKernels kDp[4] = {{dp_scores<K, 1, C>, dp_values<K, 1>}, {dp_scores<K, 2, C>, dp_values<K, 2>},
                              {dp_scores<K, 3, C>, dp_values<K, 3>}, {dp_scores<K, 4, C>, dp_values<K, 4>}};

template <Kind K>
inline const DpKernels& dp_of(int64_t heads, int64_t dim) {
  return dim == 64 ? kDp<K, 1>[heads - 1] : dim == 128 ? kDp<K, 2>[heads - 1] : kDp<K, 0>[heads - 1];
}

// The kernels for up to 4 heads of a kind and head dim.
inline const DpKernels& dp(Kind kind, int64_t heads, int64_t dim) {
  return kind == kInt8 ? dp_of<kInt8>(heads, dim) : kind == kE5m2 ? dp_of<kE5m2>(heads, dim) : dp_of<kE4m3>(heads, dim);
}
#endif

// The value at scrambled position s of a 64-value piece (widen64_bf16): unpacklo/hi_epi8 take bytes 0-7 / 8-15
// of each 128-bit lane.
constexpr int64_t scrambled(int64_t s) { return 16 * ((s % 32) / 8) + s % 8 + 8 * (s / 32); }

}  // namespace iterserve_kv_quant
