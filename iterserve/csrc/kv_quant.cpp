// The quantized KV cache (kv_cache_dtype fp8_e4m3, fp8_e5m2, int8; iterserve/config/kv_cache.py): the store
// that quantizes this step's K/V into their slots, and paged decode attention that reads the one-byte blocks in
// place, in the bf16 kernel's fixed 128-key pieces (attention.cpp's paged_decode: a row's sums run in one order
// whatever the batch). The stored bytes match iterserve/attention/kv_quant.py's quantize exactly (same clamps,
// same round-to-nearest-even).
//
// Three paths, the widest that `isa` allows (tests force each): isa 1-2 widen each tile of rows to float32 in L1;
// isa 3 (AVX-512, head_dim % 64 == 0) widens in registers and scores in float32; isa 4 (AVX512-BF16 + VBMI, a
// bf16 query) takes the bf16 cache's arithmetic: each 64 stored bytes become 64 exact bf16 values in registers
// (two byte-table lookups; every float8 and int8 value is exact in bf16), dotted with the query by vdpbf16ps
// (exact products, float32 sums) and weighed by the softmax weights rounded to bf16 two keys at a time, as
// attention.cpp's group_values_pairs.
//
// Widening to float32: e5m2 is the top byte of a float16 (x << 8); e4m3 becomes a float16 as
// ((x & 0x80) << 8) | ((x & 0x7F) << 7) times 2^8 (the exponent biases differ by 8), exact for every finite
// value; int8 is cvtepi8 -> float x the row's float16 scale. AVX-512 widens 16 values at once, AVX2 + F16C 8,
// a 256-entry table the rest.

#include <torch/extension.h>

#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <ATen/cpu/vec/vec.h>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <limits>
#include <vector>

#include "parallel.h"

namespace {

enum Isa : int64_t { kAuto = 0, kScalar = 1, kAvx2 = 2, kAvx512 = 3, kAvx512Bf16 = 4 };
enum Kind : int { kE4m3 = 0, kE5m2 = 1, kInt8 = 2 };

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VBMI__) && defined(__AVX512F__) && \
    defined(__AVX2__)
#define KV_QUANT_DPBF16 1
#endif

