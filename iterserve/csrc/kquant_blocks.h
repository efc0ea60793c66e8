// One GGUF block to the GGUF matmul's common form (kquant_ops.cpp): each type's block size and bytes, the tiled
// layout's padding, and the scalar decoders, with the formulas and bit layouts of ggml's block_* types.
#pragma once

#include "kquant.h"

namespace iterserve_kquant {

// Inputs per block and bytes per block of a type; {0, 0} for a type this file does not decode.
struct Layout {
  int64_t block, bytes;
};

inline Layout layout(int64_t type) {
  switch (type) {
    case kQ4_0: return {32, 18};
    case kQ4_1: return {32, 20};
    case kQ5_0: return {32, 22};
    case kQ5_1: return {32, 24};
    case kQ8_0: return {32, 34};
    case kQ2_K: return {256, 84};
    case kQ3_K: return {256, 110};
    case kQ4_K: return {256, 144};
    case kQ5_K: return {256, 176};
    case kQ6_K: return {256, 210};
    case kIQ4_NL: return {32, 18};
    case kIQ4_XS: return {256, 136};
    default: return {0, 0};
  }
}

// Bytes of a block in a tiled weight: whole dwords.
inline int64_t padded_bytes(int64_t type) { return (layout(type).bytes + 3) / 4 * 4; }

// Where a tiled block's padding goes: after Q5_0's, Q8_0's and IQ4_NL's 2-byte scale (their codes then start on
// a dword), else at the end.
inline int64_t pad_at(int64_t type) {
  return type == kQ5_0 || type == kQ8_0 || type == kIQ4_NL ? 2 : layout(type).bytes;
}

// Types whose weights a linear layer tiles (gguf_weight.py's TILED_TYPES): those with an AVX2 decoder.
inline bool tiles(int64_t type) { return type != kQ4_0 && type != kQ4_1 && layout(type).block > 0; }

// Types whose groups of 16 inputs share scale and offset in pairs (a 32-block): AVX-512 takes one float step a pair.
inline bool pairs(int64_t type) { return type != kQ2_K && type != kQ3_K && type != kQ6_K; }

// -- one block to codes, scales and offsets (scalar; the formulas and bit layouts of ggml's block_*) --------

inline void decode_q4_0(const uint8_t* p, int8_t* q, float* s, float* o, bool with_min) {
  const float d = half_to_float(p), m = with_min ? half_to_float(p + 2) : 0.f;
  const uint8_t* qs = p + (with_min ? 4 : 2);
  const int bias = with_min ? 0 : 8;
  for (int j = 0; j < 16; ++j) {
    q[j] = static_cast<int8_t>((qs[j] & 0x0F) - bias);
    q[j + 16] = static_cast<int8_t>((qs[j] >> 4) - bias);
  }
  s[0] = s[1] = d;
  o[0] = o[1] = m;
}

inline void decode_q5_0(const uint8_t* p, int8_t* q, float* s, float* o, bool with_min) {
  const float d = half_to_float(p), m = with_min ? half_to_float(p + 2) : 0.f;
  const uint8_t* h = p + (with_min ? 4 : 2);
  const uint32_t qh = static_cast<uint32_t>(h[0]) | static_cast<uint32_t>(h[1]) << 8 |
                      static_cast<uint32_t>(h[2]) << 16 | static_cast<uint32_t>(h[3]) << 24;
  const uint8_t* qs = h + 4;
  const int bias = with_min ? 0 : 16;
  for (int j = 0; j < 16; ++j) {
    q[j] = static_cast<int8_t>(((qs[j] & 0x0F) | ((qh >> j) & 1) << 4) - bias);
    q[j + 16] = static_cast<int8_t>(((qs[j] >> 4) | ((qh >> (j + 16)) & 1) << 4) - bias);
  }
  s[0] = s[1] = d;
  o[0] = o[1] = m;
}

inline void decode_q8_0(const uint8_t* p, int8_t* q, float* s, float* o) {
  std::memcpy(q, p + 2, 32);
  s[0] = s[1] = half_to_float(p);
  o[0] = o[1] = 0.f;
}

// The int8 values of 32 inputs from their 16 bytes of codes: the low nibbles first, then the high ones.
inline void iq4_values(const uint8_t* qs, int8_t* q) {
  for (int j = 0; j < 16; ++j) {
    q[j] = kIq4Values[qs[j] & 0x0F];
    q[j + 16] = kIq4Values[qs[j] >> 4];
  }
}

inline void decode_iq4_nl(const uint8_t* p, int8_t* q, float* s, float* o) {
  iq4_values(p + 2, q);
  s[0] = s[1] = half_to_float(p);
  o[0] = o[1] = 0.f;
}

// IQ4_XS: a float16 d, then eight 6-bit scales (their high 2 bits in a uint16, their low 4 in 4 bytes) of 32
// inputs each, stored + 32.
inline void decode_iq4_xs(const uint8_t* p, int8_t* q, float* s, float* o) {
  const float d = half_to_float(p);
  const int high = p[2] | p[3] << 8;
  for (int j = 0; j < 8; ++j) {
    const int scale = ((p[4 + j / 2] >> (4 * (j % 2))) & 0x0F) | ((high >> (2 * j)) & 3) << 4;
    s[2 * j] = s[2 * j + 1] = d * static_cast<float>(scale - 32);
    o[2 * j] = o[2 * j + 1] = 0.f;
    iq4_values(p + 8 + 16 * j, q + 32 * j);
  }
}

inline void decode_q2_k(const uint8_t* p, int8_t* q, float* s, float* o) {
  const uint8_t *sc = p, *qs = p + 16;
  const float d = half_to_float(p + 80), dmin = half_to_float(p + 82);
  for (int h = 0; h < 2; ++h)
    for (int t = 0; t < 4; ++t)
      for (int l = 0; l < 32; ++l) q[128 * h + 32 * t + l] = static_cast<int8_t>((qs[32 * h + l] >> (2 * t)) & 3);
  for (int g = 0; g < 16; ++g) {
    s[g] = d * static_cast<float>(sc[g] & 0x0F);
    o[g] = -(dmin * static_cast<float>(sc[g] >> 4));
  }
}

inline void decode_q3_k(const uint8_t* p, int8_t* q, float* s, float* o) {
  const uint8_t *hmask = p, *qs = p + 32, *sc = p + 96;
  const float d = half_to_float(p + 108);
  for (int h = 0; h < 2; ++h)
    for (int t = 0; t < 4; ++t)
      for (int l = 0; l < 32; ++l) {
        const int low = (qs[32 * h + l] >> (2 * t)) & 3, high = (hmask[l] >> (4 * h + t)) & 1;
        q[128 * h + 32 * t + l] = static_cast<int8_t>(low - 4 + 4 * high);
      }
  for (int g = 0; g < 16; ++g) {
    const int low = g < 8 ? sc[g] & 0x0F : sc[g - 8] >> 4, high = (sc[8 + g % 4] >> (2 * (g / 4))) & 3;
    s[g] = d * static_cast<float>((low | high << 4) - 32);
    o[g] = 0.f;
  }
}

// Q4_K and Q5_K: eight 6-bit scales and mins of 32 inputs each, packed into 12 bytes.
inline void scales_k4(const uint8_t* p, float* s, float* o) {
  const float d = half_to_float(p), dmin = half_to_float(p + 2);
  const uint8_t* sc = p + 4;
  for (int j = 0; j < 8; ++j) {
    const int scale = j < 4 ? sc[j] & 63 : (sc[j + 4] & 0x0F) | ((sc[j - 4] >> 6) << 4);
    const int min = j < 4 ? sc[j + 4] & 63 : (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
    s[2 * j] = s[2 * j + 1] = d * static_cast<float>(scale);
    o[2 * j] = o[2 * j + 1] = -(dmin * static_cast<float>(min));
  }
}

inline void decode_q4_k(const uint8_t* p, int8_t* q, float* s, float* o) {
  scales_k4(p, s, o);
  const uint8_t* qs = p + 16;
  for (int j = 0; j < 4; ++j)
    for (int l = 0; l < 32; ++l) {
      q[64 * j + l] = static_cast<int8_t>(qs[32 * j + l] & 0x0F);
      q[64 * j + 32 + l] = static_cast<int8_t>(qs[32 * j + l] >> 4);
    }
}

inline void decode_q5_k(const uint8_t* p, int8_t* q, float* s, float* o) {
  scales_k4(p, s, o);
  const uint8_t *qh = p + 16, *qs = p + 48;
  for (int j = 0; j < 4; ++j)
    for (int l = 0; l < 32; ++l) {
      q[64 * j + l] = static_cast<int8_t>((qs[32 * j + l] & 0x0F) | ((qh[l] >> (2 * j)) & 1) << 4);
      q[64 * j + 32 + l] = static_cast<int8_t>((qs[32 * j + l] >> 4) | ((qh[l] >> (2 * j + 1)) & 1) << 4);
    }
}

inline void decode_q6_k(const uint8_t* p, int8_t* q, float* s, float* o) {
  const uint8_t *ql = p, *qh = p + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(p + 192);
  const float d = half_to_float(p + 208);
  for (int h = 0; h < 2; ++h)
    for (int l = 0; l < 32; ++l) {
      const int a = ql[64 * h + l], b = ql[64 * h + 32 + l], hb = qh[32 * h + l];
      int8_t* out = q + 128 * h + l;
      out[0] = static_cast<int8_t>(((a & 0x0F) | (hb & 3) << 4) - 32);
      out[32] = static_cast<int8_t>(((b & 0x0F) | ((hb >> 2) & 3) << 4) - 32);
      out[64] = static_cast<int8_t>(((a >> 4) | ((hb >> 4) & 3) << 4) - 32);
      out[96] = static_cast<int8_t>(((b >> 4) | ((hb >> 6) & 3) << 4) - 32);
    }
  for (int g = 0; g < 16; ++g) {
    s[g] = d * static_cast<float>(sc[g]);
    o[g] = 0.f;
  }
}

// Inputs [u * 256, u * 256 + len) of one row into q[len], s and o[len / 16]; returns len.
inline int64_t decode_unit(int64_t type, const uint8_t* row, int64_t u, int64_t k, int8_t* q, float* s,
                           float* o) {
  const Layout l = layout(type);
  if (l.block == kUnit) {
    const uint8_t* p = row + u * l.bytes;
    switch (type) {
      case kQ2_K: decode_q2_k(p, q, s, o); break;
      case kQ3_K: decode_q3_k(p, q, s, o); break;
      case kQ4_K: decode_q4_k(p, q, s, o); break;
      case kQ5_K: decode_q5_k(p, q, s, o); break;
      case kIQ4_XS: decode_iq4_xs(p, q, s, o); break;
      default: decode_q6_k(p, q, s, o); break;
    }
    return kUnit;
  }
  const int64_t first = u * kUnit / l.block, len = std::min(kUnit, k - u * kUnit);
  for (int64_t b = 0; b < len / l.block; ++b) {
    const uint8_t* p = row + (first + b) * l.bytes;
    int8_t* qb = q + b * 32;
    float *sb = s + 2 * b, *ob = o + 2 * b;
    switch (type) {
      case kQ4_0: decode_q4_0(p, qb, sb, ob, false); break;
      case kQ4_1: decode_q4_0(p, qb, sb, ob, true); break;
      case kQ5_0: decode_q5_0(p, qb, sb, ob, false); break;
      case kQ5_1: decode_q5_0(p, qb, sb, ob, true); break;
      case kIQ4_NL: decode_iq4_nl(p, qb, sb, ob); break;
      default: decode_q8_0(p, qb, sb, ob); break;
    }
  }
  return len;
}

}  // namespace iterserve_kquant
