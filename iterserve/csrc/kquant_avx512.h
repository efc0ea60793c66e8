// The AVX-512 VNNI side of the GGUF matmul (kquant_ops.cpp): per type a decoder of 16 columns at once, from
// a tiled weight's loads or gathered from 16 rows, and the kernels that multiply its codes with up to 8 rows.
#pragma once

#include "kquant.h"

namespace iterserve_kquant {

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// One row's share of a 32-block (groups ga, ga + 1 of 16 inputs), codes + Bias in w[8]. AVX-512 VNNI: one vpdpbusd
// is 16 columns x 4 inputs; Bias * sum(a) is taken back off. Shared: the two groups have the same scale s[0] and
// offset o[0] (Q4_K, Q5_K, the 32-blocks), one float step for both; else s[0], s[1] (and o) are summed, then
// scaled by the row's a_d once.
template <bool Shared, int Bias, bool Offset>
[[gnu::always_inline]] inline __m512 row_step(const __m512i* w, const Activations& x, int64_t r, int64_t ga,
                                              const __m512* s, const __m512* o, __m512 out) {
  const int8_t* xr = x.a.row(r) + ga * kGroup;
  const float ad = x.d(r, ga);
  if constexpr (Shared) {
    const int32_t sum = x.a.sum[r * x.a.blocks + ga / 2];
    __m512i dot = _mm512_set1_epi32(-Bias * sum);
    for (int j = 0; j < 8; ++j) dot = _mm512_dpbusd_epi32(dot, w[j], _mm512_set1_epi32(load_i32(xr + 4 * j)));
    out = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(s[0], _mm512_set1_ps(ad)), out);
    if constexpr (Offset) out = _mm512_fmadd_ps(o[0], _mm512_set1_ps(ad * static_cast<float>(sum)), out);
    return out;
  } else {
    __m512 acc = _mm512_setzero_ps();
    for (int h = 0; h < 2; ++h) {
      const int32_t sum = x.sum(r, ga + h);
      __m512i dot = _mm512_set1_epi32(-Bias * sum);
      for (int j = 0; j < 4; ++j)
        dot = _mm512_dpbusd_epi32(dot, w[4 * h + j], _mm512_set1_epi32(load_i32(xr + 16 * h + 4 * j)));
      acc = h == 0 ? _mm512_mul_ps(_mm512_cvtepi32_ps(dot), s[0]) : _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s[1], acc);
      if constexpr (Offset) acc = _mm512_fmadd_ps(o[h], _mm512_set1_ps(static_cast<float>(sum)), acc);
    }
    return _mm512_fmadd_ps(acc, _mm512_set1_ps(ad), out);
  }
}

// The tile's codes (+ 128) times MR rows, a 32-block at a time (Shared: as in row_step).
template <int MR, bool Shared>
void rows_avx512(const Tile& t, const Activations& x, int64_t u, int64_t r0, float* acc) {
  __m512 out[MR];
  for (int r = 0; r < MR; ++r) out[r] = _mm512_loadu_ps(acc + r * kCols);
  for (int64_t g = 0; g < t.len / kGroup; g += 2) {
    __m512i w[8];
    for (int j = 0; j < 8; ++j) w[j] = _mm512_load_si512(t.q + (g * 4 + j) * 64);
    const __m512 s[2] = {_mm512_load_ps(t.s[g]), _mm512_load_ps(t.s[g + 1])};
    const __m512 o[2] = {_mm512_load_ps(t.o[g]), _mm512_load_ps(t.o[g + 1])};
    for (int r = 0; r < MR; ++r) out[r] = row_step<Shared, 128, true>(w, x, r0 + r, u * kGroups + g, s, o, out[r]);
  }
  for (int r = 0; r < MR; ++r) _mm512_storeu_ps(acc + r * kCols, out[r]);
}

template <bool Shared>
void rows_avx512_any(const Tile& t, const Activations& x, int64_t u, int64_t mr, float* acc) {
  using Kernel = void (*)(const Tile&, const Activations&, int64_t, int64_t, float*);
  static constexpr Kernel by_rows[] = {rows_avx512<1, Shared>, rows_avx512<2, Shared>, rows_avx512<3, Shared>,
                                       rows_avx512<4, Shared>, rows_avx512<5, Shared>, rows_avx512<6, Shared>,
                                       rows_avx512<7, Shared>, rows_avx512<8, Shared>};
  constexpr int64_t most = sizeof(by_rows) / sizeof(by_rows[0]);
  for (int64_t r = 0; r < mr; r += most) by_rows[std::min(most, mr - r) - 1](t, x, u, r, acc + r * kCols);
}

