// What the GGUF matmul's kernels share (kquant_ops.cpp, kquant_avx512.h): the tile shape, ggml's type ids, a
// decoded tile and the quantized activations.
#pragma once

#include "quant_rows.h"

namespace iterserve_kquant {

using namespace iterserve_quant;

constexpr int64_t kCols = 16;   // output columns per tile
constexpr int64_t kUnit = 256;  // inputs decoded at once: one K-quant super-block, or 8 blocks of 32
constexpr int64_t kGroup = 16;  // inputs sharing one scale and offset once decoded
constexpr int64_t kGroups = kUnit / kGroup;
constexpr int64_t kUnitBytes = 8 * 34;  // the most bytes of one row's unit: 8 Q8_0 blocks

// ggml's type ids (gguf.GGMLQuantizationType), which Python passes.
enum Type : int64_t {
  kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ2_K = 10, kQ3_K = 11, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14,
  kIQ4_NL = 20, kIQ4_XS = 23
};

// IQ4_NL and IQ4_XS: each 4-bit code indexes this table of int8 values (ggml's kvalues_iq4nl).
alignas(16) constexpr int8_t kIq4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                               1,    13,   25,  38,  53,  69,  89,  113};

// Calls f with the decoder (a default-constructed tag) that a vector width's set (kquant_avx2.h, kquant_avx512.h)
// has for `type`; false for a type without one.
template <class Q2K, class Q3K, class Q4K, class Q5K, class Q6K, class Q50, class Q51, class Q80, class F>
bool decoder_of(int64_t type, const F& f) {
  switch (type) {
    case kQ2_K: f(Q2K{}); return true;
    case kQ3_K: f(Q3K{}); return true;
    case kQ4_K: f(Q4K{}); return true;
    case kQ5_K: f(Q5K{}); return true;
    case kQ6_K: f(Q6K{}); return true;
    case kQ5_0: f(Q50{}); return true;
    case kQ5_1: f(Q51{}); return true;
    case kQ8_0: f(Q80{}); return true;
    default: return false;
  }
}

// A tiled unit's decoders read its bytes out of order (scales first), which the hardware prefetcher does not
// follow: the unit kPrefetchUnits past the one at p (units of `bytes`) is asked for by hand, into L2.
constexpr int64_t kPrefetchUnits = 2;
inline void prefetch_ahead(const uint8_t* p, int64_t bytes) {
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(p + kPrefetchUnits * bytes + i, 0, 2);
}

struct Tile {
  alignas(64) uint8_t q[kUnit * kCols];  // code + 128, [input / 4][column][input % 4]
  alignas(64) float s[kGroups][kCols];
  alignas(64) float o[kGroups][kCols];
  // AVX2's Q4_K / Q5_K: each 32-block's 6-bit scale in both halves of an int32 and the super-block's d, in place
  // of s; int_scales says which the decoder that filled the tile wrote
  alignas(64) int32_t sc[kGroups / 2][kCols];
  alignas(64) float d[kCols];
  bool int_scales = false;
  int64_t len;
};

// Activations quantized per block of 32, with each row's sums of its int8 values per group of 16. Not per 256 as
// llama.cpp's K-quant dots take them: one scale a super-block saves float steps, but an outlier coarsens 256 inputs.
struct Activations {
  const QuantizedRows& a;
  std::vector<int32_t> sum16;  // [row][k / 16]
  int64_t groups;
  float d(int64_t r, int64_t g) const { return a.d[r * a.blocks + g / 2]; }
  float e(int64_t r, int64_t g) const { return a.e[r * a.blocks + g / 2]; }  // a_d * sum(a) of g's 32-block
  int32_t sum(int64_t r, int64_t g) const { return sum16[r * groups + g]; }
};

}  // namespace iterserve_kquant
