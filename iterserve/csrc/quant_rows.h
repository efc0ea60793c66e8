// Activations quantized to int8 per row and block of 32, shared by the block kernels (quant_ops.cpp) and the
// GGUF super-block kernels (kquant_ops.cpp).
#pragma once

#include <torch/extension.h>

#include <c10/util/Half.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "parallel.h"

namespace iterserve_quant {

constexpr int64_t kBlock = 32;  // inputs per quantization block

enum Isa : int64_t { kAuto = 0, kScalar = 1, kAvx2 = 2, kAvx512Vnni = 3 };

inline int64_t best_isa() {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  return kAvx512Vnni;
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
  return kAvx2;
#else
  return kScalar;
#endif
}


// Activations quantized to int8 per row and block, with per-block a_d and a_d * sum(a).
struct QuantizedRows {
  int64_t rows, blocks;
  std::vector<int8_t> q;
  std::vector<float> d, e;
  std::vector<int32_t> sum;
  const int8_t* row(int64_t r) const { return q.data() + r * blocks * kBlock; }
};

// One block of 32 floats to int8 with scale max|x| / 127 (round half to even); returns the sum of the
// quants and stores the scale in *d.
inline int32_t quantize_block(const float* x, int8_t* q, float* d) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  const __m512 lo = _mm512_loadu_ps(x), hi = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
  const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv)), qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(qlo));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(qhi));
  *d = amax / 127.f;
  return _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
#else
  float amax = 0.f;
  for (int64_t i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  int32_t s = 0;
  for (int64_t i = 0; i < kBlock; ++i) {
    q[i] = static_cast<int8_t>(std::nearbyint(x[i] * inv));
    s += q[i];
  }
  *d = amax / 127.f;
  return s;
#endif
}

template <typename T>
void quantize_rows(const T* x, int64_t ldx, int64_t rows, int64_t k, QuantizedRows& out) {
  out.rows = rows;
  out.blocks = (k + kBlock - 1) / kBlock;
  out.q.resize(rows * out.blocks * kBlock);
  out.d.resize(rows * out.blocks);
  out.e.resize(rows * out.blocks);
  out.sum.resize(rows * out.blocks);
  // Rows are read straight from x when they are float32 and whole blocks; otherwise through a buffer
  // (converted, and the ragged last block padded with zeros).
  const bool direct = std::is_same_v<T, float> && k % kBlock == 0;
  iterserve::parallel_chunks(rows, 32, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(direct ? 0 : out.blocks * kBlock, 0.f);
    for (int64_t r = begin; r < end; ++r) {
      const float* src;
      if constexpr (std::is_same_v<T, float>) src = x + r * ldx;
      if (!direct) {
        for (int64_t i = 0; i < k; ++i) buf[i] = static_cast<float>(x[r * ldx + i]);
        src = buf.data();
      }
      for (int64_t b = 0; b < out.blocks; ++b) {
        const int64_t ab = r * out.blocks + b;
        const int32_t s = quantize_block(src + b * kBlock, out.q.data() + ab * kBlock, &out.d[ab]);
        out.e[ab] = out.d[ab] * static_cast<float>(s);
        out.sum[ab] = s;
      }
    }
  });
}

inline float half_to_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(bits);
}

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

}  // namespace iterserve_quant