// Decoding with lanes = columns: a dword gathered from each of the 16 rows is 4 inputs x 16 columns, one
// chunk of the tile as it stands, so no transpose follows. `idx` holds each column's row offset, `mask`
// the columns that exist (the others read as zero: zero scales).
struct Gather {
  __m512i idx;
  __mmask16 mask;
  static constexpr bool kTiled = false;
  __m512i at(const uint8_t* p) const { return _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), mask, idx, p, 1); }
};

// A tiled block: the dword at byte offset p - base of the 16 rows is one 64-byte load.
struct TileLoads {
  const uint8_t* base;
  static constexpr bool kTiled = true;
  __m512i at(const uint8_t* p) const { return _mm512_loadu_si512(base + (p - base) * 16); }
};

// The float16 in bits [shift, shift + 16) of each lane, as float.
inline __m512 half_lanes(__m512i v, int shift) {
  return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(v, shift)));
}

inline __m512i byte_lanes(__m512i v, int byte) {
  return _mm512_and_si512(_mm512_srli_epi32(v, 8 * byte), _mm512_set1_epi32(0xFF));
}

inline __m512i low_nibbles(__m512i v, bool high) {
  return _mm512_and_si512(high ? _mm512_srli_epi16(v, 4) : v, _mm512_set1_epi8(0x0F));
}

// Bit `bit` of each byte, in place of bit `to`.
inline __m512i byte_bit(__m512i v, int bit, int to) {
  return _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(v, bit), _mm512_set1_epi8(1)), to);
}

using Groups = float (*)[kCols];

// Each type's decoder, one super-block or 8 blocks of 32 ("unit", from p) at a time: `scales` writes the
// float scale and offset of every group of 16 inputs, `codes(c)` gives inputs 4c..4c+3 of the 16 columns as
// unsigned bytes, the code plus kBias (kOffset: whether the type has offsets at all).
struct Q4K {
  static constexpr int kBias = 0;
  static constexpr bool kOffset = true, kPairs = true;
  static constexpr int64_t kBlock = 256, kStride = 144;
  template <class Src>
  static void scales(const Src& g, const uint8_t* p, int64_t, Groups s, Groups o) {
    const __m512i head = g.at(p), s0 = g.at(p + 4), s1 = g.at(p + 8), s2 = g.at(p + 12);
    const __m512 d = half_lanes(head, 0), dmin = half_lanes(head, 16);
    const __m512i m6 = _mm512_set1_epi32(63), m4 = _mm512_set1_epi32(0x0F);
#pragma GCC unroll 16
    for (int j = 0; j < 8; ++j) {
      __m512i sc, mn;
      if (j < 4) {
        sc = _mm512_and_si512(byte_lanes(s0, j), m6);
        mn = _mm512_and_si512(byte_lanes(s1, j), m6);
      } else {
        const __m512i hi = byte_lanes(s2, j - 4);
        sc = _mm512_or_si512(_mm512_and_si512(hi, m4), _mm512_slli_epi32(_mm512_srli_epi32(byte_lanes(s0, j - 4), 6), 4));
        mn = _mm512_or_si512(_mm512_srli_epi32(hi, 4), _mm512_slli_epi32(_mm512_srli_epi32(byte_lanes(s1, j - 4), 6), 4));
      }
      const __m512 sv = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc));
      const __m512 ov = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(mn)));
      _mm512_store_ps(s[2 * j], sv);
      _mm512_store_ps(s[2 * j + 1], sv);
      _mm512_store_ps(o[2 * j], ov);
      _mm512_store_ps(o[2 * j + 1], ov);
    }
  }
  template <class Src>
  [[gnu::always_inline]] static __m512i codes(const Src& g, const uint8_t* p, int c) {
    return low_nibbles(g.at(p + 16 + 32 * (c >> 4) + 4 * (c & 7)), c & 8);
  }
};

