// Matmuls on weights kept in 4- and 8-bit blocks of 32 (GGUF Q4_0/Q4_1/Q8_0, and int8 quantized at
// load), so a decode step reads the quantized bytes instead of float32 weights.
//
// Layout (written by iterserve/quantization/packed.py): output columns in tiles of 16; for each tile and
// each block of 32 inputs, the 16 columns' quants then their 16 float16 scales d and 16 float16 offsets c,
// so one tile's block is one contiguous run of bytes. A column's weight at input k of block b is
//   w = d * q + c          (q unsigned: a nibble 0..15, or the int8 value + 128)
// The quants are stored the way a VNNI dot product consumes them: 64-byte chunks of 16 columns x 4
// consecutive inputs. 4-bit tiles hold 4 chunks (low nibbles: inputs 4j..4j+3, high nibbles: inputs
// 16+4j..16+4j+3); 8-bit tiles hold 8 chunks.
//
// The activations are quantized per row and block to int8 (scale a_d = max|x| / 127), as llama.cpp's q8
// dot products do, so each block is one integer dot product per column:
//   sum_k w x ~= d * a_d * sum_k q a  +  c * a_d * sum_k a
// On AVX-512 VNNI one vpdpbusd multiplies 16 columns x 4 inputs; AVX2 uses vpmaddubsw; a scalar loop
// serves everything else. All three are compiled where the build machine has them, and `isa` picks one
// (tests run each against the reference).

#include <torch/extension.h>

#include <c10/util/Half.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "parallel.h"
#include "quant_rows.h"

using namespace iterserve_quant;

