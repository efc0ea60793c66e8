// The quantized KV cache (kv_cache_dtype fp8_e4m3, fp8_e5m2, int8; iterserve/config/kv_cache.py): the store
// that quantizes this step's K/V into their slots, and paged decode attention that reads the one-byte blocks in
// place, in the bf16 kernel's fixed 128-key pieces (attention.cpp's paged_decode: a row's sums run in one order
// whatever the batch). The stored bytes match iterserve/attention/kv_quant.py's quantize exactly (same clamps,
// same round-to-nearest-even).
//
// Three paths, the widest that `isa` allows (tests force each): isa 1 (and a head_dim not a multiple of 64) widens
// each tile of rows to float32 in L1; isa 2-3 (AVX2, AVX-512) widen in registers and score in float32; isa 4
// (AVX512-BF16 + VBMI, a bf16 query) takes the bf16 cache's arithmetic: each 64 stored bytes become 64 exact bf16
// values in registers (two byte-table lookups; every float8 and int8 value is exact in bf16), dotted with the
// query by vdpbf16ps (exact products, float32 sums) and weighed by the softmax weights rounded to bf16 two keys at
// a time, as attention_bf16.h's group_values_pairs.
//
// Widening to float32: e5m2 is the top byte of a float16 (x << 8); e4m3 becomes a float16 as
// ((x & 0x80) << 8) | ((x & 0x7F) << 7) times 2^8 (the exponent biases differ by 8), exact for every finite
// value; int8 is cvtepi8 -> float x the row's float16 scale. AVX-512 widens 16 values at once, AVX2 + F16C 8,
// a 256-entry table the rest.
//
// This header holds what the store (kv_quant_write.cpp) and decode attention (kv_quant_decode.cpp) share: the
// kinds, the paths built, a row's widening and quantizing, and the check of a cache's pools.
#pragma once

#include <torch/library.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace iterserve_kv_quant {

enum Isa : int64_t { kAuto = 0, kScalar = 1, kAvx2 = 2, kAvx512 = 3, kAvx512Bf16 = 4 };
enum Kind : int { kE4m3 = 0, kE5m2 = 1, kInt8 = 2 };

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VBMI__) && defined(__AVX512F__) && \
    defined(__AVX2__)
#define KV_QUANT_DPBF16 1
#endif

inline int64_t best_isa() {
#if defined(KV_QUANT_DPBF16)
  return kAvx512Bf16;
#elif defined(__AVX512F__)
  return kAvx512;
#elif defined(__AVX2__) && defined(__F16C__)
  return kAvx2;
#else
  return kScalar;
#endif
}

inline Kind kind_of(const at::Tensor& cache) {
  switch (cache.scalar_type()) {
    case at::kFloat8_e4m3fn: return kE4m3;
    case at::kFloat8_e5m2: return kE5m2;
    case at::kChar: return kInt8;
    default: TORCH_CHECK(false, "a quantized KV cache holds float8_e4m3fn, float8_e5m2 or int8, not ",
                         cache.scalar_type());
  }
  return kInt8;
}

// Every byte's float value, per float8 kind (the scalar path's widening).
inline const float* fp8_table(Kind kind) {
  static const auto tables = [] {
    std::array<std::array<float, 256>, 2> t{};
    for (int b = 0; b < 256; ++b) {
      t[0][b] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(b), c10::Float8_e4m3fn::from_bits()));
      t[1][b] = static_cast<float>(c10::Float8_e5m2(static_cast<uint8_t>(b), c10::Float8_e5m2::from_bits()));
    }
    return t;
  }();
  return tables[kind].data();
}

#if defined(__AVX512F__)
// 16 stored bytes -> 16 floats.
inline __m512 widen16(const uint8_t* p, Kind kind, float scale) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if (kind == kInt8) return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)), _mm512_set1_ps(scale));
  const __m512i x = _mm512_cvtepu8_epi32(bytes);
  if (kind == kE5m2) return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_slli_epi32(x, 8)));
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x80)), 8);
  const __m512i rest = _mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x7F)), 7);
  const __m512 h = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_or_si512(sign, rest)));
  return _mm512_mul_ps(h, _mm512_set1_ps(256.f));
}
#endif