// Q5_K: Q4_K's scales, a fifth bit per input from qh.
struct Q5K : Q4K {
  static constexpr int64_t kStride = 176;
  template <class Src>
  [[gnu::always_inline]] static __m512i codes(const Src& g, const uint8_t* p, int c) {
    const int j = c >> 4, hi = (c >> 3) & 1, i = c & 7;
    const __m512i v = low_nibbles(g.at(p + 48 + 32 * j + 4 * i), hi);
    return _mm512_or_si512(v, byte_bit(g.at(p + 16 + 4 * i), 2 * j + hi, 4));
  }
};

struct Q6K {
  static constexpr int kBias = 32;
  static constexpr bool kOffset = false, kPairs = false;
  static constexpr int64_t kBlock = 256, kStride = 210;
  template <class Src>
  static void scales(const Src& g, const uint8_t* p, int64_t, Groups s, Groups o) {
    // bytes 208..209, the last of the block: a gather reads the dword that ends there, a tile has it padded
    const __m512 d = Src::kTiled ? half_lanes(g.at(p + 208), 0) : half_lanes(g.at(p + 206), 16);
#pragma GCC unroll 16
    for (int i = 0; i < 4; ++i) {
      const __m512i v = g.at(p + 192 + 4 * i);
#pragma GCC unroll 4
      for (int b = 0; b < 4; ++b) {
        const __m512i sc = _mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * b), 24);
        _mm512_store_ps(s[4 * i + b], _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc)));
        _mm512_store_ps(o[4 * i + b], _mm512_setzero_ps());
      }
    }
  }
  template <class Src>
  [[gnu::always_inline]] static __m512i codes(const Src& g, const uint8_t* p, int c) {
    const int h = c >> 5, hi = (c >> 4) & 1, l = c & 15;
    const __m512i lo = low_nibbles(g.at(p + 64 * h + 4 * l), hi);
    // the two high bits at bits [shift, shift + 2) of each byte, moved to bits 4-5 (what crosses bytes is masked off)
    const int shift = 2 * (l >> 3) + 4 * hi;
    const __m512i qh = g.at(p + 128 + 32 * h + 4 * (l & 7));
    const __m512i at4 = shift <= 4 ? _mm512_slli_epi16(qh, 4 - shift) : _mm512_srli_epi16(qh, shift - 4);
    return _mm512_ternarylogic_epi32(lo, at4, _mm512_set1_epi8(0x30), 0xF8);  // lo | (at4 & 0x30)
  }
};

struct Q3K {
  static constexpr int kBias = 4;
  static constexpr bool kOffset = false, kPairs = false;
  static constexpr int64_t kBlock = 256, kStride = 110;
  template <class Src>
  static void scales(const Src& g, const uint8_t* p, int64_t, Groups s, Groups o) {
    const __m512 d = Src::kTiled ? half_lanes(g.at(p + 108), 0) : half_lanes(g.at(p + 106), 16);
    const __m512i sc[3] = {g.at(p + 96), g.at(p + 100), g.at(p + 104)};
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) {
      const __m512i b = byte_lanes(sc[(i % 8) / 4], i % 4);
      const __m512i low = i < 8 ? _mm512_and_si512(b, _mm512_set1_epi32(0x0F)) : _mm512_srli_epi32(b, 4);
      const __m512i high =
          _mm512_and_si512(_mm512_srli_epi32(byte_lanes(sc[2], i % 4), 2 * (i / 4)), _mm512_set1_epi32(3));
      const __m512i v = _mm512_sub_epi32(_mm512_or_si512(low, _mm512_slli_epi32(high, 4)), _mm512_set1_epi32(32));
      _mm512_store_ps(s[i], _mm512_mul_ps(d, _mm512_cvtepi32_ps(v)));
      _mm512_store_ps(o[i], _mm512_setzero_ps());
    }
  }
  template <class Src>
  [[gnu::always_inline]] static __m512i codes(const Src& g, const uint8_t* p, int c) {
    const int h = c >> 5, t = (c >> 3) & 3, i = c & 7;
    const __m512i low = _mm512_and_si512(_mm512_srli_epi16(g.at(p + 32 + 32 * h + 4 * i), 2 * t), _mm512_set1_epi8(3));
    return _mm512_or_si512(low, byte_bit(g.at(p + 4 * i), 4 * h + t, 2));
  }
};

