// The AVX2 side of the GGUF matmul (kquant_ops.cpp): kquant_avx512.h's decoders of a tiled weight, 8 columns a
// register, and the int8 dots. A tile's 16 columns are two halves of 32 bytes in each 64-byte chunk of the tiled
// blocks, decoded one after the other into the same Tile the portable decoder fills, to the bit (the scales are
// the same exact float32 products), which `rows` multiplies; a single row takes the codes from the decoder's
// registers instead, in the same dots and float steps.
#pragma once

#include "kquant.h"

namespace iterserve_kquant::avx2 {

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
// Columns [8 h, 8 h + 8) of a tiled block: the dword at byte offset p - base of those 8 rows is one 32-byte load.
struct Half {
  const uint8_t* base;
  int h;
  __m256i at(const uint8_t* p) const {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + (p - base) * 16 + 32 * h));
  }
};

// The float16 in bits [shift, shift + 16) of each lane, as float.
inline __m256 half_lanes(__m256i v, int shift) {
  const __m256i w = _mm256_and_si256(_mm256_srli_epi32(v, shift), _mm256_set1_epi32(0xFFFF));
  // packus gives words 0-3 twice in the low 128 bits and 4-7 twice in the high: keep qwords 0 and 2
  return _mm256_cvtph_ps(_mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(w, w), 0x08)));
}

inline __m256i byte_lanes(__m256i v, int byte) {
  return _mm256_and_si256(_mm256_srli_epi32(v, 8 * byte), _mm256_set1_epi32(0xFF));
}

inline __m256i low_nibbles(__m256i v, bool high) {
  return _mm256_and_si256(high ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(0x0F));
}

// Bit `bit` of each byte, in place of bit `to`.
inline __m256i byte_bit(__m256i v, int bit, int to) {
  return _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(v, bit), _mm256_set1_epi8(1)), to);
}

inline __m256 to_float(__m256i v) { return _mm256_cvtepi32_ps(v); }

// A half's scales and offsets: group g's at s[g * kCols], o[g * kCols] (8 floats each).
inline void store_group(float* s, float* o, int g, __m256 sv, __m256 ov) {
  _mm256_storeu_ps(s + g * kCols, sv);
  _mm256_storeu_ps(o + g * kCols, ov);
}

// Each type's decoder as kquant_avx512.h's (same bytes, same bit positions), on one half of the columns.
struct Q4K {
  static constexpr int kBias = 0;
  static constexpr int64_t kBlock = 256, kStride = 144;
  static void scales(const Half& g, const uint8_t* p, int64_t, float* s, float* o) {
    const __m256i head = g.at(p), s0 = g.at(p + 4), s1 = g.at(p + 8), s2 = g.at(p + 12);
    const __m256 d = half_lanes(head, 0), dmin = half_lanes(head, 16);
    const __m256i m6 = _mm256_set1_epi32(63), m4 = _mm256_set1_epi32(0x0F);
    for (int j = 0; j < 8; ++j) {
      __m256i sc, mn;
      if (j < 4) {
        sc = _mm256_and_si256(byte_lanes(s0, j), m6);
        mn = _mm256_and_si256(byte_lanes(s1, j), m6);
      } else {
        const __m256i hi = byte_lanes(s2, j - 4);
        sc = _mm256_or_si256(_mm256_and_si256(hi, m4),
                             _mm256_slli_epi32(_mm256_srli_epi32(byte_lanes(s0, j - 4), 6), 4));
        mn = _mm256_or_si256(_mm256_srli_epi32(hi, 4),
                             _mm256_slli_epi32(_mm256_srli_epi32(byte_lanes(s1, j - 4), 6), 4));
      }
      const __m256 sv = _mm256_mul_ps(d, to_float(sc));
      const __m256 ov = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(dmin, to_float(mn)));
      store_group(s, o, 2 * j, sv, ov);
      store_group(s, o, 2 * j + 1, sv, ov);
    }
  }
  [[gnu::always_inline]] static __m256i codes(const Half& g, const uint8_t* p, int c) {
    return low_nibbles(g.at(p + 16 + 32 * (c >> 4) + 4 * (c & 7)), c & 8);
  }
};

