// Matmuls and row lookups on GGUF tensors kept exactly as the file stores them (the K-quants Q2_K..Q6_K in
// super-blocks of 256, Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 in blocks of 32), row-major: row j of the weight is output
// column j, its bytes the file's blocks one after another (iterserve/quantization/gguf_weight.py).
//
// Every type decodes to one form: signed integer codes q and, per group of 16 inputs, a float scale s and
// offset o, with w = s * q + o. The scales are products of a float16 and a small integer, computed in float32
// as gguf-py does (exact), so a row lookup gives gguf's dequantized values to the bit.
//
// A matmul decodes 16 columns x 256 inputs at a time into a Tile (codes + 128 as unsigned bytes, laid out
// 16 columns x 4 inputs per 64 bytes, as vpdpbusd consumes them) and multiplies it with every row of the
// activations, quantized to int8 per block of 32 (quant_rows.h):
//   sum_i w_i x_i ~= a_d * (s * sum_i q_i a_i + o * sum_i a_i)      per group of 16
// so each super-block is decoded once per call, whatever the number of rows. With AVX-512 and up to 16 rows
// (decode steps) the codes go from the decoder's registers straight into vpdpbusd instead: the weight is read
// once and nothing is stored, in the same integer dots and float steps per row, so a row's result does not
// depend on the row count.
//
// Weights of linear layers (all these types but Q4_0/Q4_1) are re-laid out at load ("tiled", gguf_weight.py):
// per tile of 16 rows and block, dword i of the 16 rows' blocks side by side (64 bytes), the block padded to
// whole dwords. The AVX-512 decoders then read with plain loads what they otherwise gather from 16 rows.

#include "ops.h"
#include "parallel.h"
#include "quant_rows.h"

using namespace iterserve_quant;

namespace {

constexpr int64_t kCols = 16;   // output columns per tile
constexpr int64_t kUnit = 256;  // inputs decoded at once: one K-quant super-block, or 8 blocks of 32
constexpr int64_t kGroup = 16;  // inputs sharing one scale and offset once decoded
constexpr int64_t kGroups = kUnit / kGroup;
constexpr int64_t kUnitBytes = 8 * 34;  // the most bytes of one row's unit: 8 Q8_0 blocks

// ggml's type ids (gguf.GGMLQuantizationType), which Python passes.
enum Type : int64_t {
  kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ2_K = 10, kQ3_K = 11, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14
};

// Inputs per block and bytes per block of a type; {0, 0} for a type this file does not decode.
struct Layout {
  int64_t block, bytes;
};

Layout layout(int64_t type) {
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
    default: return {0, 0};
  }
}

// Bytes of a block in a tiled weight: whole dwords.
inline int64_t padded_bytes(int64_t type) { return (layout(type).bytes + 3) / 4 * 4; }

// Where a tiled block's padding goes: after Q5_0's and Q8_0's 2-byte scale (their codes then start on a dword),
// else at the end.
inline int64_t pad_at(int64_t type) { return type == kQ5_0 || type == kQ8_0 ? 2 : layout(type).bytes; }

// Types whose weights a linear layer tiles (gguf_weight.py's TILED_TYPES): those with an AVX-512 decoder.
inline bool tiles(int64_t type) { return type != kQ4_0 && type != kQ4_1 && layout(type).block > 0; }

// -- one block to codes, scales and offsets (scalar; the formulas and bit layouts of ggml's block_*) --------