namespace {

constexpr int64_t kCols = 16;   // output columns per tile
constexpr int64_t kPrefetch = 4096;  // bytes of weights fetched ahead of the ones being multiplied

// Bytes of one tile's block: quants, then 16 float16 d, then 16 float16 c.
inline int64_t quant_bytes(int64_t bits) { return kCols * kBlock * bits / 8; }
inline int64_t tile_block_bytes(int64_t bits) { return quant_bytes(bits) + 4 * kCols; }

// The quant of column c at input i (0..31) of one tile's block.
inline int32_t quant_at(const uint8_t* p, int64_t bits, int64_t c, int64_t i) {
  if (bits == 8) return p[(i / 4) * 64 + c * 4 + i % 4];
  const int64_t j = (i % 16) / 4;
  const uint8_t byte = p[j * 64 + c * 4 + i % 4];
  return i < 16 ? byte & 0x0F : byte >> 4;
}

// out[r][c] for `mr` rows of one tile, portable C++.
void tile_scalar(const uint8_t* w, int64_t bits, const QuantizedRows& a, int64_t r0, int64_t mr, float* out) {
  const int64_t stride = tile_block_bytes(bits), qb = quant_bytes(bits);
  std::fill(out, out + mr * kCols, 0.f);
  for (int64_t b = 0; b < a.blocks; ++b) {
    const uint8_t* p = w + b * stride;
    for (int64_t c = 0; c < kCols; ++c) {
      const float d = half_to_float(p + qb + 2 * c), off = half_to_float(p + qb + 2 * kCols + 2 * c);
      for (int64_t r = 0; r < mr; ++r) {
        const int8_t* q = a.row(r0 + r) + b * kBlock;
        int32_t dot = 0;
        for (int64_t i = 0; i < kBlock; ++i) dot += quant_at(p, bits, c, i) * q[i];
        const int64_t ab = (r0 + r) * a.blocks + b;
        out[r * kCols + c] += d * a.d[ab] * static_cast<float>(dot) + off * a.e[ab];
      }
    }
  }
}

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
// AVX2: 8 columns per register, so a 64-byte chunk is two halves. vpmaddubsw saturates at 16 bits: a
// nibble (<= 15) times an int8 is safe, an 8-bit quant (<= 255) is not, so 8-bit tiles multiply the signed
// quant (q - 128) with the sign trick and add back 128 * sum(a).
template <int MR>
void tile_avx2(const uint8_t* w, int64_t bits, const QuantizedRows& a, int64_t r0, float* out) {
  const int64_t stride = tile_block_bytes(bits), qb = quant_bytes(bits);
  const __m256i nibble = _mm256_set1_epi8(0x0F), flip = _mm256_set1_epi8(static_cast<char>(0x80));
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[MR][2];
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < a.blocks; ++b) {
    const uint8_t* p = w + b * stride;
    __m256i dot[MR][2];
    for (int r = 0; r < MR; ++r) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
    const int chunks = bits == 8 ? 8 : 4;
    for (int j = 0; j < chunks; ++j) {
      for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + j * 64 + h * 32));
        if (bits == 8) {
          const __m256i s = _mm256_xor_si256(v, flip), mag = _mm256_sign_epi8(s, s);
          for (int r = 0; r < MR; ++r) {
            const __m256i x = _mm256_set1_epi32(load_i32(a.row(r0 + r) + b * kBlock + 4 * j));
            const __m256i prod = _mm256_maddubs_epi16(mag, _mm256_sign_epi8(x, s));
            dot[r][h] = _mm256_add_epi32(dot[r][h], _mm256_madd_epi16(prod, ones));
          }
        } else {
          const __m256i lo = _mm256_and_si256(v, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
          for (int r = 0; r < MR; ++r) {
            const int8_t* x = a.row(r0 + r) + b * kBlock;
            const __m256i xl = _mm256_set1_epi32(load_i32(x + 4 * j)), xh = _mm256_set1_epi32(load_i32(x + 16 + 4 * j));
            const __m256i prod = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh));
            dot[r][h] = _mm256_add_epi32(dot[r][h], _mm256_madd_epi16(prod, ones));
          }
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + qb + 16 * h)));
      const __m256 c = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + qb + 32 + 16 * h)));
      for (int r = 0; r < MR; ++r) {
        const int64_t ab = (r0 + r) * a.blocks + b;
        __m256i dt = dot[r][h];
        if (bits == 8) dt = _mm256_add_epi32(dt, _mm256_set1_epi32(128 * a.sum[ab]));
        acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dt), _mm256_mul_ps(d, _mm256_set1_ps(a.d[ab])), acc[r][h]);
        acc[r][h] = _mm256_fmadd_ps(c, _mm256_set1_ps(a.e[ab]), acc[r][h]);
      }
    }
  }
  for (int r = 0; r < MR; ++r) {
    _mm256_storeu_ps(out + r * kCols, acc[r][0]);
    _mm256_storeu_ps(out + r * kCols + 8, acc[r][1]);
  }
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// AVX-512 VNNI: one vpdpbusd is 16 columns x 4 inputs; a 4-bit chunk unpacks into two of them. Each row
// keeps two integer accumulators so that its chain of dependent vpdpbusd (5 cycles each) is half as long.
template <int MR, int BITS>
void tile_avx512(const uint8_t* w, const QuantizedRows& a, int64_t r0, float* out) {
  constexpr int64_t qb = BITS * kCols * kBlock / 8, stride = qb + 4 * kCols;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < a.blocks; ++b) {
    const uint8_t* p = w + b * stride;
    // The weights are read once per call, from DRAM: fetch kPrefetch bytes ahead (into the next tile at its
    // end) so the stream does not wait for the hardware prefetcher to ramp up on every small matrix.
    for (int64_t line = 0; line < stride; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetch + line), _MM_HINT_T0);
    const int8_t* x[MR];
    for (int r = 0; r < MR; ++r) x[r] = a.row(r0 + r) + b * kBlock;
    __m512i dot0[MR], dot1[MR];
    for (int r = 0; r < MR; ++r) dot0[r] = dot1[r] = _mm512_setzero_si512();
    for (int j = 0; j < 4; ++j) {
      __m512i u0, u1;  // the quants of inputs 4j.. (u0) and 16+4j.. (u1)
      if constexpr (BITS == 8) {
        u0 = _mm512_loadu_si512(p + j * 64);
        u1 = _mm512_loadu_si512(p + (j + 4) * 64);
      } else {
        const __m512i v = _mm512_loadu_si512(p + j * 64);
        u0 = _mm512_and_si512(v, nibble);
        u1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
      }
      for (int r = 0; r < MR; ++r) {
        dot0[r] = _mm512_dpbusd_epi32(dot0[r], u0, _mm512_set1_epi32(load_i32(x[r] + 4 * j)));
        dot1[r] = _mm512_dpbusd_epi32(dot1[r], u1, _mm512_set1_epi32(load_i32(x[r] + 16 + 4 * j)));
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + qb)));
    const __m512 c = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + qb + 32)));
    for (int r = 0; r < MR; ++r) {
      const int64_t ab = (r0 + r) * a.blocks + b;
      const __m512 dots = _mm512_cvtepi32_ps(_mm512_add_epi32(dot0[r], dot1[r]));
      acc[r] = _mm512_fmadd_ps(dots, _mm512_mul_ps(d, _mm512_set1_ps(a.d[ab])), acc[r]);
      acc[r] = _mm512_fmadd_ps(c, _mm512_set1_ps(a.e[ab]), acc[r]);
    }
  }
  for (int r = 0; r < MR; ++r) _mm512_storeu_ps(out + r * kCols, acc[r]);
}