struct Q5K : Q4K {
  static constexpr int64_t kStride = 176;
  [[gnu::always_inline]] static __m256i codes(const Half& g, const uint8_t* p, int c) {
    const int j = c >> 4, hi = (c >> 3) & 1, i = c & 7;
    const __m256i v = low_nibbles(g.at(p + 48 + 32 * j + 4 * i), hi);
    return _mm256_or_si256(v, byte_bit(g.at(p + 16 + 4 * i), 2 * j + hi, 4));
  }
};

struct Q6K {
  static constexpr int kBias = 32;
  static constexpr int64_t kBlock = 256, kStride = 210;
  static void scales(const Half& g, const uint8_t* p, int64_t, float* s, float* o) {
    const __m256 d = half_lanes(g.at(p + 208), 0);  // a tiled block has its last bytes padded to a dword
    for (int i = 0; i < 4; ++i) {
      const __m256i v = g.at(p + 192 + 4 * i);
      for (int b = 0; b < 4; ++b) {
        const __m256i sc = _mm256_srai_epi32(_mm256_slli_epi32(v, 24 - 8 * b), 24);
        store_group(s, o, 4 * i + b, _mm256_mul_ps(d, to_float(sc)), _mm256_setzero_ps());
      }
    }
  }
  [[gnu::always_inline]] static __m256i codes(const Half& g, const uint8_t* p, int c) {
    const int h = c >> 5, hi = (c >> 4) & 1, l = c & 15;
    const __m256i lo = low_nibbles(g.at(p + 64 * h + 4 * l), hi);
    const int shift = 2 * (l >> 3) + 4 * hi;
    const __m256i qh = g.at(p + 128 + 32 * h + 4 * (l & 7));
    const __m256i at4 = shift <= 4 ? _mm256_slli_epi16(qh, 4 - shift) : _mm256_srli_epi16(qh, shift - 4);
    return _mm256_or_si256(lo, _mm256_and_si256(at4, _mm256_set1_epi8(0x30)));
  }
};

struct Q3K {
  static constexpr int kBias = 4;
  static constexpr int64_t kBlock = 256, kStride = 110;
  static void scales(const Half& g, const uint8_t* p, int64_t, float* s, float* o) {
    const __m256 d = half_lanes(g.at(p + 108), 0);
    const __m256i sc[3] = {g.at(p + 96), g.at(p + 100), g.at(p + 104)};
    for (int i = 0; i < 16; ++i) {
      const __m256i b = byte_lanes(sc[(i % 8) / 4], i % 4);
      const __m256i low = i < 8 ? _mm256_and_si256(b, _mm256_set1_epi32(0x0F)) : _mm256_srli_epi32(b, 4);
      const __m256i high =
          _mm256_and_si256(_mm256_srli_epi32(byte_lanes(sc[2], i % 4), 2 * (i / 4)), _mm256_set1_epi32(3));
      const __m256i v = _mm256_sub_epi32(_mm256_or_si256(low, _mm256_slli_epi32(high, 4)), _mm256_set1_epi32(32));
      store_group(s, o, i, _mm256_mul_ps(d, to_float(v)), _mm256_setzero_ps());
    }
  }
  [[gnu::always_inline]] static __m256i codes(const Half& g, const uint8_t* p, int c) {
    const int h = c >> 5, t = (c >> 3) & 3, i = c & 7;
    const __m256i low =
        _mm256_and_si256(_mm256_srli_epi16(g.at(p + 32 + 32 * h + 4 * i), 2 * t), _mm256_set1_epi8(3));
    return _mm256_or_si256(low, byte_bit(g.at(p + 4 * i), 4 * h + t, 2));
  }
};