int64_t best_isa() {
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

Kind kind_of(const at::Tensor& cache) {
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
const float* fp8_table(Kind kind) {
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
void widen_row(int64_t isa, const uint8_t* src, float* dst, int64_t n, Kind kind, float scale) {
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
c10::Half quantize_row(const float* x, int64_t n, Kind kind, uint8_t* dst) {
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

using Vec = at::vec::Vectorized<float>;

inline float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  Vec acc(0.f);
  for (; i + Vec::size() <= n; i += Vec::size()) acc = at::vec::fmadd(Vec::loadu(a + i), Vec::loadu(b + i), acc);
  float lanes[Vec::size()];
  acc.store(lanes);
  float s = 0.f;
  for (int64_t k = 0; k < Vec::size(); ++k) s += lanes[k];
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// The largest of p[0, n), one vector at a time and one reduction (as attention.cpp's max_of).
inline float max_of(const float* p, int64_t n) {
  Vec best(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) best = at::vec::maximum(best, Vec::loadu(p + i));
  float out = best.reduce_max();
  for (; i < n; ++i) out = std::max(out, p[i]);
  return out;
}

// p[i] = exp(p[i] - m) for i < n; returns the sum (exp_u20, as paged_decode's float path).
inline float exp_sum(float* p, float m, int64_t n) {
  const Vec vm(m);
  int64_t i = 0;
  float sum = 0.f;
  for (; i + Vec::size() <= n; i += Vec::size()) {
    const Vec e = (Vec::loadu(p + i) - vm).exp_u20();
    e.store(p + i);
    sum += e.reduce_add();
  }
  for (; i < n; ++i) sum += (p[i] = std::exp(p[i] - m));
  return sum;
}

#if defined(__AVX512F__)
// Lane j of the result is the sum of v[j]'s sixteen lanes: a transposing add tree (as attention.cpp's sum16), far
// fewer shuffles than sixteen separate reductions.
inline __m512 sum16(const float (*v)[16]) {
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i) {
    const __m512 x = _mm512_load_ps(v[2 * i]), y = _mm512_load_ps(v[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y));
  }
  for (int i = 0; i < 4; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
  for (int i = 0; i < 2; ++i)
    d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], 0x88), _mm512_shuffle_f32x4(d[0], d[1], 0xDD));
}
#endif

// scores[g * stride + j] = q_g . rows[j] for the tile's n widened rows: on AVX-512 (dim a multiple of 16) sixteen
// keys' partial sums reduced together, else one dot product per key.
void tile_scores(int64_t isa, const float* qf, const float* rows, int64_t n, int64_t dim, int64_t group,
                 int64_t stride, float* scores) {
#if defined(__AVX512F__)
  if (isa >= kAvx512 && dim % 16 == 0 && stride % 16 == 0) {
    alignas(64) float part[16][16];
    for (int64_t g = 0; g < group; ++g)
      for (int64_t j0 = 0; j0 < n; j0 += 16) {
        for (int64_t j = 0; j < 16; ++j) {
          __m512 acc = _mm512_setzero_ps();
          if (j0 + j < n)
            for (int64_t i = 0; i < dim; i += 16)
              acc = _mm512_fmadd_ps(_mm512_loadu_ps(qf + g * dim + i), _mm512_loadu_ps(rows + (j0 + j) * dim + i), acc);
          _mm512_store_ps(part[j], acc);
        }
        _mm512_storeu_ps(scores + g * stride + j0, sum16(part));
      }
    return;
  }
#endif
  for (int64_t g = 0; g < group; ++g)
    for (int64_t j = 0; j < n; ++j) scores[g * stride + j] = dot(qf + g * dim, rows + j * dim, dim);
}

#if defined(__AVX512F__)
// acc_g += sum_j scores[g * stride + j] * rows[j] with head g's NV accumulator vectors held in registers.
template <int NV>
void values_in_registers(const float* scores, const float* rows, int64_t n, int64_t group, int64_t stride,
                         float* acc) {
  constexpr int64_t dim = NV * 16;
  for (int64_t g = 0; g < group; ++g) {
    __m512 r[NV];
    for (int v = 0; v < NV; ++v) r[v] = _mm512_loadu_ps(acc + g * dim + v * 16);
    for (int64_t j = 0; j < n; ++j) {
      const __m512 p = _mm512_set1_ps(scores[g * stride + j]);
      for (int v = 0; v < NV; ++v) r[v] = _mm512_fmadd_ps(p, _mm512_loadu_ps(rows + j * dim + v * 16), r[v]);
    }
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(acc + g * dim + v * 16, r[v]);
  }
}
#endif

inline void axpy(float* y, float a, const float* x, int64_t n);

// acc_g += sum_j scores[g * stride + j] * rows[j] for the tile's n widened V rows.
void tile_values(int64_t isa, const float* scores, const float* rows, int64_t n, int64_t dim, int64_t group,
                 int64_t stride, float* acc) {
#if defined(__AVX512F__)
  if (isa >= kAvx512 && (dim == 64 || dim == 128)) {
    if (dim == 64) values_in_registers<4>(scores, rows, n, group, stride, acc);
    else values_in_registers<8>(scores, rows, n, group, stride, acc);
    return;
  }
#endif
  for (int64_t g = 0; g < group; ++g)
    for (int64_t j = 0; j < n; ++j) axpy(acc + g * dim, scores[g * stride + j], rows + j * dim, dim);
}

inline void axpy(float* y, float a, const float* x, int64_t n) {
  int64_t i = 0;
  const Vec va(a);
  for (; i + Vec::size() <= n; i += Vec::size()) at::vec::fmadd(va, Vec::loadu(x + i), Vec::loadu(y + i)).store(y + i);
  for (; i < n; ++i) y[i] += a * x[i];
}

// One pool of a quantized cache, [blocks, kv_heads, block_size, head_dim] bytes, and for int8 its float16 scales
// [blocks, kv_heads, block_size] (contiguous).
struct Pool {
  const uint8_t* data;
  const c10::Half* scale;
  int64_t s0, s1, s2, heads, block_size;

  Pool(const at::Tensor& t, const c10::optional<at::Tensor>& sc)
      : data(static_cast<const uint8_t*>(t.data_ptr())),
        scale(sc.has_value() ? sc->data_ptr<c10::Half>() : nullptr),
        s0(t.stride(0)), s1(t.stride(1)), s2(t.stride(2)), heads(t.size(1)), block_size(t.size(2)) {}

  // Where rows [from, from + n) of head h of the sequence whose block table is `table` lie, and for int8 their
  // scales as float32; walked a block at a time (as attention.cpp's head_rows): no division per row.
  void locate(const int64_t* table, int64_t h, int64_t from, int64_t n, const uint8_t** rows, float* scales) const {
    for (int64_t j = 0, i = from / block_size, off = from % block_size; j < n; ++j) {
      const int64_t b = table[i];
      rows[j] = data + b * s0 + h * s1 + off * s2;
      if (scale) scales[j] = static_cast<float>(scale[(b * heads + h) * block_size + off]);
      if (++off == block_size) off = 0, ++i;
    }
  }
};

constexpr int64_t kTile = 32;  // keys scored per online-softmax step (as attention.cpp's paged_decode)
// Keys per piece of a context, as attention.cpp's kPiece: fixed, so that a row's sums run in one order whether it
// is decoded alone or batched (platforms/invariance.py); the pieces also keep both threads busy at batch 1.
constexpr int64_t kPiece = 128;

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

struct FusedKernels {
  void (*scores)(const float*, int64_t, const uint8_t* const*, const float*, int64_t, float*);
  void (*values)(const float*, const uint8_t* const*, int64_t, int64_t, float*);
};

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
// attention.cpp's group_values_pairs).
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

// How a tile's bytes become numbers: widened a tile at a time into L1 (any isa, any dim), widened in registers
// to float32 (AVX-512, dim % 64 == 0), or to bf16 for vdpbf16ps (a bf16 query, isa 4, dim % 64 == 0).
enum Path : int { kWidenTile = 0, kInRegisters = 1, kDpbf16 = 2 };

struct DecodeArgs {
  Pool k, v;
  Kind kind;
  int64_t isa, group, dim, table_stride, window;
  const int64_t* tables;
  const int64_t* ctx;
  float scale;
  Path path = kWidenTile;

  // The path for a query of this dtype.
  Path pick_path([[maybe_unused]] bool bf16_query) const {
#if defined(KV_QUANT_DPBF16)
    if (bf16_query && isa >= kAvx512Bf16 && dim % 64 == 0) return kDpbf16;
#endif
#if defined(__AVX512F__) && defined(__AVX2__)
    if (isa >= kAvx512 && dim % 64 == 0) return kInRegisters;
#endif
    return kWidenTile;
  }
  // What the fused e4m3 path's K and V are off by (load16): the query is multiplied by it and the output divided.
  float widen_factor() const { return path == kInRegisters && kind == kE4m3 ? 256.f : 1.f; }
  int64_t first_key(int64_t s) const { return window > 0 ? std::max<int64_t>(0, ctx[s] - window) : 0; }
};

// Per-thread working memory of attend.
struct Scratch {
  const uint16_t* qb;  // the bf16 query's bits (kDpbf16)
  float *rows, *scores, *k_scale, *v_scale, *m, *l;
  const uint8_t* krows[kTile];
  const uint8_t* vrows[kTile];
};

// Ask for rows [0, n) into the cache ahead of use (locality 3: L1; 2: L2); a row of 64-128 bytes is 1-2 lines.
inline void prefetch(const uint8_t* const* rows, int64_t n, int64_t bytes, bool near) {
  for (int64_t j = 0; j < n; ++j)
    for (int64_t b = 0; b < bytes; b += 64) {
      if (near) __builtin_prefetch(rows[j] + b, 0, 3);
      else __builtin_prefetch(rows[j] + b, 0, 2);
    }
}

// One tile of keys [t0, t0 + n): scores, the online softmax's update of m, l and acc, then P . V.
void tile(const DecodeArgs& a, const float* qf, int64_t n, float* acc, Scratch& w) {
  const int64_t dim = a.dim, group = a.group;
  float* scores = w.scores;
#if defined(KV_QUANT_DPBF16)
  if (a.path == kDpbf16) {
    for (int64_t g = 0; g < group; g += 4)
      dp(a.kind, std::min<int64_t>(4, group - g), dim).scores(w.qb + g * dim, dim, w.krows, w.k_scale, a.scale, n,
                                                          scores + g * kTile);
  }
#endif
#if defined(__AVX512F__) && defined(__AVX2__)
  const bool fused = a.path != kWidenTile;
  if (a.path == kInRegisters)
    for (int64_t g = 0; g < group; g += 4)
      ::fused(a.kind, std::min<int64_t>(4, group - g)).scores(qf + g * dim, dim, w.krows, w.k_scale, n,
                                                               scores + g * kTile);
#else
  constexpr bool fused = false;
#endif
  if (!fused) {
    for (int64_t j = 0; j < n; ++j)
      widen_row(a.isa, w.krows[j], w.rows + j * dim, dim, a.kind, a.k.scale ? w.k_scale[j] : 1.f);
    tile_scores(a.isa, qf, w.rows, n, dim, group, kTile, scores);
  }
  for (int64_t g = 0; g < group; ++g) {
    float* sc = scores + g * kTile;
    const float new_m = std::max(w.m[g], max_of(sc, n));
    const float correction = std::exp(w.m[g] - new_m);  // 0 on the first tile (m = -inf)
    w.l[g] = w.l[g] * correction + exp_sum(sc, new_m, n);
    if (correction != 1.f)
      for (int64_t i = 0; i < dim; ++i) acc[g * dim + i] *= correction;
    w.m[g] = new_m;
  }
#if defined(__AVX512F__) && defined(__AVX2__)
  if (fused) {
    if (a.v.scale)  // int8: each weight times its value row's scale, so the bytes widen unscaled
      for (int64_t g = 0; g < group; ++g)
        for (int64_t j = 0; j < n; ++j) scores[g * kTile + j] *= w.v_scale[j];
    for (int64_t g = 0; g < group; g += 4) {
      const int64_t heads = std::min<int64_t>(4, group - g);
#if defined(KV_QUANT_DPBF16)
      if (a.path == kDpbf16) {
        dp(a.kind, heads, dim).values(scores + g * kTile, w.vrows, n, dim, acc + g * dim);
        continue;
      }
#endif
      ::fused(a.kind, heads).values(scores + g * kTile, w.vrows, n, dim, acc + g * dim);
    }
    return;
  }
#endif
  for (int64_t j = 0; j < n; ++j)
    widen_row(a.isa, w.vrows[j], w.rows + j * dim, dim, a.kind, a.v.scale ? w.v_scale[j] : 1.f);
  tile_values(a.isa, scores, w.rows, n, dim, group, kTile, acc);
}

// Attention of the `group` query heads (qf: widened, scaled) of sequence s over KV head h, keys [lo, hi): acc
// unnormalised, with each head's running max and sum of exps in w.m, w.l.
void attend(const DecodeArgs& a, int64_t s, int64_t h, int64_t lo, int64_t hi, const float* qf, float* acc,
            Scratch& w) {
  const int64_t dim = a.dim, group = a.group;
  const int64_t* table = a.tables + s * a.table_stride;
  std::fill(acc, acc + group * dim, 0.f);
  std::fill(w.m, w.m + group, -std::numeric_limits<float>::infinity());
  std::fill(w.l, w.l + group, 0.f);
  std::fill(w.k_scale, w.k_scale + kTile, 0.f);  // the fused int8 scores read whole groups of sixteen
  const uint8_t* ahead[2][kTile];
  float ahead_scale[2][kTile];
  if (lo < hi) {
    const int64_t n = std::min(kTile, hi - lo);
    a.k.locate(table, h, lo, n, w.krows, w.k_scale);
    a.v.locate(table, h, lo, n, w.vrows, w.v_scale);
    prefetch(w.krows, n, dim, true);
    prefetch(w.vrows, n, dim, true);
  }
  for (int64_t t0 = lo; t0 < hi; t0 += kTile) {
    const int64_t n = std::min(kTile, hi - t0), next = std::min(kTile, hi - t0 - n);
    if (next > 0) {  // the next tile's rows arrive while this one is computed
      a.k.locate(table, h, t0 + n, next, ahead[0], ahead_scale[0]);
      a.v.locate(table, h, t0 + n, next, ahead[1], ahead_scale[1]);
      prefetch(ahead[0], next, dim, true);
      prefetch(ahead[1], next, dim, true);
    }
    tile(a, qf, n, acc, w);
    std::copy(ahead[0], ahead[0] + next, w.krows);
    std::copy(ahead[1], ahead[1] + next, w.vrows);
    if (a.k.scale) {
      std::copy(ahead_scale[0], ahead_scale[0] + next, w.k_scale);
      std::copy(ahead_scale[1], ahead_scale[1] + next, w.v_scale);
    }
  }
}

// The first tile of keys [lo, hi) of sequence s's head h asked for into L2 (the task after this one's).
void prefetch_first(const DecodeArgs& a, int64_t s, int64_t h, int64_t lo, int64_t hi) {
  const uint8_t* rows[kTile];
  const int64_t n = std::min(kTile, hi - lo);
  if (n <= 0) return;
  float scales[kTile];
  const int64_t* table = a.tables + s * a.table_stride;
  a.k.locate(table, h, lo, n, rows, scales);
  prefetch(rows, n, a.dim, false);
  a.v.locate(table, h, lo, n, rows, scales);
  prefetch(rows, n, a.dim, false);
}

// Each (sequence, head)'s pieces rescaled to the largest max, in piece order, and normalised once.
template <typename T>
void merge_pieces(const float* partial, int64_t seqs, int64_t heads, int64_t splits, int64_t dim, T* op,
                  int64_t o_s0, int64_t o_s1) {
  const int64_t pstride = dim + 2;
  iterserve::parallel_chunks(seqs * heads, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> merged(dim);
    for (int64_t sh = begin; sh < end; ++sh) {
      const float* p = partial + sh * splits * pstride;
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t i = 0; i < splits; ++i) top = std::max(top, p[i * pstride]);
      std::fill(merged.begin(), merged.end(), 0.f);
      float total = 0.f;
      for (int64_t i = 0; i < splits; ++i) {
        const float* pi = p + i * pstride;
        if (pi[1] == 0.f) continue;
        const float wgt = std::exp(pi[0] - top);
        total += wgt * pi[1];
        axpy(merged.data(), wgt, pi + 2, dim);
      }
      const float inv = total > 0.f ? 1.f / total : 0.f;
      T* o = op + (sh / heads) * o_s0 + (sh % heads) * o_s1;
      for (int64_t i = 0; i < dim; ++i) o[i] = static_cast<T>(merged[i] * inv);
    }
  });
}