void decode_q4_0(const uint8_t* p, int8_t* q, float* s, float* o, bool with_min) {
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

void decode_q5_0(const uint8_t* p, int8_t* q, float* s, float* o, bool with_min) {
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

void decode_q8_0(const uint8_t* p, int8_t* q, float* s, float* o) {
  std::memcpy(q, p + 2, 32);
  s[0] = s[1] = half_to_float(p);
  o[0] = o[1] = 0.f;
}

void decode_q2_k(const uint8_t* p, int8_t* q, float* s, float* o) {
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

void decode_q3_k(const uint8_t* p, int8_t* q, float* s, float* o) {
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
void scales_k4(const uint8_t* p, float* s, float* o) {
  const float d = half_to_float(p), dmin = half_to_float(p + 2);
  const uint8_t* sc = p + 4;
  for (int j = 0; j < 8; ++j) {
    const int scale = j < 4 ? sc[j] & 63 : (sc[j + 4] & 0x0F) | ((sc[j - 4] >> 6) << 4);
    const int min = j < 4 ? sc[j + 4] & 63 : (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
    s[2 * j] = s[2 * j + 1] = d * static_cast<float>(scale);
    o[2 * j] = o[2 * j + 1] = -(dmin * static_cast<float>(min));
  }
}

void decode_q4_k(const uint8_t* p, int8_t* q, float* s, float* o) {
  scales_k4(p, s, o);
  const uint8_t* qs = p + 16;
  for (int j = 0; j < 4; ++j)
    for (int l = 0; l < 32; ++l) {
      q[64 * j + l] = static_cast<int8_t>(qs[32 * j + l] & 0x0F);
      q[64 * j + 32 + l] = static_cast<int8_t>(qs[32 * j + l] >> 4);
    }
}

void decode_q5_k(const uint8_t* p, int8_t* q, float* s, float* o) {
  scales_k4(p, s, o);
  const uint8_t *qh = p + 16, *qs = p + 48;
  for (int j = 0; j < 4; ++j)
    for (int l = 0; l < 32; ++l) {
      q[64 * j + l] = static_cast<int8_t>((qs[32 * j + l] & 0x0F) | ((qh[l] >> (2 * j)) & 1) << 4);
      q[64 * j + 32 + l] = static_cast<int8_t>((qs[32 * j + l] >> 4) | ((qh[l] >> (2 * j + 1)) & 1) << 4);
    }
}

void decode_q6_k(const uint8_t* p, int8_t* q, float* s, float* o) {
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
int64_t decode_unit(int64_t type, const uint8_t* row, int64_t u, int64_t k, int8_t* q, float* s, float* o) {
  const Layout l = layout(type);
  if (l.block == kUnit) {
    const uint8_t* p = row + u * l.bytes;
    switch (type) {
      case kQ2_K: decode_q2_k(p, q, s, o); break;
      case kQ3_K: decode_q3_k(p, q, s, o); break;
      case kQ4_K: decode_q4_k(p, q, s, o); break;
      case kQ5_K: decode_q5_k(p, q, s, o); break;
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
      default: decode_q8_0(p, qb, sb, ob); break;
    }
  }
  return len;
}

// -- a tile of 16 columns x 256 inputs, decoded for the integer dot products -------------------------------

struct Tile {
  alignas(64) uint8_t q[kUnit * kCols];  // code + 128, [input / 4][column][input % 4]
  alignas(64) float s[kGroups][kCols];
  alignas(64) float o[kGroups][kCols];
  int64_t len;
};

// Column c's blocks of unit u (t.len inputs) from a tiled weight's tile, as the file stores them.
void untile_unit(int64_t type, const uint8_t* tile, int64_t u, int64_t c, int64_t len, uint8_t* out) {
  const Layout l = layout(type);
  const int64_t dwords = padded_bytes(type) / 4, per_unit = kUnit / l.block;
  uint8_t padded[kUnit];
  for (int64_t b = 0; b < len / l.block; ++b) {
    for (int64_t i = 0; i < dwords; ++i)
      std::memcpy(padded + 4 * i, tile + (((u * per_unit + b) * dwords + i) * kCols + c) * 4, 4);
    const int64_t at = pad_at(type);  // the bytes before the padding, then those past it
    std::memcpy(out + b * l.bytes, padded, at);
    std::memcpy(out + b * l.bytes + at, padded + at + padded_bytes(type) - l.bytes, l.bytes - at);
  }
}

// Columns [0, cols) of the tile from their rows (a tiled weight: from its tile's blocks, put back together);
// the others multiply as zero.
void decode_tile(int64_t type, bool tiled, const uint8_t* rows, int64_t row_bytes, int64_t cols, int64_t u, int64_t k,
                 Tile& t) {
  alignas(64) int8_t q[kUnit];
  float s[kGroups], o[kGroups];
  uint8_t block[kUnitBytes];
  t.len = std::min(kUnit, k - u * kUnit);
  for (int64_t c = 0; c < kCols; ++c) {
    if (tiled) {
      untile_unit(type, rows, u, c, t.len, block);
      decode_unit(type, block, 0, t.len, q, s, o);
    } else if (c < cols) {
      decode_unit(type, rows + c * row_bytes, u, k, q, s, o);
    } else {
      std::memset(q, 0, sizeof(q));
      std::fill(s, s + kGroups, 0.f);
      std::fill(o, o + kGroups, 0.f);
    }
    for (int64_t i = 0; i < t.len / 4; ++i) {
      uint32_t word;
      std::memcpy(&word, q + 4 * i, 4);
      word ^= 0x80808080u;
      std::memcpy(t.q + (i * kCols + c) * 4, &word, 4);
    }
    for (int64_t g = 0; g < t.len / kGroup; ++g) {
      t.s[g][c] = s[g];
      t.o[g][c] = o[g];
    }
  }
}

// Activations quantized per block of 32, with each row's sums of its int8 values per group of 16.
struct Activations {
  const QuantizedRows& a;
  std::vector<int32_t> sum16;  // [row][k / 16]
  int64_t groups;
  float d(int64_t r, int64_t g) const { return a.d[r * a.blocks + g / 2]; }
  int32_t sum(int64_t r, int64_t g) const { return sum16[r * groups + g]; }
};

// acc[r][c] for rows [r0, r0 + mr) += the tile (unit u) times the rows, portable C++.
void rows_scalar(const Tile& t, const Activations& x, int64_t u, int64_t r0, int64_t mr, float* acc) {
  for (int64_t r = 0; r < mr; ++r) {
    const int8_t* xr = x.a.row(r0 + r) + u * kUnit;
    for (int64_t g = 0; g < t.len / kGroup; ++g) {
      const int64_t ga = u * kGroups + g;
      const float ad = x.d(r0 + r, ga), e = ad * static_cast<float>(x.sum(r0 + r, ga));
      for (int64_t c = 0; c < kCols; ++c) {
        int32_t dot = 0;
        for (int64_t i = 0; i < kGroup; ++i)
          dot += (static_cast<int32_t>(t.q[((g * 4 + i / 4) * kCols + c) * 4 + i % 4]) - 128) * xr[g * kGroup + i];
        acc[r * kCols + c] += t.s[g][c] * ad * static_cast<float>(dot) + t.o[g][c] * e;
      }
    }
  }
}

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
// AVX2: 8 columns a register. vpmaddubsw wants unsigned x signed: |q| times x with q's sign (|q| <= 128,
// |x| <= 127: a pair's sum stays within int16).
void rows_avx2(const Tile& t, const Activations& x, int64_t u, int64_t r0, int64_t mr, float* acc) {
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
  for (int64_t r = 0; r < mr; ++r) {
    const int8_t* xr = x.a.row(r0 + r) + u * kUnit;
    __m256 out[2] = {_mm256_loadu_ps(acc + r * kCols), _mm256_loadu_ps(acc + r * kCols + 8)};
    for (int64_t g = 0; g < t.len / kGroup; ++g) {
      const int64_t ga = u * kGroups + g;
      const float ad = x.d(r0 + r, ga), e = ad * static_cast<float>(x.sum(r0 + r, ga));
      for (int h = 0; h < 2; ++h) {
        __m256i dot = _mm256_setzero_si256();
        for (int j = 0; j < 4; ++j) {
          const __m256i v = _mm256_load_si256(reinterpret_cast<const __m256i*>(t.q + (g * 4 + j) * 64 + h * 32));
          const __m256i q = _mm256_xor_si256(v, flip), xb = _mm256_set1_epi32(load_i32(xr + g * kGroup + 4 * j));
          const __m256i prod = _mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(xb, q));
          dot = _mm256_add_epi32(dot, _mm256_madd_epi16(prod, ones));
        }
        const __m256 s = _mm256_mul_ps(_mm256_load_ps(t.s[g] + 8 * h), _mm256_set1_ps(ad));
        out[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), s, out[h]);
        out[h] = _mm256_fmadd_ps(_mm256_load_ps(t.o[g] + 8 * h), _mm256_set1_ps(e), out[h]);
      }
    }
    _mm256_storeu_ps(acc + r * kCols, out[0]);
    _mm256_storeu_ps(acc + r * kCols + 8, out[1]);
  }
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// AVX-512 VNNI: one vpdpbusd is 16 columns x 4 inputs of (q + 128) * a; 128 * sum(a) is taken back off.
template <int MR>
void rows_avx512(const Tile& t, const Activations& x, int64_t u, int64_t r0, float* acc) {
  __m512 out[MR];
  for (int r = 0; r < MR; ++r) out[r] = _mm512_loadu_ps(acc + r * kCols);
  for (int64_t g = 0; g < t.len / kGroup; ++g) {
    const int64_t ga = u * kGroups + g;
    __m512i w[4];
    for (int j = 0; j < 4; ++j) w[j] = _mm512_load_si512(t.q + (g * 4 + j) * 64);
    const __m512 s = _mm512_load_ps(t.s[g]), o = _mm512_load_ps(t.o[g]);
    for (int r = 0; r < MR; ++r) {
      const int8_t* xr = x.a.row(r0 + r) + u * kUnit + g * kGroup;
      const int32_t sum = x.sum(r0 + r, ga);
      __m512i dot = _mm512_set1_epi32(-128 * sum);
      for (int j = 0; j < 4; ++j) dot = _mm512_dpbusd_epi32(dot, w[j], _mm512_set1_epi32(load_i32(xr + 4 * j)));
      const float ad = x.d(r0 + r, ga);
      out[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(s, _mm512_set1_ps(ad)), out[r]);
      out[r] = _mm512_fmadd_ps(o, _mm512_set1_ps(ad * static_cast<float>(sum)), out[r]);
    }
  }
  for (int r = 0; r < MR; ++r) _mm512_storeu_ps(acc + r * kCols, out[r]);
}

void rows_avx512_any(const Tile& t, const Activations& x, int64_t u, int64_t r0, int64_t mr, float* acc) {
  using Kernel = void (*)(const Tile&, const Activations&, int64_t, int64_t, float*);
  static constexpr Kernel by_rows[] = {rows_avx512<1>, rows_avx512<2>, rows_avx512<3>, rows_avx512<4>};
  constexpr int64_t most = sizeof(by_rows) / sizeof(by_rows[0]);
  for (int64_t r = 0; r < mr; r += most) by_rows[std::min(most, mr - r) - 1](t, x, u, r0 + r, acc + r * kCols);
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
  static constexpr bool kOffset = true;
  static constexpr int64_t kBlock = 256, kStride = 144;
  template <class Src>
  static void scales(const Src& g, const uint8_t* p, int64_t, Groups s, Groups o) {
    const __m512i head = g.at(p), s0 = g.at(p + 4), s1 = g.at(p + 8), s2 = g.at(p + 12);
    const __m512 d = half_lanes(head, 0), dmin = half_lanes(head, 16);
    const __m512i m6 = _mm512_set1_epi32(63), m4 = _mm512_set1_epi32(0x0F);
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
  static __m512i codes(const Src& g, const uint8_t* p, int c) {
    return low_nibbles(g.at(p + 16 + 32 * (c >> 4) + 4 * (c & 7)), c & 8);
  }
};

// Q5_K: Q4_K's scales, a fifth bit per input from qh.
struct Q5K : Q4K {
  static constexpr int64_t kStride = 176;
  template <class Src>
  static __m512i codes(const Src& g, const uint8_t* p, int c) {
    const int j = c >> 4, hi = (c >> 3) & 1, i = c & 7;
    const __m512i v = low_nibbles(g.at(p + 48 + 32 * j + 4 * i), hi);
    return _mm512_or_si512(v, byte_bit(g.at(p + 16 + 4 * i), 2 * j + hi, 4));
  }
};

struct Q6K {
  static constexpr int kBias = 32;
  static constexpr bool kOffset = false;
  static constexpr int64_t kBlock = 256, kStride = 210;
  template <class Src>
  static void scales(const Src& g, const uint8_t* p, int64_t, Groups s, Groups o) {
    // bytes 208..209, the last of the block: a gather reads the dword that ends there, a tile has it padded
    const __m512 d = Src::kTiled ? half_lanes(g.at(p + 208), 0) : half_lanes(g.at(p + 206), 16);
    for (int i = 0; i < 4; ++i) {
      const __m512i v = g.at(p + 192 + 4 * i);
      for (int b = 0; b < 4; ++b) {
        const __m512i sc = _mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * b), 24);
        _mm512_store_ps(s[4 * i + b], _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc)));
        _mm512_store_ps(o[4 * i + b], _mm512_setzero_ps());
      }
    }
  }
  template <class Src>
  static __m512i codes(const Src& g, const uint8_t* p, int c) {
    const int h = c >> 5, hi = (c >> 4) & 1, l = c & 15;
    const __m512i lo = low_nibbles(g.at(p + 64 * h + 4 * l), hi);
    const __m512i qh = _mm512_srli_epi16(g.at(p + 128 + 32 * h + 4 * (l & 7)), 2 * (l >> 3) + 4 * hi);
    return _mm512_or_si512(lo, _mm512_slli_epi16(_mm512_and_si512(qh, _mm512_set1_epi8(3)), 4));
  }
};

struct Q3K {
  static constexpr int kBias = 4;
  static constexpr bool kOffset = false;
  static constexpr int64_t kBlock = 256, kStride = 110;
  template <class Src>
  static void scales(const Src& g, const uint8_t* p, int64_t, Groups s, Groups o) {
    const __m512 d = Src::kTiled ? half_lanes(g.at(p + 108), 0) : half_lanes(g.at(p + 106), 16);
    const __m512i sc[3] = {g.at(p + 96), g.at(p + 100), g.at(p + 104)};
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
  static __m512i codes(const Src& g, const uint8_t* p, int c) {
    const int h = c >> 5, t = (c >> 3) & 3, i = c & 7;
    const __m512i low = _mm512_and_si512(_mm512_srli_epi16(g.at(p + 32 + 32 * h + 4 * i), 2 * t), _mm512_set1_epi8(3));
    return _mm512_or_si512(low, byte_bit(g.at(p + 4 * i), 4 * h + t, 2));
  }
};

struct Q2K {
  static constexpr int kBias = 0;
  static constexpr bool kOffset = true;
  static constexpr int64_t kBlock = 256, kStride = 84;
  template <class Src>
  static void scales(const Src& g, const uint8_t* p, int64_t, Groups s, Groups o) {
    const __m512i head = g.at(p + 80);
    const __m512 d = half_lanes(head, 0), dmin = half_lanes(head, 16);
    for (int i = 0; i < 4; ++i) {
      const __m512i v = g.at(p + 4 * i);
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
  static __m512i codes(const Src& g, const uint8_t* p, int c) {
    const int h = c >> 5, t = (c >> 3) & 3, i = c & 7;
    return _mm512_and_si512(_mm512_srli_epi16(g.at(p + 16 + 32 * h + 4 * i), 2 * t), _mm512_set1_epi8(3));
  }
};

// Blocks of 32 with a 16-bit fifth bit mask (Q5_0: scale, qh, qs; Q5_1: scale, min, qh, qs). A tiled Q5_0 block
// is padded to 24 bytes after its scale, so that qh and qs start on whole dwords, as Q5_1's do.
template <bool kMin>
struct Q5Blocks {
  static constexpr int kBias = kMin ? 0 : 16;
  static constexpr bool kOffset = kMin;
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
  static __m512i codes(const Src& g, const uint8_t* p, int c) {
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
  static constexpr bool kOffset = false;
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
  static __m512i codes(const Src& g, const uint8_t* p, int c) {
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
  for (int c = 0; c < t.len / 4; ++c) _mm512_store_si512(t.q + c * 64, _mm512_add_epi8(D::codes(src, p, c), bias));
}

// The columns' source (loads from a tile, or gathers from rows) for units starting at p, and p.
template <class Src>
struct Source {
  Src src;
  const uint8_t* p;
};

Source<TileLoads> tile_source(const uint8_t* tile) { return {TileLoads{tile}, tile}; }

Source<Gather> row_source(const uint8_t* rows, int64_t row_bytes, int64_t cols) {
  const __m512i idx = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                         _mm512_set1_epi32(static_cast<int32_t>(row_bytes)));
  return {Gather{idx, static_cast<__mmask16>((1u << cols) - 1)}, rows};
}

// Decoded in registers and multiplied at once, for up to 8 rows a pass: per group of 16 the same integer dot
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
    if constexpr (Src::kTiled) src = TileLoads{p};
    D::scales(src, p, len, s, o);
    for (int64_t g = 0; g < len / kGroup; ++g) {
      __m512i w[4];
      for (int j = 0; j < 4; ++j) w[j] = D::codes(src, p, static_cast<int>(4 * g + j));
      const __m512 sg = _mm512_load_ps(s[g]);
      const int64_t ga = u * kGroups + g;
      for (int r = 0; r < MR; ++r) {
        const int8_t* xr = x.a.row(r0 + r) + ga * kGroup;
        const int32_t sum = x.sum(r0 + r, ga);
        __m512i dot = _mm512_set1_epi32(-D::kBias * sum);
        for (int j = 0; j < 4; ++j) dot = _mm512_dpbusd_epi32(dot, w[j], _mm512_set1_epi32(load_i32(xr + 4 * j)));
        const float ad = x.d(r0 + r, ga);
        out[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(sg, _mm512_set1_ps(ad)), out[r]);
        if constexpr (D::kOffset)
          out[r] = _mm512_fmadd_ps(_mm512_load_ps(o[g]), _mm512_set1_ps(ad * static_cast<float>(sum)), out[r]);
      }
    }
  }
  for (int r = 0; r < MR; ++r) _mm512_storeu_ps(acc + r * kCols, out[r]);
}

constexpr int64_t kFusedRows = 8;   // rows multiplied per pass over the weight in registers
constexpr int64_t kFusedMost = 16;  // up to this many rows decode in registers, more decode a tile once

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
  switch (type) {
    case kQ2_K: f(Q2K{}); return true;
    case kQ3_K: f(Q3K{}); return true;
    case kQ4_K: f(Q4K{}); return true;
    case kQ5_K: f(Q5K{}); return true;
    case kQ6_K: f(Q6K{}); return true;
    case kQ5_0: f(Q5Blocks<false>{}); return true;
    case kQ5_1: f(Q5Blocks<true>{}); return true;
    case kQ8_0: f(Q80{}); return true;
    default: return false;
  }
}

// The columns' unit u into the tile; false leaves the type to decode_tile. A tiled weight's `rows` is its
// tile's run of blocks.
bool decode_tile_avx512(int64_t type, bool tiled, const uint8_t* rows, int64_t row_bytes, int64_t cols, int64_t u,
                        int64_t k, Tile& t) {
  t.len = std::min(kUnit, k - u * kUnit);
  return with_decoder(type, [&](auto d) {
    using D = decltype(d);
    if (tiled) {
      const uint8_t* p = rows + u * unit_stride<D, TileLoads>() * kCols;
      decode_unit_avx512<D>(TileLoads{p}, p, t);
    } else {
      const Source<Gather> at = row_source(rows, row_bytes, cols);
      decode_unit_avx512<D>(at.src, rows + u * unit_stride<D, Gather>(), t);
    }
  });
}

// All of the tile's units times m <= kFusedMost rows into acc; false for a type without a decoder.
bool fused_tile(int64_t type, bool tiled, const uint8_t* rows, int64_t row_bytes, int64_t cols, int64_t k,
                const Activations& x, int64_t m, float* acc) {
  return with_decoder(type, [&](auto d) {
    using D = decltype(d);
    if (tiled) fused_any<D>(tile_source(rows), k, x, m, acc);
    else fused_any<D>(row_source(rows, row_bytes, cols), k, x, m, acc);
  });
}
#endif

// The SIMD decoders built here for this type (AVX-512); false when there is none.
bool decode_tile_fast(int64_t type, bool tiled, const uint8_t* rows, int64_t row_bytes, int64_t cols, int64_t u,
                      int64_t k, Tile& t) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  return decode_tile_avx512(type, tiled, rows, row_bytes, cols, u, k, t);
#else
  return false;
#endif
}

// The whole tile times the m rows decoded in registers (AVX-512, up to 16 rows); false leaves it to the tile path.
bool fused_tile_fast(int64_t type, bool tiled, const uint8_t* rows, int64_t row_bytes, int64_t cols, int64_t k,
                     const Activations& x, int64_t m, float* acc) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  return m <= kFusedMost && fused_tile(type, tiled, rows, row_bytes, cols, k, x, m, acc);
#else
  return false;
#endif
}

void tile_rows(int64_t isa, const Tile& t, const Activations& x, int64_t u, int64_t m, float* acc) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  if (isa == kAvx512Vnni) return rows_avx512_any(t, x, u, 0, m, acc);
#endif
#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
  if (isa == kAvx2) return rows_avx2(t, x, u, 0, m, acc);
#endif
  rows_scalar(t, x, u, 0, m, acc);
}

