// The AVX2 side of the GGUF matmul (kquant_ops.cpp), its decoders: kquant_avx512.h's decoders of a tiled weight,
// 8 columns a register. A tile's 16 columns are two halves of 32 bytes in each 64-byte chunk of the tiled blocks,
// decoded one after the other into the same Tile the portable decoder fills, to the bit (the scales are the same
// exact float32 products; Q4_K's and Q5_K's kept as integers), which kquant_avx2_dots.h multiplies.
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

// Byte `byte` of each lane, zero-extended: one vpshufb (an index with its top bit set gives zero).
inline __m256i byte_lanes(__m256i v, int byte) {
  const __m256i at = _mm256_setr_epi32(0, 4, 8, 12, 0, 4, 8, 12);  // each lane's first byte in its 128 bits
  return _mm256_shuffle_epi8(v, _mm256_add_epi32(at, _mm256_set1_epi32(static_cast<int32_t>(0x80808000u | byte))));
}

inline __m256i low_nibbles(__m256i v, bool high) {
  return _mm256_and_si256(high ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(0x0F));
}

// Bit `bit` of each byte, in place of bit `to`.
inline __m256i byte_bit(__m256i v, int bit, int to) {
  return _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(v, bit), _mm256_set1_epi8(1)), to);
}

inline __m256 to_float(__m256i v) { return _mm256_cvtepi32_ps(v); }

// A half's scales and offsets: group g's at s[g * kCols], o[g * kCols] (8 floats each). Types without offsets
// store none, and Pairs types only a 32-block's first group: the dots read no others.
inline void store_group(float* s, float* o, int g, __m256 sv, __m256 ov) {
  _mm256_storeu_ps(s + g * kCols, sv);
  _mm256_storeu_ps(o + g * kCols, ov);
}
inline void store_scale(float* s, int g, __m256 sv) { _mm256_storeu_ps(s + g * kCols, sv); }

// What a type's codes are to the int8 dots: + Bias they are unsigned, at most Most; Pairs: the two groups of 16 of
// a 32-block share scale and offset; Offset: whether the type has offsets at all (kquant_avx512.h's kPairs, kOffset).
template <int Bias, int Most, bool Pairs, bool Offset>
struct Codes {
  static constexpr int kBias = Bias, kMost = Most;
  static constexpr bool kPairs = Pairs, kOffset = Offset;
  static constexpr bool kIntScales = false;  // int_scales in place of scales (Q4_K, Q5_K)
};

// Each type's decoder as kquant_avx512.h's (same bytes, same bit positions), on one half of the columns.
struct Q4K : Codes<0, 15, true, true> {
  static constexpr int64_t kBlock = 256, kStride = 144;
  static constexpr bool kIntScales = true;
  // Block j's 6-bit scale in both int16 halves of each lane at isc + j * kCols (vpmaddwd multiplies the codes' dots
  // by it exactly), d at d_out, the offsets as the others' (one float step a 32-block fewer, and none per scale).
  static void int_scales(const Half& g, const uint8_t* p, int32_t* isc, float* d_out, float* o) {
    const __m256i head = g.at(p), s0 = g.at(p + 4), s1 = g.at(p + 8), s2 = g.at(p + 12);
    const __m256 d = half_lanes(head, 0), neg_dmin = _mm256_sub_ps(_mm256_setzero_ps(), half_lanes(head, 16));
    // the eight 6-bit scales and mins a byte each, four to a lane, unpacked for all four at once
    const __m256i low6 = _mm256_set1_epi8(0x3F), low4 = _mm256_set1_epi8(0x0F), top2 = _mm256_set1_epi8(0x30);
    const __m256i sc[2] = {_mm256_and_si256(s0, low6), _mm256_or_si256(_mm256_and_si256(s2, low4),
                                                                        _mm256_and_si256(_mm256_srli_epi32(s0, 2), top2))};
    const __m256i mn[2] = {_mm256_and_si256(s1, low6),
                           _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(s2, 4), low4),
                                           _mm256_and_si256(_mm256_srli_epi32(s1, 2), top2))};
    _mm256_storeu_ps(d_out, d);
    for (int j = 0; j < 8; ++j) {
      const __m256i b = byte_lanes(sc[j / 4], j % 4);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(isc + j * kCols), _mm256_or_si256(b, _mm256_slli_epi32(b, 16)));
      const __m256 ov = _mm256_mul_ps(neg_dmin, to_float(byte_lanes(mn[j / 4], j % 4)));  // -(dmin * m) exactly
      _mm256_storeu_ps(o + 2 * j * kCols, ov);
    }
  }
  [[gnu::always_inline]] static __m256i codes(const Half& g, const uint8_t* p, int c) {
    return low_nibbles(g.at(p + 16 + 32 * (c >> 4) + 4 * (c & 7)), c & 8);
  }
};