struct Q2K {
  static constexpr int kBias = 0;
  static constexpr int64_t kBlock = 256, kStride = 84;
  static void scales(const Half& g, const uint8_t* p, int64_t, float* s, float* o) {
    const __m256i head = g.at(p + 80);
    const __m256 d = half_lanes(head, 0), dmin = half_lanes(head, 16);
    for (int i = 0; i < 4; ++i) {
      const __m256i v = g.at(p + 4 * i);
      for (int b = 0; b < 4; ++b) {
        const __m256i sc = byte_lanes(v, b);
        const __m256 sv = _mm256_mul_ps(d, to_float(_mm256_and_si256(sc, _mm256_set1_epi32(15))));
        const __m256 ov = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(dmin, to_float(_mm256_srli_epi32(sc, 4))));
        store_group(s, o, 4 * i + b, sv, ov);
      }
    }
  }
  [[gnu::always_inline]] static __m256i codes(const Half& g, const uint8_t* p, int c) {
    const int h = c >> 5, t = (c >> 3) & 3, i = c & 7;
    return _mm256_and_si256(_mm256_srli_epi16(g.at(p + 16 + 32 * h + 4 * i), 2 * t), _mm256_set1_epi8(3));
  }
};

// Q5_0 / Q5_1 tiled: blocks padded to 24 bytes, qh from byte 4, qs from byte 8.
template <bool kMin>
struct Q5Blocks {
  static constexpr int kBias = kMin ? 0 : 16;
  static constexpr int64_t kBlock = 32, kStride = 24;
  static void scales(const Half& g, const uint8_t* p, int64_t len, float* s, float* o) {
    for (int64_t b = 0; b < len / 32; ++b) {
      const __m256i head = g.at(p + b * kStride);
      const __m256 d = half_lanes(head, 0), m = kMin ? half_lanes(head, 16) : _mm256_setzero_ps();
      store_group(s, o, static_cast<int>(2 * b), d, m);
      store_group(s, o, static_cast<int>(2 * b + 1), d, m);
    }
  }
  // The fifth bits of inputs 4i..4i+3 of block b: byte (i / 2) of qh (chunks 4.. use its upper half) moved to
  // each of the lane's 4 bytes (a shuffle within each 128 bits: a lane's dword stays in its 128 bits).
  [[gnu::always_inline]] static __m256i codes(const Half& g, const uint8_t* p, int c) {
    const int b = c >> 3, i = c & 7, byte = 2 * (i >> 2) + ((i & 3) >> 1);
    const uint8_t* q = p + b * kStride + 4;
    const __m256i lo = low_nibbles(g.at(q + 4 + 4 * (i & 3)), i >> 2);
    const __m256i lane = _mm256_set_epi32(0x0C0C0C0C, 0x08080808, 0x04040404, 0, 0x0C0C0C0C, 0x08080808, 0x04040404, 0);
    const __m256i qh = _mm256_shuffle_epi8(g.at(q), _mm256_add_epi8(lane, _mm256_set1_epi8(static_cast<char>(byte))));
    const __m256i bits = _mm256_set1_epi32(static_cast<int32_t>(0x08040201u << 4 * (i & 1)));
    const __m256i clear = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bits), _mm256_setzero_si256());
    return _mm256_add_epi8(lo, _mm256_andnot_si256(clear, _mm256_set1_epi8(16)));
  }
};

// Q8_0 tiled: blocks padded to 36 bytes, the codes from byte 4.
struct Q80 {
  static constexpr int kBias = 128;
  static constexpr int64_t kBlock = 32, kStride = 36;
  static void scales(const Half& g, const uint8_t* p, int64_t len, float* s, float* o) {
    for (int64_t b = 0; b < len / 32; ++b) {
      const __m256 d = half_lanes(g.at(p + b * kStride), 0);
      store_group(s, o, static_cast<int>(2 * b), d, _mm256_setzero_ps());
      store_group(s, o, static_cast<int>(2 * b + 1), d, _mm256_setzero_ps());
    }
  }
  [[gnu::always_inline]] static __m256i codes(const Half& g, const uint8_t* p, int c) {
    const __m256i v = g.at(p + (c >> 3) * kStride + 4 + 4 * (c & 7));
    return _mm256_xor_si256(v, _mm256_set1_epi8(static_cast<char>(0x80)));
  }
};

// One tile column's bytes of a unit: a super-block padded to whole dwords, or 8 padded blocks of 32.
template <class D>
constexpr int64_t unit_stride() {
  return D::kBlock == kUnit ? (D::kStride + 3) / 4 * 4 : 8 * D::kStride;
}