#if defined(__AVX2__) && defined(__F16C__)
// 8 stored bytes -> 8 floats.
inline __m256 widen8(const uint8_t* p, Kind kind, float scale) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  if (kind == kInt8) return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), _mm256_set1_ps(scale));
  const __m128i x = _mm_cvtepu8_epi16(bytes);  // 8 x 16 bits: the float16's bits are built in place
  if (kind == kE5m2) return _mm256_cvtph_ps(_mm_slli_epi16(x, 8));
  const __m128i sign = _mm_slli_epi16(_mm_and_si128(x, _mm_set1_epi16(0x80)), 8);
  const __m128i rest = _mm_slli_epi16(_mm_and_si128(x, _mm_set1_epi16(0x7F)), 7);
  return _mm256_mul_ps(_mm256_cvtph_ps(_mm_or_si128(sign, rest)), _mm256_set1_ps(256.f));
}
#endif

// n stored values of one row into dst as float32 (int8 times the row's scale), with the widest path `isa` allows.
inline void widen_row(int64_t isa, const uint8_t* src, float* dst, int64_t n, Kind kind, float scale) {
  int64_t i = 0;
#if defined(__AVX512F__)
  if (isa >= kAvx512)
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, widen16(src + i, kind, scale));
#endif
#if defined(__AVX2__) && defined(__F16C__)
  if (isa >= kAvx2)
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, widen8(src + i, kind, scale));
#endif
  if (kind == kInt8) {
    for (; i < n; ++i) dst[i] = static_cast<float>(static_cast<int8_t>(src[i])) * scale;
    return;
  }
  const float* table = fp8_table(kind);
  for (; i < n; ++i) dst[i] = table[src[i]];
}

// One stored byte of x (clamped to the float8 kind's finite range first, as kv_quant.quantize does).
inline uint8_t fp8_byte(float x, Kind kind) {
  if (kind == kE4m3) return c10::Float8_e4m3fn(std::min(std::max(x, -448.f), 448.f)).x;
  return c10::Float8_e5m2(std::min(std::max(x, -57344.f), 57344.f)).x;
}

// One row of head_dim floats quantized into dst; returns the int8 row's float16 scale (0 for float8).
inline c10::Half quantize_row(const float* x, int64_t n, Kind kind, uint8_t* dst) {
  if (kind != kInt8) {
    for (int64_t i = 0; i < n; ++i) dst[i] = fp8_byte(x[i], kind);
    return c10::Half(0.f);
  }
  float amax = 0.f;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  c10::Half scale(amax / 127.f);
  const c10::Half smallest(5.9604644775390625e-08f);  // 2^-24: an all-zero row divides by this, not by 0
  if (static_cast<float>(scale) < static_cast<float>(smallest)) scale = smallest;
  const float s = static_cast<float>(scale);
  for (int64_t i = 0; i < n; ++i) {
    const float q = std::min(std::max(std::nearbyint(x[i] / s), -127.f), 127.f);
    dst[i] = static_cast<uint8_t>(static_cast<int8_t>(q));
  }
  return scale;
}

inline void check_pools(const at::Tensor& k_cache, const at::Tensor& v_cache, const c10::optional<at::Tensor>& k_scale,
                 const c10::optional<at::Tensor>& v_scale, int64_t dim) {
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "K and V caches must both be [blocks, kv_heads, block_size, head_dim]");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1 && k_cache.size(3) == dim,
              "KV cache rows must be contiguous and head_dim long");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "K and V caches differ in dtype");
  const bool int8 = kind_of(k_cache) == kInt8;
  TORCH_CHECK(int8 == k_scale.has_value() && int8 == v_scale.has_value(), "an int8 KV cache (only) has scales");
  if (int8)
    for (const auto* sc : {&*k_scale, &*v_scale})
      TORCH_CHECK(sc->scalar_type() == at::kHalf && sc->is_contiguous() && sc->sizes() == k_cache.sizes().slice(0, 3),
                  "int8 KV scales must be contiguous float16 [blocks, kv_heads, block_size]");
}

inline int64_t pick_isa(int64_t isa) {
  if (isa == kAuto) return best_isa();
  TORCH_CHECK(isa >= kScalar && isa <= best_isa(), "isa ", isa, " is not built for this machine (best: ", best_isa(),
              ")");
  return isa;
}

}  // namespace iterserve_kv_quant