void sums_of_16(const QuantizedRows& a, int64_t k, std::vector<int32_t>& out) {
  const int64_t groups = k / kGroup;
  out.resize(a.rows * groups);
  for (int64_t r = 0; r < a.rows; ++r) {
    const int8_t* q = a.row(r);
    for (int64_t g = 0; g < groups; ++g) {
      int32_t s = 0;
      for (int64_t i = 0; i < kGroup; ++i) s += q[g * kGroup + i];
      out[r * groups + g] = s;
    }
  }
}

void check_weight(const at::Tensor& w, int64_t type, int64_t k) {
  const Layout l = layout(type);
  TORCH_CHECK(l.block > 0, "GGUF type id ", type, " is not one kgemm decodes");
  TORCH_CHECK(k % l.block == 0, "rows of ", k, " inputs are not whole blocks of ", l.block);
  if (w.dim() == 3) {  // tiled
    TORCH_CHECK(tiles(type), "GGUF type id ", type, " is not tiled");
    TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && w.device().is_cpu() &&
                    w.size(1) == k / l.block && w.size(2) == padded_bytes(type) * kCols,
                "a tiled weight must be a contiguous uint8 [tiles, ", k / l.block, ", ", padded_bytes(type) * kCols,
                "] CPU tensor");
    return;
  }
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous() && w.device().is_cpu(),
              "a GGUF weight must be a contiguous uint8 [n, row bytes] CPU tensor");
  TORCH_CHECK(w.size(1) == k / l.block * l.bytes, "rows of ", w.size(1), " bytes, ", k, " inputs of type id ",
              type, " take ", k / l.block * l.bytes);
}

}  // namespace