struct Q2K {
  static constexpr int kBias = 0;
  static constexpr bool kOffset = true, kPairs = false;
  static constexpr int64_t kBlock = 256, kStride = 84;
  template <class Src>
  static void scales(const Src& g, const uint8_t* p, int64_t, Groups s, Groups o) {
    const __m512i head = g.at(p + 80);
    const __m512 d = half_lanes(head, 0), dmin = half_lanes(head, 16);
#pragma GCC unroll 16
    for (int i = 0; i < 4; ++i) {
      const __m512i v = g.at(p + 4 * i);
#pragma GCC unroll 4
      for (int b = 0; b < 4; ++b) {
        const __m512i sc = byte_lanes(v, b);
        const __m512i scale = _mm512_and_si512(sc, _mm512_set1_epi32(15));
        _mm512_store_ps(s[4 * i + b], _mm512_mul_ps(d, _mm512_cvtepi32_ps(scale)));
        _mm512_store_ps(o[4 * i + b], _mm512_sub_ps(_mm512_setzero_ps(),
                                                    _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_srli_epi32(sc, 4)))));
      }
    }
  }
  template <class Src>
  [[gnu::always_inline]] static __m512i codes(const Src& g, const uint8_t* p, int c) {
    const int h = c >> 5, t = (c >> 3) & 3, i = c & 7;
    return _mm512_and_si512(_mm512_srli_epi16(g.at(p + 16 + 32 * h + 4 * i), 2 * t), _mm512_set1_epi8(3));
  }
};

// Blocks of 32 with a 16-bit fifth bit mask (Q5_0: scale, qh, qs; Q5_1: scale, min, qh, qs). A tiled Q5_0 block
// is padded to 24 bytes after its scale, so that qh and qs start on whole dwords, as Q5_1's do.
template <bool kMin>
struct Q5Blocks {
  static constexpr int kBias = kMin ? 0 : 16;
  static constexpr bool kOffset = kMin, kPairs = true;
  static constexpr int64_t kBlock = 32, kStride = kMin ? 24 : 22;
  template <class Src>
  static constexpr int64_t stride() { return Src::kTiled ? 24 : kStride; }
  template <class Src>
  static constexpr int64_t qh_at() { return kMin || Src::kTiled ? 4 : 2; }
  template <class Src>
  static void scales(const Src& g, const uint8_t* p, int64_t len, Groups s, Groups o) {
    for (int64_t b = 0; b < len / 32; ++b) {
      const __m512i head = g.at(p + b * stride<Src>());
      const __m512 d = half_lanes(head, 0), m = kMin ? half_lanes(head, 16) : _mm512_setzero_ps();
      for (int h = 0; h < 2; ++h) {
        _mm512_store_ps(s[2 * b + h], d);
        _mm512_store_ps(o[2 * b + h], m);
      }
    }
  }
  // The fifth bits of inputs 4i..4i+3 of block b: byte (i / 2) of qh (chunks 4.. use its upper half) broadcast
  // to the lane's 4 bytes, tested against bits 4 * (i % 2) + 0..3.
  template <class Src>
  [[gnu::always_inline]] static __m512i codes(const Src& g, const uint8_t* p, int c) {
    const int b = c >> 3, i = c & 7, byte = 2 * (i >> 2) + ((i & 3) >> 1);
    const uint8_t* q = p + b * stride<Src>() + qh_at<Src>();
    const __m512i lo = low_nibbles(g.at(q + 4 + 4 * (i & 3)), i >> 2);
    const __m512i lane = _mm512_set4_epi32(0x0C0C0C0C, 0x08080808, 0x04040404, 0);
    const __m512i qh = _mm512_shuffle_epi8(g.at(q), _mm512_add_epi8(lane, _mm512_set1_epi8(static_cast<char>(byte))));
    const __m512i bits = _mm512_set1_epi32(static_cast<int32_t>(0x08040201u << 4 * (i & 1)));
    const __mmask64 set = _mm512_test_epi8_mask(qh, bits);
    return _mm512_mask_add_epi8(lo, set, lo, _mm512_set1_epi8(16));
  }
};