template <typename T>
void decode_impl(at::Tensor& out, const at::Tensor& q, DecodeArgs a) {
  a.path = a.pick_path(std::is_same_v<T, c10::BFloat16>);
  const int64_t seqs = q.size(0), kv_heads = a.k.heads, heads = q.size(1), dim = a.dim, group = a.group;
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t q_s0 = q.stride(0), q_s1 = q.stride(1), o_s0 = out.stride(0), o_s1 = out.stride(1);
  int64_t longest = 0;
  for (int64_t s = 0; s < seqs; ++s) longest = std::max(longest, a.ctx[s] - a.first_key(s));
  const int64_t splits = std::max<int64_t>(1, (longest + kPiece - 1) / kPiece), pstride = dim + 2;
  // Partials of split contexts, per (sequence, head, piece): the running max, the sum of exps, the output.
  std::vector<float> partial(splits > 1 ? seqs * heads * splits * pstride : 0);
  const float qscale = a.scale * a.widen_factor(), factor = a.widen_factor();
  // Where value i of a row is in the query and output buffers: i itself, except on kDpbf16 (widen64_bf16).
  std::vector<int64_t> source(dim), place(dim);
  for (int64_t i = 0; i < dim; ++i) source[i] = a.path == kDpbf16 ? i / 64 * 64 + scrambled(i % 64) : i;
  for (int64_t i = 0; i < dim; ++i) place[source[i]] = i;
  const int64_t tasks = seqs * kv_heads * splits;
  const int64_t chunk = std::max<int64_t>(1, tasks / (4 * iterserve::ChunkPool::get().threads()));
  iterserve::parallel_chunks(tasks, chunk, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> buf;  // grown once per thread
    buf.resize(2 * group * dim + kTile * dim + group * kTile + 2 * kTile + 2 * group);
    float* qf = buf.data();
    float* acc = qf + group * dim;
    Scratch w;
    w.qb = nullptr;  // set per task on kDpbf16
    w.rows = acc + group * dim;
    w.scores = w.rows + kTile * dim;
    w.k_scale = w.scores + group * kTile;
    w.v_scale = w.k_scale + kTile;
    w.m = w.v_scale + kTile;
    w.l = w.m + group;
    auto span = [&](int64_t task, int64_t& s, int64_t& h, int64_t& piece, int64_t& lo, int64_t& hi) {
      s = task / (kv_heads * splits), h = (task / splits) % kv_heads, piece = task % splits;
      lo = a.first_key(s) + piece * kPiece, hi = std::min(a.ctx[s], lo + kPiece);
    };
    for (int64_t task = begin; task < end; ++task) {
      int64_t s, h, piece, lo, hi;
      span(task, s, h, piece, lo, hi);
      if (task + 1 < end) {  // a task that started cold waited on DRAM for its first tile
        int64_t s2, h2, piece2, lo2, hi2;
        span(task + 1, s2, h2, piece2, lo2, hi2);
        prefetch_first(a, s2, h2, lo2, hi2);
      }
      if (a.path == kDpbf16) {  // the query's bf16 bits, scrambled as the widened K rows are
        const auto* first = reinterpret_cast<const uint16_t*>(qp + s * q_s0 + h * group * q_s1);
        auto* bits = reinterpret_cast<uint16_t*>(qf);
        for (int64_t g = 0; g < group; ++g)
          for (int64_t i = 0; i < dim; ++i) bits[g * dim + i] = first[g * q_s1 + source[i]];
        w.qb = bits;
      } else {
        for (int64_t g = 0; g < group; ++g)
          for (int64_t i = 0; i < dim; ++i)
            qf[g * dim + i] = static_cast<float>(qp[s * q_s0 + (h * group + g) * q_s1 + i]) * qscale;
      }
      attend(a, s, h, lo, hi, qf, acc, w);
      for (int64_t g = 0; g < group; ++g) {
        float* o = acc + g * dim;
        if (splits == 1) {
          const float inv = w.l[g] > 0.f ? factor / w.l[g] : 0.f;
          for (int64_t i = 0; i < dim; ++i)
            op[s * o_s0 + (h * group + g) * o_s1 + i] = static_cast<T>(o[place[i]] * inv);
          continue;
        }
        float* p = partial.data() + ((s * heads + h * group + g) * splits + piece) * pstride;
        p[0] = w.m[g];  // -inf for an empty piece (a context shorter than the longest): it weighs nothing
        p[1] = w.l[g];
        for (int64_t i = 0; i < dim; ++i) p[2 + i] = o[place[i]] * factor;
      }
    }
  });
  if (splits > 1) merge_pieces(partial.data(), seqs, heads, splits, dim, op, o_s0, o_s1);
}