// x [M, K] (float32/bfloat16/float16) times the weights `ws` (GGUF types `types`, each [n_i, row bytes])
// stacked by rows -> [M, sum n_i] in x's dtype.
at::Tensor kgemm(const at::Tensor& x, at::TensorList ws, at::IntArrayRef types, at::IntArrayRef ns, int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.device().is_cpu(), "x must be a 2-D CPU tensor, rows contiguous");
  TORCH_CHECK(ws.size() == types.size() && ws.size() == ns.size() && !ws.empty(), "one type and row count per weight");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(k % kBlock == 0, "x's rows of ", k, " inputs are not whole blocks of ", kBlock);
  std::vector<int64_t> first_tile{0}, first_col{0};
  for (size_t i = 0; i < ws.size(); ++i) {
    check_weight(ws[i], types[i], k);
    const int64_t tiles = (ns[i] + kCols - 1) / kCols;
    TORCH_CHECK(ws[i].dim() == 3 ? ws[i].size(0) == tiles : ws[i].size(0) == ns[i], "weight ", i, " does not hold ",
                ns[i], " rows");
    first_tile.push_back(first_tile.back() + tiles);
    first_col.push_back(first_col.back() + ns[i]);
  }
  if (isa == kAuto) isa = best_isa();
  TORCH_CHECK(isa >= kScalar && isa <= best_isa(), "isa ", isa, " is not built for this machine (best: ", best_isa(),
              ")");
  const int64_t n = first_col.back();
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0 || n == 0 || k == 0) return out;
  thread_local QuantizedRows buffer;
  QuantizedRows& a = buffer;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "kgemm",
                                  [&] { quantize_rows(x.data_ptr<scalar_t>(), x.stride(0), m, k, a); });
  Activations act{a, {}, k / kGroup};
  sums_of_16(a, k, act.sum16);
  const int64_t units = (k + kUnit - 1) / kUnit;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "kgemm", [&] {
    scalar_t* op = out.data_ptr<scalar_t>();
    iterserve::parallel_chunks(first_tile.back(), 4, [&](int64_t begin, int64_t end) {
      Tile tile;
      std::vector<float> acc(m * kCols);
      for (int64_t t = begin; t < end; ++t) {
        const int64_t part = std::upper_bound(first_tile.begin(), first_tile.end(), t) - first_tile.begin() - 1;
        const at::Tensor& w = ws[part];
        const bool tiled = w.dim() == 3;
        const int64_t col = (t - first_tile[part]) * kCols, cols = std::min(kCols, ns[part] - col);
        const int64_t row_bytes = tiled ? 0 : w.size(1);
        const uint8_t* rows = w.data_ptr<uint8_t>() + (tiled ? col / kCols * w.size(1) * w.size(2) : col * row_bytes);
        std::fill(acc.begin(), acc.end(), 0.f);
        const bool fused = isa == kAvx512Vnni && fused_tile_fast(types[part], tiled, rows, row_bytes, cols, k, act, m,
                                                                 acc.data());
        for (int64_t u = 0; u < units && !fused; ++u) {
          if (!(isa == kAvx512Vnni && decode_tile_fast(types[part], tiled, rows, row_bytes, cols, u, k, tile)))
            decode_tile(types[part], tiled, rows, row_bytes, cols, u, k, tile);
          tile_rows(isa, tile, act, u, m, acc.data());
        }
        for (int64_t r = 0; r < m; ++r)
          for (int64_t c = 0; c < cols; ++c)
            op[r * n + first_col[part] + col + c] = static_cast<scalar_t>(acc[r * kCols + c]);
      }
    });
  });
  return out;
}