struct Q5K : Q4K {
  static constexpr int kMost = 31;
  static constexpr int64_t kStride = 176;
  [[gnu::always_inline]] static __m256i codes(const Half& g, const uint8_t* p, int c) {
    const int j = c >> 4, hi = (c >> 3) & 1, i = c & 7;
    const __m256i v = low_nibbles(g.at(p + 48 + 32 * j + 4 * i), hi);
    return _mm256_or_si256(v, byte_bit(g.at(p + 16 + 4 * i), 2 * j + hi, 4));
  }
};

struct Q6K : Codes<32, 63, false, false> {
  static constexpr int64_t kBlock = 256, kStride = 210;
  static void scales(const Half& g, const uint8_t* p, int64_t, float* s, float*) {
    const __m256 d = half_lanes(g.at(p + 208), 0);  // a tiled block has its last bytes padded to a dword
    for (int i = 0; i < 4; ++i) {
      const __m256i v = g.at(p + 192 + 4 * i);
      for (int b = 0; b < 4; ++b) {
        const __m256i sc = _mm256_srai_epi32(_mm256_slli_epi32(v, 24 - 8 * b), 24);
        store_scale(s, 4 * i + b, _mm256_mul_ps(d, to_float(sc)));
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

struct Q3K : Codes<4, 7, false, false> {
  static constexpr int64_t kBlock = 256, kStride = 110;
  static void scales(const Half& g, const uint8_t* p, int64_t, float* s, float*) {
    const __m256 d = half_lanes(g.at(p + 108), 0);
    const __m256i sc[3] = {g.at(p + 96), g.at(p + 100), g.at(p + 104)};
    for (int i = 0; i < 16; ++i) {
      const __m256i b = byte_lanes(sc[(i % 8) / 4], i % 4);
      const __m256i low = i < 8 ? _mm256_and_si256(b, _mm256_set1_epi32(0x0F)) : _mm256_srli_epi32(b, 4);
      const __m256i high =
          _mm256_and_si256(_mm256_srli_epi32(byte_lanes(sc[2], i % 4), 2 * (i / 4)), _mm256_set1_epi32(3));
      const __m256i v = _mm256_sub_epi32(_mm256_or_si256(low, _mm256_slli_epi32(high, 4)), _mm256_set1_epi32(32));
      store_scale(s, i, _mm256_mul_ps(d, to_float(v)));
    }
  }
  [[gnu::always_inline]] static __m256i codes(const Half& g, const uint8_t* p, int c) {
    const int h = c >> 5, t = (c >> 3) & 3, i = c & 7;
    const __m256i low =
        _mm256_and_si256(_mm256_srli_epi16(g.at(p + 32 + 32 * h + 4 * i), 2 * t), _mm256_set1_epi8(3));
    return _mm256_or_si256(low, byte_bit(g.at(p + 4 * i), 4 * h + t, 2));
  }
};

struct Q2K : Codes<0, 3, false, true> {
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
struct Q5Blocks : Codes<kMin ? 0 : 16, 31, true, kMin> {
  static constexpr int64_t kBlock = 32, kStride = 24;
  static void scales(const Half& g, const uint8_t* p, int64_t len, float* s, float* o) {
    for (int64_t b = 0; b < len / 32; ++b) {
      const __m256i head = g.at(p + b * kStride);
      const __m256 d = half_lanes(head, 0);
      if constexpr (kMin) store_group(s, o, static_cast<int>(2 * b), d, half_lanes(head, 16));
      else store_scale(s, static_cast<int>(2 * b), d);
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

// A scale per 32-block: the float16 at the start of each tiled block of `stride` bytes.
inline void block_scales(const Half& g, const uint8_t* p, int64_t len, int64_t stride, float* s) {
  for (int64_t b = 0; b < len / 32; ++b) store_scale(s, static_cast<int>(2 * b), half_lanes(g.at(p + b * stride), 0));
}

// Q8_0 tiled: blocks padded to 36 bytes, the codes from byte 4.
struct Q80 : Codes<128, 128, true, false> {
  static constexpr int64_t kBlock = 32, kStride = 36;
  static void scales(const Half& g, const uint8_t* p, int64_t len, float* s, float*) {
    block_scales(g, p, len, kStride, s);
  }
  [[gnu::always_inline]] static __m256i codes(const Half& g, const uint8_t* p, int c) {
    const __m256i v = g.at(p + (c >> 3) * kStride + 4 + 4 * (c & 7));
    return _mm256_xor_si256(v, _mm256_set1_epi8(static_cast<char>(0x80)));
  }
};

// IQ4_NL's and IQ4_XS's codes: each nibble's int8 value in kIq4Values, + 128 as Q8_0's (one vpshufb).
[[gnu::always_inline]] inline __m256i iq4_codes(__m256i nibbles) {
  const __m256i values = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4Values)));
  return _mm256_xor_si256(_mm256_shuffle_epi8(values, nibbles), _mm256_set1_epi8(static_cast<char>(0x80)));
}

// The codes of inputs 4 i .. 4 i + 3 of a 32-block whose 16 bytes of nibbles start at q (low nibbles, then high).
[[gnu::always_inline]] inline __m256i iq4_chunk(const Half& g, const uint8_t* q, int i) {
  return iq4_codes(low_nibbles(g.at(q + 4 * (i & 3)), i >> 2));
}

// IQ4_NL tiled: blocks padded to 20 bytes, the codes from byte 4.
struct IQ4NL : Codes<128, 128, true, false> {
  static constexpr int64_t kBlock = 32, kStride = 20;
  static void scales(const Half& g, const uint8_t* p, int64_t len, float* s, float*) {
    block_scales(g, p, len, kStride, s);
  }
  [[gnu::always_inline]] static __m256i codes(const Half& g, const uint8_t* p, int c) {
    return iq4_chunk(g, p + (c >> 3) * kStride + 4, c & 7);
  }
};

// IQ4_XS: d and the scales' high bits in dword 0, their low 4 bits in dword 1, each 32-block's codes from byte 8.
struct IQ4XS : Codes<128, 128, true, false> {
  static constexpr int64_t kBlock = 256, kStride = 136;
  static void scales(const Half& g, const uint8_t* p, int64_t, float* s, float*) {
    const __m256i head = g.at(p), low = g.at(p + 4);
    const __m256 d = half_lanes(head, 0);
    for (int j = 0; j < 8; ++j) {
      const __m256i lo = _mm256_and_si256(_mm256_srli_epi32(low, 4 * j), _mm256_set1_epi32(0x0F));
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi32(head, 12 + 2 * j), _mm256_set1_epi32(0x30));
      const __m256i v = _mm256_sub_epi32(_mm256_or_si256(lo, hi), _mm256_set1_epi32(32));
      store_scale(s, 2 * j, _mm256_mul_ps(d, to_float(v)));
    }
  }
  [[gnu::always_inline]] static __m256i codes(const Half& g, const uint8_t* p, int c) {
    return iq4_chunk(g, p + 8 + 16 * (c >> 3), c & 7);
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
  t.int_scales = D::kIntScales;
  for (int h = 0; h < 2; ++h) {
    const Half src{p, h};
    if constexpr (D::kIntScales) D::int_scales(src, p, &t.sc[0][0] + 8 * h, t.d + 8 * h, &t.o[0][0] + 8 * h);
    else D::scales(src, p, t.len, &t.s[0][0] + 8 * h, &t.o[0][0] + 8 * h);
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

// Calls f with the type's decoder (a default-constructed tag); false for a type without one.
template <class F>
bool with_decoder(int64_t type, const F& f) {
  if (type == kIQ4_NL) return f(IQ4NL{}), true;
  if (type == kIQ4_XS) return f(IQ4XS{}), true;
  return decoder_of<Q2K, Q3K, Q4K, Q5K, Q6K, Q5Blocks<false>, Q5Blocks<true>, Q80>(type, f);
}

// Calls f with the codes of `type` (its decoder's, or Q4_0's and Q4_1's, which the portable decoder tiles).
template <class F>
bool with_codes(int64_t type, const F& f) {
  if (type == kQ4_0) return f(Codes<8, 15, true, false>{}), true;
  if (type == kQ4_1) return f(Codes<0, 15, true, true>{}), true;
  return with_decoder(type, f);
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

#endif

}  // namespace iterserve_kquant::avx2