void check_pools(const at::Tensor& k_cache, const at::Tensor& v_cache, const c10::optional<at::Tensor>& k_scale,
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

int64_t pick_isa(int64_t isa) {
  if (isa == kAuto) return best_isa();
  TORCH_CHECK(isa >= kScalar && isa <= best_isa(), "isa ", isa, " is not built for this machine (best: ", best_isa(),
              ")");
  return isa;
}

}  // namespace

// paged_decode over a quantized cache: out[s, head] = softmax(q . K_s^T * scale) V_s, K/V widened from their
// bytes (and int8 scales) tile by tile; sliding_window <= 0 means none; isa 0 picks the widest built.
void paged_decode_quant(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale,
                        const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                        int64_t sliding_window, int64_t isa) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && out.stride(2) == 1 && out.scalar_type() == q.scalar_type(),
              "q/out must be [seqs, heads, head_dim]");
  check_pools(k_cache, v_cache, k_scale, v_scale, q.size(2));
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "heads must be a multiple of kv_heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong &&
                  block_tables.stride(1) == 1 && context_lens.is_contiguous(),
              "block tables and context lengths must be row-major int64");
  const DecodeArgs a{Pool(k_cache, k_scale), Pool(v_cache, v_scale), kind_of(k_cache), pick_isa(isa),
                     q.size(1) / k_cache.size(1), q.size(2), block_tables.stride(0), sliding_window,
                     block_tables.data_ptr<int64_t>(), context_lens.data_ptr<int64_t>(), static_cast<float>(scale)};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_quant",
                                  [&] { decode_impl<scalar_t>(out, q, a); });
}