namespace {

// Rows `ids` of a GGUF weight of type `type` as `dtype` values, [*ids.shape, k]: gguf's dequantized values exactly
// (an embedding lookup reads only those rows). The weight is [n, row bytes], or tiled (3-D) with `rows` rows.
at::Tensor krows(const at::Tensor& w, int64_t type, const at::Tensor& ids, int64_t k, at::ScalarType dtype,
                 int64_t rows) {
  check_weight(w, type, k);
  const bool tiled = w.dim() == 3;
  TORCH_CHECK(!tiled || (rows >= 0 && rows <= w.size(0) * kCols), "a tiled weight's lookup needs its row count");
  const int64_t n = tiled ? rows : w.size(0);
  const at::Tensor flat = ids.to(at::kLong).contiguous().view(-1);
  const int64_t* id = flat.data_ptr<int64_t>();
  for (int64_t i = 0; i < flat.numel(); ++i)
    TORCH_CHECK(id[i] >= 0 && id[i] < n, "row ", id[i], " is outside a weight of ", n, " rows");
  std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
  shape.push_back(k);
  at::Tensor out = at::empty(shape, w.options().dtype(dtype));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t units = (k + kUnit - 1) / kUnit, tile_bytes = tiled ? w.size(1) * w.size(2) : 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "krows", [&] {
    scalar_t* op = out.data_ptr<scalar_t>();
    iterserve::parallel_chunks(flat.numel(), 16, [&](int64_t begin, int64_t end) {
      int8_t q[kUnit];
      float s[kGroups], o[kGroups];
      uint8_t block[kUnitBytes];
      for (int64_t r = begin; r < end; ++r) {
        for (int64_t u = 0; u < units; ++u) {
          int64_t len;
          if (tiled) {  // the row's blocks of this unit put back together, then decoded as a row of them
            len = std::min(kUnit, k - u * kUnit);
            untile_unit(type, wp + id[r] / kCols * tile_bytes, u, id[r] % kCols, len, block);
            decode_unit(type, block, 0, len, q, s, o);
          } else {
            len = decode_unit(type, wp + id[r] * w.size(1), u, k, q, s, o);
          }
          scalar_t* dst = op + r * k + u * kUnit;
          for (int64_t i = 0; i < len; ++i)
            dst[i] = static_cast<scalar_t>(s[i / kGroup] * static_cast<float>(q[i]) + o[i / kGroup]);
        }
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(iterserve_quant, m) {
  m.def("kgemm(Tensor x, Tensor[] w, int[] types, int[] n, int isa=0) -> Tensor");
  m.def("krows(Tensor w, int type, Tensor ids, int k, ScalarType dtype, int rows=-1) -> Tensor");
}

TORCH_LIBRARY_IMPL(iterserve_quant, CPU, m) {
  m.impl("kgemm", &kgemm);
  m.impl("krows", &krows);
}