// Q8_0: a scale and 32 int8 codes; a tiled block is padded to 36 bytes after its scale.
struct Q80 {
  static constexpr int kBias = 128;
  static constexpr bool kOffset = false, kPairs = true;
  static constexpr int64_t kBlock = 32, kStride = 34;
  template <class Src>
  static constexpr int64_t stride() { return Src::kTiled ? 36 : kStride; }
  template <class Src>
  static void scales(const Src& g, const uint8_t* p, int64_t len, Groups s, Groups o) {
    for (int64_t b = 0; b < len / 32; ++b) {
      const __m512 d = half_lanes(g.at(p + b * stride<Src>()), 0);
      for (int h = 0; h < 2; ++h) {
        _mm512_store_ps(s[2 * b + h], d);
        _mm512_store_ps(o[2 * b + h], _mm512_setzero_ps());
      }
    }
  }
  template <class Src>
  [[gnu::always_inline]] static __m512i codes(const Src& g, const uint8_t* p, int c) {
    const __m512i v = g.at(p + (c >> 3) * stride<Src>() + (Src::kTiled ? 4 : 2) + 4 * (c & 7));
    return _mm512_xor_si512(v, _mm512_set1_epi8(static_cast<char>(0x80)));
  }
};

// Bytes of one unit of a row (gathered) or of a tile's column (tiled): the unit's blocks as their decoder reads them.
template <class D, class Src>
constexpr int64_t unit_stride() {
  if constexpr (D::kBlock == kUnit) return Src::kTiled ? (D::kStride + 3) / 4 * 4 : D::kStride;
  else return 8 * D::template stride<Src>();
}

template <class D, class Src>
void decode_unit_avx512(const Src& src, const uint8_t* p, Tile& t) {
  D::scales(src, p, t.len, t.s, t.o);
  const __m512i bias = _mm512_set1_epi8(static_cast<char>(128 - D::kBias));
  if constexpr (D::kBlock == kUnit) {  // unrolled: each code's bit positions become constants
#pragma GCC unroll 64
    for (int c = 0; c < kUnit / 4; ++c) _mm512_store_si512(t.q + c * 64, _mm512_add_epi8(D::codes(src, p, c), bias));
  } else {
    for (int b = 0; b < t.len / 32; ++b)
      for (int j = 0; j < 8; ++j)
        _mm512_store_si512(t.q + (8 * b + j) * 64, _mm512_add_epi8(D::codes(src, p, 8 * b + j), bias));
  }
}

// The columns' source (loads from a tile, or gathers from rows) for units starting at p, and p.
template <class Src>
struct Source {
  Src src;
  const uint8_t* p;
};

inline Source<TileLoads> tile_source(const uint8_t* tile) { return {TileLoads{tile}, tile}; }

inline Source<Gather> row_source(const uint8_t* rows, int64_t row_bytes, int64_t cols) {
  const __m512i idx = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                         _mm512_set1_epi32(static_cast<int32_t>(row_bytes)));
  return {Gather{idx, static_cast<__mmask16>((1u << cols) - 1)}, rows};
}

// 32-block b of the unit at p decoded in registers and multiplied with MR rows into out (ga: the block's first
// group of 16 in the rows). Inlined into a loop that a K-quant unrolls, so that each code's bit positions are
// constants: variable shifts and offsets cost Q6_K far more (docs/benchmarks-history.md).
template <class D, class Src, int MR>
[[gnu::always_inline]] inline void fused_block(const Src& src, const uint8_t* p, int b, Groups s, Groups o,
                                               const Activations& x, int64_t r0, int64_t ga, __m512* out) {
  __m512i w[8];
  for (int j = 0; j < 8; ++j) w[j] = D::codes(src, p, 8 * b + j);
  const __m512 sg[2] = {_mm512_load_ps(s[2 * b]), _mm512_load_ps(s[2 * b + 1])};
  const __m512 og[2] = {_mm512_load_ps(o[2 * b]), _mm512_load_ps(o[2 * b + 1])};
  for (int r = 0; r < MR; ++r) out[r] = row_step<D::kPairs, D::kBias, D::kOffset>(w, x, r0 + r, ga, sg, og, out[r]);
}