// k_cache[blocks[i], :, offsets[i]] = quantize(k[i]) (scales too for int8), and the same for v.
void write_kv_quant(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
                    const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale,
                    const at::Tensor& slot_blocks, const at::Tensor& slot_offsets) {
  TORCH_CHECK(k.dim() == 3 && k.stride(2) == 1 && v.stride(2) == 1 && k.sizes() == v.sizes(),
              "k/v must be [tokens, kv_heads, head_dim]");
  check_pools(k_cache, v_cache, k_scale, v_scale, k.size(2));
  TORCH_CHECK(slot_blocks.is_contiguous() && slot_offsets.is_contiguous() && slot_blocks.scalar_type() == at::kLong &&
                  slot_offsets.scalar_type() == at::kLong, "slots must be contiguous int64");
  const Kind kind = kind_of(k_cache);
  const int64_t heads = k.size(1), dim = k.size(2), bs = k_cache.size(2);
  const int64_t* blocks = slot_blocks.data_ptr<int64_t>();
  const int64_t* offsets = slot_offsets.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "write_kv_quant", [&] {
    iterserve::parallel_chunks(k.size(0), 16, [&](int64_t begin, int64_t end) {
      std::vector<float> row(dim);
      for (int64_t i = begin; i < end; ++i)
        for (int64_t h = 0; h < heads; ++h)
          for (int which = 0; which < 2; ++which) {
            const at::Tensor& x = which ? v : k;
            at::Tensor& cache = which ? v_cache : k_cache;
            const c10::optional<at::Tensor>& sc = which ? v_scale : k_scale;
            const scalar_t* src = x.data_ptr<scalar_t>() + i * x.stride(0) + h * x.stride(1);
            for (int64_t d = 0; d < dim; ++d) row[d] = static_cast<float>(src[d]);
            auto* dst = static_cast<uint8_t*>(cache.data_ptr()) + blocks[i] * cache.stride(0) + h * cache.stride(1) +
                        offsets[i] * cache.stride(2);
            const c10::Half s = quantize_row(row.data(), dim, kind, dst);
            if (sc.has_value()) sc->data_ptr<c10::Half>()[(blocks[i] * heads + h) * bs + offsets[i]] = s;
          }
    });
  });
}

TORCH_LIBRARY_FRAGMENT(iterserve, m) {
  m.def("paged_decode_quant(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor? k_scale, "
        "Tensor? v_scale, Tensor block_tables, Tensor context_lens, float scale, int sliding_window, int isa=0) -> ()");
  m.def("write_kv_quant(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor(c!)? k_scale, "
        "Tensor(d!)? v_scale, Tensor slot_blocks, Tensor slot_offsets) -> ()");
  // Widest path built: 1 scalar, 2 AVX2 + F16C, 3 AVX-512, 4 AVX512-BF16 (bf16 queries)
  m.def("kv_quant_best_isa() -> int", &best_isa);
}

TORCH_LIBRARY_IMPL(iterserve, CPU, m) {
  m.impl("paged_decode_quant", &paged_decode_quant);
  m.impl("write_kv_quant", &write_kv_quant);
}
