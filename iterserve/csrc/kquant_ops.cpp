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
// so each super-block is decoded once per call, whatever the number of rows. With AVX-512 and up to 32 rows
// (decode steps) the codes go from the decoder's registers straight into vpdpbusd instead: the weight is read
// once and nothing is stored, in the same integer dots and float steps per row, so a row's result does not
// depend on the row count.
//
// Weights of linear layers (all these types but Q4_0/Q4_1) are re-laid out at load ("tiled", gguf_weight.py):
// per tile of 16 rows and block, dword i of the 16 rows' blocks side by side (64 bytes), the block padded to
// whole dwords. The AVX-512 decoders (kquant_avx512.h) then read with plain loads what they otherwise gather, and
// the AVX2 ones (kquant_avx2.h) take such tiles only.

#include "kquant_avx2_dots.h"
#include "kquant_avx512.h"
#include "kquant_blocks.h"
#include "ops.h"
#include "parallel.h"

using namespace iterserve_quant;
using namespace iterserve_kquant;

namespace {

// -- a tile of 16 columns x 256 inputs, decoded for the integer dot products -------------------------------

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
  t.int_scales = false;
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

// The SIMD decoders built here for this type (AVX-512); false when there is none.
bool decode_tile_fast(int64_t type, bool tiled, const uint8_t* rows, int64_t row_bytes, int64_t cols, int64_t u,
                      int64_t k, Tile& t) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  return decode_tile_avx512(type, tiled, rows, row_bytes, cols, u, k, t);
#else
  return false;
#endif
}

// The whole tile times the m rows decoded in registers (AVX-512, up to 32 rows); false leaves it to the tile path.
bool fused_tile_fast(int64_t type, bool tiled, const uint8_t* rows, int64_t row_bytes, int64_t cols, int64_t k,
                     const Activations& x, int64_t m, float* acc) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  return m <= kFusedMost && fused_tile(type, tiled, rows, row_bytes, cols, k, x, m, acc);
#else
  return false;
#endif
}

// Unit u of the tile's columns, by the widest decoder built for `isa` that takes this type and layout.
void decode_any(int64_t isa, int64_t type, bool tiled, const uint8_t* rows, int64_t row_bytes, int64_t cols,
                int64_t u, int64_t k, Tile& t) {
  if (isa == kAvx512Vnni && decode_tile_fast(type, tiled, rows, row_bytes, cols, u, k, t)) return;
#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
  if (isa == kAvx2 && tiled && avx2::decode_tile(type, rows, u, k, t)) return;
#endif
  decode_tile(type, tiled, rows, row_bytes, cols, u, k, t);
}

// The whole tile times one row decoded in registers (AVX2); false leaves it to the tile path.
bool fused_tile_avx2(int64_t type, const uint8_t* tile, int64_t k, const Activations& x, int64_t m, float* acc) {
#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
  return m == 1 && avx2::fused_tile(type, tile, k, x, acc);
#else
  return false;
#endif
}

void tile_rows(int64_t isa, int64_t type, const Tile& t, const Activations& x, int64_t u, int64_t m, float* acc) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  if (isa == kAvx512Vnni)
    return pairs(type) ? rows_avx512_any<true>(t, x, u, m, acc) : rows_avx512_any<false>(t, x, u, m, acc);
#endif
#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
  if (isa == kAvx2 && avx2::rows(type, t, x, u, m, acc)) return;
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
at::Tensor kgemm(const at::Tensor& x, at::TensorList ws, at::IntArrayRef types, at::IntArrayRef ns, int64_t isa,
                 bool float_out) {
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
  at::Tensor out = at::empty({m, n}, float_out ? x.options().dtype(at::kFloat) : x.options());
  if (m == 0 || n == 0 || k == 0) return out;
  thread_local QuantizedRows buffer;
  QuantizedRows& a = buffer;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "kgemm",
                                  [&] { quantize_rows(x.data_ptr<scalar_t>(), x.stride(0), m, k, a); });
  Activations act{a, {}, k / kGroup};
  sums_of_16(a, k, act.sum16);
  const int64_t units = (k + kUnit - 1) / kUnit;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "kgemm", [&] {
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
        const bool fused = isa == kAvx512Vnni ? fused_tile_fast(types[part], tiled, rows, row_bytes, cols, k, act, m,
                                                                acc.data())
                                              : isa == kAvx2 && tiled && fused_tile_avx2(types[part], rows, k, act, m,
                                                                                         acc.data());
        for (int64_t u = 0; u < units && !fused; ++u) {
          decode_any(isa, types[part], tiled, rows, row_bytes, cols, u, k, tile);
          tile_rows(isa, types[part], tile, act, u, m, acc.data());
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

TORCH_LIBRARY_FRAGMENT(iterserve, m) {
  m.def("kgemm(Tensor x, Tensor[] w, int[] types, int[] n, int isa=0, bool float_out=False) -> Tensor");
  m.def("krows(Tensor w, int type, Tensor ids, int k, ScalarType dtype, int rows=-1) -> Tensor");
}

TORCH_LIBRARY_IMPL(iterserve, CPU, m) {
  m.impl("kgemm", &kgemm);
  m.impl("krows", &krows);
}