// Decoded in registers and multiplied at once, for up to 8 rows a pass: per 32-block the same integer dots
// and the same float steps as rows_avx512 (a row's result does not depend on which of the two multiplied it).
template <class D, class Src, int MR>
void fused_rows(const Source<Src>& at, int64_t k, const Activations& x, int64_t r0, float* acc) {
  alignas(64) float s[kGroups][kCols], o[kGroups][kCols];
  __m512 out[MR];
  for (int r = 0; r < MR; ++r) out[r] = _mm512_setzero_ps();
  for (int64_t u = 0; u * kUnit < k; ++u) {
    const int64_t len = std::min(kUnit, k - u * kUnit);
    const uint8_t* p = at.p + u * unit_stride<D, Src>() * (Src::kTiled ? kCols : 1);
    Src src = at.src;
    if constexpr (Src::kTiled) {
      src = TileLoads{p};
      prefetch_ahead(p, unit_stride<D, Src>() * kCols);
    }
    D::scales(src, p, len, s, o);
    if constexpr (D::kBlock == kUnit) {
#pragma GCC unroll 8
      for (int b = 0; b < 8; ++b) fused_block<D, Src, MR>(src, p, b, s, o, x, r0, u * kGroups + 2 * b, out);
    } else {
      for (int b = 0; b < len / 32; ++b) fused_block<D, Src, MR>(src, p, b, s, o, x, r0, u * kGroups + 2 * b, out);
    }
  }
  for (int r = 0; r < MR; ++r) _mm512_storeu_ps(acc + r * kCols, out[r]);
}

constexpr int64_t kFusedRows = 8;   // rows multiplied per pass over the weight in registers
constexpr int64_t kFusedMost = 32;  // up to this many rows decode in registers, more decode a tile once

template <class D, class Src>
void fused_any(const Source<Src>& at, int64_t k, const Activations& x, int64_t m, float* acc) {
  using Kernel = void (*)(const Source<Src>&, int64_t, const Activations&, int64_t, float*);
  static constexpr Kernel by_rows[] = {fused_rows<D, Src, 1>, fused_rows<D, Src, 2>, fused_rows<D, Src, 3>,
                                       fused_rows<D, Src, 4>, fused_rows<D, Src, 5>, fused_rows<D, Src, 6>,
                                       fused_rows<D, Src, 7>, fused_rows<D, Src, 8>};
  for (int64_t r = 0; r < m; r += kFusedRows) by_rows[std::min(kFusedRows, m - r) - 1](at, k, x, r, acc + r * kCols);
}

// Calls f with the type's decoder (a default-constructed tag); false for a type without one.
template <class F>
bool with_decoder(int64_t type, const F& f) {
  return decoder_of<Q2K, Q3K, Q4K, Q5K, Q6K, Q5Blocks<false>, Q5Blocks<true>, Q80>(type, f);
}

// The columns' unit u into the tile; false leaves the type to decode_tile. A tiled weight's `rows` is its
// tile's run of blocks.
inline bool decode_tile_avx512(int64_t type, bool tiled, const uint8_t* rows, int64_t row_bytes, int64_t cols,
                               int64_t u, int64_t k, Tile& t) {
  t.len = std::min(kUnit, k - u * kUnit);
  return with_decoder(type, [&](auto d) {
    using D = decltype(d);
    if (tiled) {
      const uint8_t* p = rows + u * unit_stride<D, TileLoads>() * kCols;
      prefetch_ahead(p, unit_stride<D, TileLoads>() * kCols);
      decode_unit_avx512<D>(TileLoads{p}, p, t);
    } else {
      const Source<Gather> at = row_source(rows, row_bytes, cols);
      decode_unit_avx512<D>(at.src, rows + u * unit_stride<D, Gather>(), t);
    }
  });
}

// All of the tile's units times m <= kFusedMost rows into acc; false for a type without a decoder.
inline bool fused_tile(int64_t type, bool tiled, const uint8_t* rows, int64_t row_bytes, int64_t cols, int64_t k,
                       const Activations& x, int64_t m, float* acc) {
  return with_decoder(type, [&](auto d) {
    using D = decltype(d);
    if (tiled) fused_any<D>(tile_source(rows), k, x, m, acc);
    else fused_any<D>(row_source(rows, row_bytes, cols), k, x, m, acc);
  });
}
#endif

}  // namespace iterserve_kquant