template <int BITS>
void rows_avx512(const uint8_t* w, const QuantizedRows& a, int64_t r0, int64_t mr, float* out) {
  using Kernel = void (*)(const uint8_t*, const QuantizedRows&, int64_t, float*);
  static constexpr Kernel by_rows[] = {tile_avx512<1, BITS>, tile_avx512<2, BITS>, tile_avx512<3, BITS>,
                                       tile_avx512<4, BITS>, tile_avx512<5, BITS>, tile_avx512<6, BITS>,
                                       tile_avx512<7, BITS>, tile_avx512<8, BITS>};
  constexpr int64_t most = sizeof(by_rows) / sizeof(by_rows[0]);
  for (int64_t r = 0; r < mr; r += most) by_rows[std::min(most, mr - r) - 1](w, a, r0 + r, out + r * kCols);
}
#endif

// Rows [r0, r0 + mr) of one tile into `out` (mr x 16 floats), with the widest kernel `isa` allows.
void tile_rows(int64_t isa, const uint8_t* w, int64_t bits, const QuantizedRows& a, int64_t r0, int64_t mr,
               float* out) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  if (isa == kAvx512Vnni) {
    bits == 8 ? rows_avx512<8>(w, a, r0, mr, out) : rows_avx512<4>(w, a, r0, mr, out);
    return;
  }
#endif
#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
  if (isa == kAvx2) {
    for (int64_t r = 0; r < mr;) {
      const int64_t n = std::min<int64_t>(2, mr - r);
      n == 2 ? tile_avx2<2>(w, bits, a, r0 + r, out + r * kCols) : tile_avx2<1>(w, bits, a, r0 + r, out + r * kCols);
      r += n;
    }
    return;
  }
#endif
  tile_scalar(w, bits, a, r0, mr, out);
}

template <typename T>
void store_tile(const float* tile, int64_t mr, int64_t cols, T* out, int64_t ldo) {
  for (int64_t r = 0; r < mr; ++r)
    for (int64_t c = 0; c < cols; ++c) out[r * ldo + c] = static_cast<T>(tile[r * kCols + c]);
}

// Rows processed per pass over a tile: the tile's quants stay in L1 while this many rows' accumulators
// stay in registers.
constexpr int64_t kRowGroup = 16;

}  // namespace