// The unit at p (t.len inputs) of a tiled weight's 16 columns into t: codes + 128 - bias, scales, offsets.
template <class D>
void decode_unit(const uint8_t* p, Tile& t) {
  const __m256i bias = _mm256_set1_epi8(static_cast<char>(128 - D::kBias));
  for (int h = 0; h < 2; ++h) {
    const Half src{p, h};
    D::scales(src, p, t.len, &t.s[0][0] + 8 * h, &t.o[0][0] + 8 * h);
    auto store = [&](int c) {
      const __m256i q = _mm256_add_epi8(D::codes(src, p, c), bias);
      _mm256_store_si256(reinterpret_cast<__m256i*>(t.q + c * 64 + 32 * h), q);
    };
    if constexpr (D::kBlock == kUnit) {  // unrolled: each code's bit positions become constants
#pragma GCC unroll 64
      for (int c = 0; c < kUnit / 4; ++c) store(c);
    } else {  // a block's codes unrolled: its fifth-bit byte is loaded once, the bit positions are constants
      for (int b = 0; b < t.len / 32; ++b) {
#pragma GCC unroll 8
        for (int i = 0; i < 8; ++i) store(8 * b + i);
      }
    }
  }
}

// -- the int8 dots ---------------------------------------------------------------------------------------------

// One group of 16 inputs of 8 columns: w[j] holds inputs 4j..4j+3 of each column (codes + bias, unsigned), xb[j]
// the row's int8 inputs 4j..4j+3 broadcast. vpmaddubsw wants unsigned x signed. Codes below 64 (bias < 128: every
// type but Q8_0) go in as they are, bias * sum(x) taken back off, and two of its int16 sums still fit
// (2 * 2 * 63 * 127 < 32768); Q8_0's (bias 128) take |q| times x with q's sign (|q| <= 128, |x| <= 127: a pair
// fits). Exact either way.
[[gnu::always_inline]] inline __m256i group_dot(const __m256i* w, const __m256i* xb, int bias, int32_t sum) {
  const __m256i ones = _mm256_set1_epi16(1);
  if (bias < 128) {
    const __m256i p01 = _mm256_add_epi16(_mm256_maddubs_epi16(w[0], xb[0]), _mm256_maddubs_epi16(w[1], xb[1]));
    const __m256i p23 = _mm256_add_epi16(_mm256_maddubs_epi16(w[2], xb[2]), _mm256_maddubs_epi16(w[3], xb[3]));
    const __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(p01, ones), _mm256_madd_epi16(p23, ones));
    return _mm256_sub_epi32(dot, _mm256_set1_epi32(bias * sum));
  }
  __m256i dot = _mm256_setzero_si256();
  for (int j = 0; j < 4; ++j) {
    const __m256i q = _mm256_xor_si256(w[j], _mm256_set1_epi8(static_cast<char>(0x80)));
    const __m256i prod = _mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(xb[j], q));
    dot = _mm256_add_epi32(dot, _mm256_madd_epi16(prod, ones));
  }
  return dot;
}

// Row r's 16 inputs of group ga, each group of 4 broadcast.
inline void group_rows(const Activations& x, int64_t r, int64_t ga, __m256i* xb) {
  const int8_t* xr = x.a.row(r) + ga * kGroup;
  for (int j = 0; j < 4; ++j) xb[j] = _mm256_set1_epi32(load_i32(xr + 4 * j));
}

// out += dot * (s * a_d) + o * (a_d * sum(x)): the group's float steps for one row and 8 columns.
[[gnu::always_inline]] inline __m256 group_step(__m256i dot, const float* s, const float* o, const Activations& x,
                                                int64_t r, int64_t ga, __m256 out) {
  const float ad = x.d(r, ga), e = ad * static_cast<float>(x.sum(r, ga));
  out = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(_mm256_loadu_ps(s), _mm256_set1_ps(ad)), out);
  return _mm256_fmadd_ps(_mm256_loadu_ps(o), _mm256_set1_ps(e), out);
}

