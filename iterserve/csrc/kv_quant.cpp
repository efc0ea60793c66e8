// The quantized KV cache (kv_cache_dtype fp8_e4m3, fp8_e5m2, int8; iterserve/config/kv_cache.py): the store
// that quantizes this step's K/V into their slots, and paged decode attention that reads the one-byte blocks in
// place and widens each tile of rows to float32 in L1 before the dot products. The stored bytes match
// iterserve/attention/kv_quant.py's quantize exactly (same clamps, same round-to-nearest-even).
//
// Widening: e5m2 is the top byte of a float16 (x << 8); e4m3 becomes a float16 as
// ((x & 0x80) << 8) | ((x & 0x7F) << 7) times 2^8 (the exponent biases differ by 8), exact for every finite
// value; int8 is cvtepi8 -> float x the row's float16 scale. AVX-512 widens 16 values at once, AVX2 + F16C 8,
// a 256-entry table the rest; all are built where the compiler targets them and `isa` picks one (tests run
// each).

#include <torch/extension.h>

#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <ATen/cpu/vec/vec.h>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <vector>

#include "parallel.h"

namespace {

enum Isa : int64_t { kAuto = 0, kScalar = 1, kAvx2 = 2, kAvx512 = 3 };
enum Kind : int { kE4m3 = 0, kE5m2 = 1, kInt8 = 2 };

int64_t best_isa() {
#if defined(__AVX512F__)
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
// Lane j of the result is the sum of v[j]'s sixteen lanes: a transposing add tree (as cpu_ops.cpp's sum16), far
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

  // Rows [from, from + n) of head h of the sequence whose block table is `table`, widened into dst.
  void widen(int64_t isa, Kind kind, const int64_t* table, int64_t h, int64_t from, int64_t n, int64_t dim,
             float* dst) const {
    // walked a block at a time (as cpu_ops.cpp's head_rows): no division per row
    for (int64_t j = 0, i = from / block_size, off = from % block_size; j < n; ++j) {
      const int64_t b = table[i];
      const float sc = scale ? static_cast<float>(scale[(b * heads + h) * block_size + off]) : 1.f;
      widen_row(isa, data + b * s0 + h * s1 + off * s2, dst + j * dim, dim, kind, sc);
      if (++off == block_size) off = 0, ++i;
    }
  }
};

constexpr int64_t kTile = 32;  // keys widened and scored per online-softmax step: 32 rows of floats stay in L1

struct DecodeArgs {
  Pool k, v;
  Kind kind;
  int64_t isa, group, dim, table_stride, window;
  const int64_t* tables;
  const int64_t* ctx;
  float scale;
};

// Attention of the `group` query heads (qf: widened, scaled) of sequence s over KV head h, into acc (normalised).
void attend(const DecodeArgs& a, int64_t s, int64_t h, const float* qf, float* acc, float* scratch) {
  const int64_t dim = a.dim, group = a.group, hi = a.ctx[s];
  const int64_t lo = a.window > 0 ? std::max<int64_t>(0, hi - a.window) : 0;
  const int64_t* table = a.tables + s * a.table_stride;
  float* rows = scratch;
  float* scores = rows + kTile * dim;
  float* m = scores + group * kTile;
  float* l = m + group;
  std::fill(acc, acc + group * dim, 0.f);
  std::fill(m, m + group, -std::numeric_limits<float>::infinity());
  std::fill(l, l + group, 0.f);
  for (int64_t t0 = lo; t0 < hi; t0 += kTile) {
    const int64_t n = std::min(kTile, hi - t0);
    a.k.widen(a.isa, a.kind, table, h, t0, n, dim, rows);
    tile_scores(a.isa, qf, rows, n, dim, group, kTile, scores);
    for (int64_t g = 0; g < group; ++g) {
      float* sc = scores + g * kTile;
      float tile_max = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < n; ++j) tile_max = std::max(tile_max, sc[j]);
      const float new_m = std::max(m[g], tile_max);
      const float correction = std::exp(m[g] - new_m);  // 0 on the first tile (m = -inf)
      l[g] = l[g] * correction + exp_sum(sc, new_m, n);
      if (correction != 1.f)
        for (int64_t i = 0; i < dim; ++i) acc[g * dim + i] *= correction;
      m[g] = new_m;
    }
    a.v.widen(a.isa, a.kind, table, h, t0, n, dim, rows);
    tile_values(a.isa, scores, rows, n, dim, group, kTile, acc);
  }
  for (int64_t g = 0; g < group; ++g) {
    const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
    for (int64_t i = 0; i < dim; ++i) acc[g * dim + i] *= inv;
  }
}

template <typename T>
void decode_impl(at::Tensor& out, const at::Tensor& q, const DecodeArgs& a) {
  const int64_t seqs = q.size(0), kv_heads = a.k.heads, dim = a.dim, group = a.group;
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t q_s0 = q.stride(0), q_s1 = q.stride(1), o_s0 = out.stride(0), o_s1 = out.stride(1);
  iterserve::parallel_chunks(seqs * kv_heads, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> scratch;  // grown once per thread
    scratch.resize(2 * group * dim + kTile * dim + group * kTile + 2 * group);
    float* qf = scratch.data();
    float* acc = qf + group * dim;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / kv_heads, h = task % kv_heads;
      for (int64_t g = 0; g < group; ++g)
        for (int64_t i = 0; i < dim; ++i)
          qf[g * dim + i] = static_cast<float>(qp[s * q_s0 + (h * group + g) * q_s1 + i]) * a.scale;
      attend(a, s, h, qf, acc, acc + group * dim);
      for (int64_t g = 0; g < group; ++g)
        for (int64_t i = 0; i < dim; ++i) op[s * o_s0 + (h * group + g) * o_s1 + i] = static_cast<T>(acc[g * dim + i]);
    }
  });
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

void register_kv_quant(pybind11::module& m) {
  m.def("paged_decode_quant", &paged_decode_quant, "Paged decode attention over a float8 or int8 KV cache");
  m.def("write_kv_quant", &write_kv_quant, "Quantize this step's K/V rows into their cache slots");
  m.def("kv_quant_best_isa", &best_isa, "Widest widening path built: 1 scalar, 2 AVX2 + F16C, 3 AVX-512");
}