// x [M, K] (float32/bfloat16/float16) times the packed weight [tiles, blocks, tile_block_bytes] ->
// [M, n] in x's dtype.
at::Tensor qgemm(const at::Tensor& x, const at::Tensor& w, int64_t n, int64_t bits, int64_t isa, bool float_out) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8, got ", bits);
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be a 2-D tensor with contiguous rows");
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == at::kByte && w.is_contiguous(), "w must be a packed uint8 tensor");
  TORCH_CHECK(w.size(2) == tile_block_bytes(bits), "w's last dimension must be ", tile_block_bytes(bits));
  TORCH_CHECK(w.size(0) == (n + kCols - 1) / kCols, "w holds ", w.size(0), " tiles, ", n, " columns need ",
              (n + kCols - 1) / kCols);
  TORCH_CHECK(w.size(1) == (x.size(1) + kBlock - 1) / kBlock, "x has ", x.size(1), " inputs, w ", w.size(1),
              " blocks of ", kBlock);
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "qgemm runs on CPU tensors");
  if (isa == kAuto) isa = best_isa();
  TORCH_CHECK(isa >= kScalar && isa <= best_isa(), "isa ", isa, " is not built for this machine (best: ",
              best_isa(), ")");
  const int64_t m = x.size(0), tiles = w.size(0);
  at::Tensor out = at::empty({m, n}, float_out ? x.options().dtype(at::kFloat) : x.options());
  if (m == 0 || n == 0) return out;
  // One buffer per calling thread, reused: no allocation per call (a decode step makes one call per layer).
  // Named through a reference: a lambda run on another thread would name that thread's own instance.
  thread_local QuantizedRows buffer;
  QuantizedRows& a = buffer;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "qgemm", [&] {
    quantize_rows(x.data_ptr<scalar_t>(), x.stride(0), m, x.size(1), a);
  });
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t tile_bytes = w.size(1) * w.size(2);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "qgemm", [&] {
    scalar_t* op = out.data_ptr<scalar_t>();
    // The kernels' pool (parallel.h), not torch's OpenMP team: a CPU engine gives its threads to the pool.
    // Twelve tiles (192 columns) a chunk: a thread streams that many contiguous tiles between claims, few
    // enough claims that their cost vanishes, enough chunks that both threads finish together.
    iterserve::parallel_chunks(tiles, 12, [&](int64_t begin, int64_t end) {
      float buf[kRowGroup * kCols];
      for (int64_t t = begin; t < end; ++t) {
        const int64_t cols = std::min(kCols, n - t * kCols);
        for (int64_t r0 = 0; r0 < m; r0 += kRowGroup) {
          const int64_t mr = std::min(kRowGroup, m - r0);
          tile_rows(isa, wp + t * tile_bytes, bits, a, r0, mr, buf);
          store_tile(buf, mr, cols, op + r0 * n + t * kCols, n);
        }
      }
    });
  });
  return out;
}

namespace {

// Rows `ids` of a packed [n, k] weight as `dtype` values, shaped [*ids.shape, k]: an embedding lookup
// that reads a few hundred bytes per id, where gathering whole tiles reads tens of kilobytes.
at::Tensor qrows(const at::Tensor& w, const at::Tensor& ids, int64_t n, int64_t k, int64_t bits,
                 at::ScalarType dtype) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8, got ", bits);
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == at::kByte && w.is_contiguous() && w.size(2) == tile_block_bytes(bits),
              "w must be a packed uint8 tensor of ", bits, "-bit tiles");
  TORCH_CHECK(w.size(0) == (n + kCols - 1) / kCols && w.size(1) == (k + kBlock - 1) / kBlock,
              "w's shape does not hold a [", n, ", ", k, "] weight");
  const at::Tensor flat = ids.to(at::kLong).contiguous().view(-1);
  const int64_t* id = flat.data_ptr<int64_t>();
  for (int64_t i = 0; i < flat.numel(); ++i)
    TORCH_CHECK(id[i] >= 0 && id[i] < n, "row ", id[i], " is outside a weight of ", n, " rows");
  std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
  shape.push_back(k);
  at::Tensor out = at::empty(shape, w.options().dtype(dtype));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t blocks = w.size(1), stride = w.size(2), qb = quant_bytes(bits);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "qrows", [&] {
    scalar_t* op = out.data_ptr<scalar_t>();
    iterserve::parallel_chunks(flat.numel(), 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const int64_t col = id[r] % kCols;
        const uint8_t* tile = wp + (id[r] / kCols) * blocks * stride;
        for (int64_t b = 0; b < blocks; ++b) {
          const uint8_t* p = tile + b * stride;
          const float d = half_to_float(p + qb + 2 * col), c = half_to_float(p + qb + 2 * kCols + 2 * col);
          for (int64_t i = 0; i < kBlock && b * kBlock + i < k; ++i)
            op[r * k + b * kBlock + i] = static_cast<scalar_t>(d * static_cast<float>(quant_at(p, bits, col, i)) + c);
        }
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(iterserve, m) {
  m.def("qgemm(Tensor x, Tensor w, int n, int bits, int isa=0, bool float_out=False) -> Tensor");
  m.def("qrows(Tensor w, Tensor ids, int n, int k, int bits, ScalarType dtype) -> Tensor");
  m.def("quant_best_isa() -> int", &best_isa);
}

TORCH_LIBRARY_IMPL(iterserve, CPU, m) {
  m.impl("qgemm", &qgemm);
  m.impl("qrows", &qrows);
}