// acc[r][c] for rows [0, mr) += the tile (unit u, codes + 128) times the rows; `bias` makes the codes unsigned.
inline void rows(const Tile& t, const Activations& x, int64_t u, int64_t mr, float* acc, int bias) {
  const __m256i shift = _mm256_set1_epi8(static_cast<char>(128 - bias));  // the tile's codes + 128 -> codes + bias
  for (int64_t r = 0; r < mr; ++r) {
    __m256 out[2] = {_mm256_loadu_ps(acc + r * kCols), _mm256_loadu_ps(acc + r * kCols + 8)};
    for (int64_t g = 0; g < t.len / kGroup; ++g) {
      const int64_t ga = u * kGroups + g;
      __m256i xb[4];
      group_rows(x, r, ga, xb);
      for (int h = 0; h < 2; ++h) {
        __m256i w[4];
        for (int j = 0; j < 4; ++j)
          w[j] = _mm256_sub_epi8(_mm256_load_si256(reinterpret_cast<const __m256i*>(t.q + (g * 4 + j) * 64 + h * 32)),
                                 shift);
        out[h] = group_step(group_dot(w, xb, bias, x.sum(r, ga)), t.s[g] + 8 * h, t.o[g] + 8 * h, x, r, ga, out[h]);
      }
    }
    _mm256_storeu_ps(acc + r * kCols, out[0]);
    _mm256_storeu_ps(acc + r * kCols + 8, out[1]);
  }
}

// -- decoded in registers -------------------------------------------------------------------------------------

// Half h of the tiled weight's 16 columns times one row (a batch-1 decode step), every unit decoded in registers
// and multiplied at once: per group the same integer dots and float steps, in the same order, as rows (a row's
// result does not depend on which of the two multiplied it). More rows decode a tile once: at 4 rows decoding
// again for each was slower.
template <class D>
void fused_half(const uint8_t* tile, int64_t k, const Activations& x, int h, float* acc) {
  alignas(32) float s[kGroups][kCols], o[kGroups][kCols];
  __m256 out = _mm256_loadu_ps(acc + 8 * h);
  for (int64_t u = 0; u * kUnit < k; ++u) {
    const int64_t len = std::min(kUnit, k - u * kUnit);
    const uint8_t* p = tile + u * unit_stride<D>() * kCols;
    const Half src{p, h};
    if (h == 0) prefetch_ahead(p, unit_stride<D>() * kCols);  // the second half finds the units in L2
    D::scales(src, p, len, &s[0][0], &o[0][0]);
#pragma GCC unroll 8
    for (int b = 0; b < len / 32; ++b) {
      __m256i w[8];
      for (int j = 0; j < 8; ++j) w[j] = D::codes(src, p, 8 * b + j);
      for (int gg = 0; gg < 2; ++gg) {
        const int64_t ga = u * kGroups + 2 * b + gg;
        __m256i xb[4];
        group_rows(x, 0, ga, xb);
        out = group_step(group_dot(w + 4 * gg, xb, D::kBias, x.sum(0, ga)), s[2 * b + gg], o[2 * b + gg], x, 0, ga,
                         out);
      }
    }
  }
  _mm256_storeu_ps(acc + 8 * h, out);
}

// Calls f with the type's decoder (a default-constructed tag); false for a type without one.
template <class F>
bool with_decoder(int64_t type, const F& f) {
  return decoder_of<Q2K, Q3K, Q4K, Q5K, Q6K, Q5Blocks<false>, Q5Blocks<true>, Q80>(type, f);
}

// The tiled weight's unit u into the tile; false for a type without an AVX2 decoder (left to decode_tile).
inline bool decode_tile(int64_t type, const uint8_t* tile, int64_t u, int64_t k, Tile& t) {
  t.len = std::min(kUnit, k - u * kUnit);
  return with_decoder(type, [&](auto d) {
    using D = decltype(d);
    const uint8_t* p = tile + u * unit_stride<D>() * kCols;
    prefetch_ahead(p, unit_stride<D>() * kCols);
    decode_unit<D>(p, t);
  });
}

// The whole tile (all of its units) times x's one row into acc; false for a type without a decoder.
inline bool fused_tile(int64_t type, const uint8_t* tile, int64_t k, const Activations& x, float* acc) {
  return with_decoder(type, [&](auto d) {
    for (int h = 0; h < 2; ++h) fused_half<decltype(d)>(tile, k, x, h, acc);
  });
}
#endif

}  // namespace iterserve_kquant::avx2
