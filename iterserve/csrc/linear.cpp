// A linear layer for the few rows of a decode step, y = x W^T (+ b), on a weight re-laid out once at load.
//
// W [N, K] is packed into blocks of V output columns (V = the float vector width: 16 on AVX-512, 8 on
// AVX2), each block [K, V] contiguous: one vector load gives one k for V outputs. The kernel broadcasts
// x[m, k] and accumulates rows x NB blocks in registers, so there is no horizontal reduction and each
// weight element feeds every row while it is in a register: the weight streams from memory once per
// call, at the read bandwidth, for 1 row as for 8. More rows take the weight a register tile at a time,
// 8 rows after 8 (6 on AVX2) while the tile is in cache.
//
// Arithmetic is float32 (bf16/fp16 weights widen on load) with one rounding to the output dtype. With
// AVX512-BF16 (the compiler's __AVX512BF16__) a bf16 weight is packed as k-pairs, [K/2, 16, 2] per block,
// for vdpbf16ps: 32 exact bf16 products summed into 16 float32 lanes per instruction.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include "linear.h"
#include "ops.h"
#include "parallel.h"

#include <algorithm>
#include <vector>

#ifdef ITERSERVE_DPBF16
#include <immintrin.h>
#endif
#ifdef ITERSERVE_AMX
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

using iterserve::kGroup;
using iterserve::kPairAlign;
using iterserve::kV;
using iterserve::pairs;
using Vec = at::vec::Vectorized<float>;
constexpr int kMaxMR = 8;  // rows per register tile
// Rows per register tile when more than kMaxMR rows take the weight a tile at a time: within AVX2's 16 registers
// 6 rows x 2 blocks keep 12 independent sums in flight and load 8 values per 12 FMAs, 8 rows x 1 block 8 and 9 per 8.
constexpr int kBigMR = kV == 16 ? kMaxMR : 6;
// k steps a tile asks for its weight ahead of use, from 4 rows up: the hardware prefetcher alone leaves a tile
// of several rows waiting on memory, while at one row it keeps up on its own.
constexpr int64_t kAhead = 32;
constexpr int prefetch_for(int mr) { return mr >= 4 ? kAhead : 0; }
// Every tile also asks for its weight this many bytes ahead into L2, each block's stream on its own, so that
// weights streamed from DRAM arrive before the arithmetic needs them (docs/benchmarks-history.md).
constexpr int64_t kFarBytes = 4096;

inline Vec load_w(const float* p) { return Vec::loadu(p); }
template <typename T>
inline Vec load_w(const T* p) {
  Vec out;
  at::vec::load_to_float(p, out);
  return out;
}

// Blocks per register tile: MR x NB accumulators plus NB weight vectors stay within 32 (16 on AVX2) registers.
constexpr int nb_for(int mr) { return kV == 16 ? (mr <= 4 ? 4 : 3) : (mr <= 2 ? 4 : mr <= 6 ? 2 : 1); }

// `lines` cache lines from `ahead`, fetched into L2 over the first k steps of a tile, as few per step as cover them.
struct AheadLines {
  const char* ahead;
  int64_t lines, per_k, k_steps;
  AheadLines(const char* a, int64_t n, int64_t K)
      : ahead(a), lines(n), per_k((n + K - 1) / K), k_steps(per_k ? (n + per_k - 1) / per_k : 0) {}
  void fetch(int64_t k) const {
    for (int64_t q = k * per_k, e = std::min(lines, q + per_k); q < e; ++q) __builtin_prefetch(ahead + q * 64, 0, 2);
  }
};

// out[m, j*V + v] = sum_k x[m, k] * block_j[k, v] for MR rows and NB blocks (the last `nb` real). Unlike the
// k-pair tile it fetches no next tile (AheadLines): in the k steps that did, GCC ran out of registers and kept
// the float accumulators on the stack (docs/benchmarks-history.md).
template <typename T, int MR, int NB, int PF>
inline void tile(const float* x, int64_t xs, const T* p, int64_t bstride, int64_t K, int nb, float* out) {
  Vec acc[MR][NB];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = Vec(0.f);
  const T* blk[NB];
  for (int j = 0; j < NB; ++j) blk[j] = p + std::min(j, nb - 1) * bstride;  // a short tile repeats its last block
  for (int64_t k = 0; k < K; ++k) {
    Vec w[NB];
    if constexpr (PF > 0) for (int j = 0; j < NB; ++j) __builtin_prefetch(blk[j] + (k + PF) * kV);
    for (int j = 0; j < NB; ++j) __builtin_prefetch(blk[j] + k * kV + kFarBytes / sizeof(T), 0, 2);
    for (int j = 0; j < NB; ++j) w[j] = load_w(blk[j] + k * kV);
    for (int m = 0; m < MR; ++m) {
      const Vec xb(x[m * xs + k]);
      for (int j = 0; j < NB; ++j) acc[m][j] = at::vec::fmadd(xb, w[j], acc[m][j]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < nb; ++j) acc[m][j].store(out + m * NB * kV + j * kV);
}

#ifdef ITERSERVE_DPBF16
// The same tile on k-pair packed bf16: x holds each row's bf16 pairs as 32-bit words. Along the way it fetches
// `ahead_lines` cache lines from `ahead` into L2 (AheadLines; see run_blocks), in a loop of its own: with a test
// per k step, GCC spilled the accumulators to the stack.
template <int MR, int NB, int PF>
inline void tile_pairs(const uint32_t* x, int64_t xs, const c10::BFloat16* p, int64_t bstride, int64_t K2, int nb,
                       float* out, const char* ahead, int64_t ahead_lines) {
  __m512 acc[MR][NB];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_ps();
  const c10::BFloat16* blk[NB];
  for (int j = 0; j < NB; ++j) blk[j] = p + std::min(j, nb - 1) * bstride;
  auto step = [&](int64_t k) __attribute__((always_inline)) {
    __m512bh w[NB];
    if constexpr (PF > 0) for (int j = 0; j < NB; ++j) __builtin_prefetch(blk[j] + (k + PF) * 32);
    for (int j = 0; j < NB; ++j) __builtin_prefetch(blk[j] + k * 32 + kFarBytes / 2, 0, 2);
    for (int j = 0; j < NB; ++j) w[j] = (__m512bh)_mm512_loadu_si512(blk[j] + k * 32);
    for (int m = 0; m < MR; ++m) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[m * xs + k]));
      for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xb, w[j]);
    }
  };
  const AheadLines al{ahead, ahead_lines, K2};
  int64_t k = 0;
  for (; k < al.k_steps; ++k) {
    al.fetch(k);
    step(k);
  }
  for (; k < K2; ++k) step(k);
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < nb; ++j) _mm512_storeu_ps(out + m * NB * 16 + j * 16, acc[m][j]);
}
#endif

// y[m, c0 + c] = out[m, c] + bias[c0 + c] for the tile's rows and real columns, rounded to Y.
template <typename Y>
inline void store_rows(const float* out, int64_t out_stride, int rows, int64_t c0, int64_t cols, const float* bias,
                       Y* y, int64_t N) {
  for (int m = 0; m < rows; ++m) {
    Y* yr = y + m * N + c0;
    const float* o = out + m * out_stride;
    for (int64_t c = 0; c < cols; ++c) yr[c] = static_cast<Y>(o[c] + (bias ? bias[c0 + c] : 0.f));
  }
}

// Rows [0, MR) against blocks [b0, b0 + nb) into y (plus bias), through a float tile of NB blocks.
template <typename T, int MR, int NB = nb_for(MR), typename Y>
void rows_tile(const void* xin, int64_t xs, const T* packed, int64_t bstride, int64_t K, int64_t b0, int nb,
               const float* bias, Y* y, int64_t N, const char* ahead, int64_t ahead_lines) {
  alignas(64) float out[MR * NB * kV];
  const T* p = packed + b0 * bstride;
  if constexpr (pairs<T>()) {
#ifdef ITERSERVE_DPBF16
    tile_pairs<MR, NB, prefetch_for(MR)>(static_cast<const uint32_t*>(xin), xs, p, bstride, K, nb, out, ahead,
                                         ahead_lines);
#endif
  } else {
    tile<T, MR, NB, prefetch_for(MR)>(static_cast<const float*>(xin), xs, p, bstride, K, nb, out);
  }
  store_rows(out, NB * kV, MR, b0 * kV, std::min<int64_t>(nb * kV, N - b0 * kV), bias, y, N);
}

#ifdef ITERSERVE_AMX
// AMX: the k-pair blocks are B tiles as they lie (16 k-pairs x 16 columns = 1 KiB contiguous), K2 padded to 16.
constexpr int kAmxRows = 16, kAmxNB = 4;

struct TileConfig {
  uint8_t palette_id = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Linux hands out the AMX tile state only on request, once per process (torch's oneDNN asks the same way).
bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}

// Tiles 0-3: C (rows x 16 floats); 4: A (rows x 32 bf16 of x); 5-7: B (16 k-pairs x 16 columns).
void amx_configure(int rows) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = t < 5 ? rows : 16;
  }
  _tile_loadconfig(&cfg);
}

// out [rows, 4 * 16] = x [rows, 2 * K2] . blocks [b, b + 4) (a short group repeats its last block).
inline void amx_tile(const c10::BFloat16* x, int64_t x_row_bytes, const c10::BFloat16* p, int64_t bstride, int64_t K2,
                     int nb, float* out) {
  const c10::BFloat16* blk[kAmxNB];
  for (int j = 0; j < kAmxNB; ++j) blk[j] = p + std::min(j, nb - 1) * bstride;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t s = 0; s < K2; s += 16) {
    _tile_loadd(4, x + 2 * s, x_row_bytes);
    _tile_loadd(5, blk[0] + 32 * s, 64);
    _tile_loadd(6, blk[1] + 32 * s, 64);
    _tile_loadd(7, blk[2] + 32 * s, 64);
    _tile_dpbf16ps(0, 4, 5);
    _tile_dpbf16ps(1, 4, 6);
    _tile_dpbf16ps(2, 4, 7);
    _tile_loadd(5, blk[3] + 32 * s, 64);
    _tile_dpbf16ps(3, 4, 5);
  }
  constexpr int64_t stride = kAmxNB * 16 * sizeof(float);
  _tile_stored(0, out, stride);
  _tile_stored(1, out + 16, stride);
  _tile_stored(2, out + 32, stride);
  _tile_stored(3, out + 48, stride);
}

// One thread's blocks [b0, b1) for every row, 16 rows at a time, on AMX tiles.
template <typename Y>
void run_blocks_amx(const char* x, int64_t x_row_bytes, int64_t M, const c10::BFloat16* packed, int64_t bstride,
                    int64_t K2, int64_t b0, int64_t b1, const float* bias, Y* y, int64_t N) {
  alignas(64) float out[kAmxRows * kAmxNB * 16];
  int configured = 0;
  for (int64_t g = b0; g < b1; g += kGroup) {
    const int64_t g1 = std::min(b1, g + kGroup);
    for (int64_t r = 0; r < M; r += kAmxRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kAmxRows, M - r));
      if (rows != configured) amx_configure(configured = rows);
      const auto* xr = reinterpret_cast<const c10::BFloat16*>(x + r * x_row_bytes);
      for (int64_t b = g; b < g1; b += kAmxNB) {
        const int nb = static_cast<int>(std::min<int64_t>(kAmxNB, g1 - b));
        amx_tile(xr, x_row_bytes, packed + b * bstride, bstride, K2, nb, out);
        store_rows(out, kAmxNB * 16, rows, b * 16, std::min<int64_t>(nb * 16, N - b * 16), bias, y + r * N, N);
      }
    }
  }
  _tile_release();
}
#endif

// One thread's blocks [b0, b1) for up to 8 rows: the weight streams through once, a register tile at a time.
template <typename T, int MR, typename Y>
void rows_walk(const void* x, int64_t xs, const T* packed, int64_t bstride, int64_t K, int64_t b0, int64_t b1,
               const float* bias, Y* y, int64_t N) {
  constexpr int NB = nb_for(MR);
  for (int64_t b = b0; b < b1; b += NB)
    rows_tile<T, MR>(x, xs, packed, bstride, K, b, static_cast<int>(std::min<int64_t>(NB, b1 - b)), bias, y, N,
                     nullptr, 0);
}

// f.template operator()<MR>() for MR = rows, 1 to 8: the register tile's row count is a template argument.
template <typename F>
inline void with_rows(int64_t rows, F&& f) {
  switch (rows) {
    case 1: f.template operator()<1>(); break;
    case 2: f.template operator()<2>(); break;
    case 3: f.template operator()<3>(); break;
    case 4: f.template operator()<4>(); break;
    case 5: f.template operator()<5>(); break;
    case 6: f.template operator()<6>(); break;
    case 7: f.template operator()<7>(); break;
    default: f.template operator()<8>(); break;
  }
}

}  // namespace

namespace iterserve {

// One thread's blocks [b0, b1) for every row. Up to 8 rows stream the weight once. More rows take it a tile
// at a time, every row group in turn while the tile is in cache, and on k-pairs the row groups share the
// fetch of the next tile into L2, so that the memory stays busy while the later row groups compute (see
// tile): one row group streaming a whole group alone, then the others computing alone, serializes reading
// and computing.
template <typename T, typename Y>
void run_blocks(const char* x, int64_t x_row_bytes, int64_t xs, int64_t M, const T* packed, int64_t bstride,
                int64_t K, int64_t b0, int64_t b1, const float* bias, Y* y, int64_t N) {
  if (M <= kMaxMR) {
    with_rows(M, [&]<int MR>() { rows_walk<T, MR, Y>(x, xs, packed, bstride, K, b0, b1, bias, y, N); });
    return;
  }
  constexpr int NB = nb_for(kBigMR);
  const int64_t row_groups = (M + kBigMR - 1) / kBigMR, block_lines = bstride * static_cast<int64_t>(sizeof(T)) / 64;
  for (int64_t b = b0; b < b1; b += NB) {
    const int nb = static_cast<int>(std::min<int64_t>(NB, b1 - b));
    const char* next = reinterpret_cast<const char*>(packed + (b + NB) * bstride);
    const int64_t next_lines = pairs<T>() ? std::clamp<int64_t>(b1 - b - NB, 0, NB) * block_lines : 0;
    const int64_t per = (next_lines + row_groups - 1) / row_groups;
    for (int64_t r = 0, i = 0; r < M; r += kBigMR, ++i) {
      const int64_t from = std::min(next_lines, i * per), lines = std::min(next_lines, from + per) - from;
      with_rows(std::min<int64_t>(kBigMR, M - r), [&]<int MR>() {
        rows_tile<T, MR, NB>(x + r * x_row_bytes, xs, packed, bstride, K, b, nb, bias, y + r * N, N, next + from * 64,
                             lines);
      });
    }
  }
}

template void run_blocks<float, float>(const char*, int64_t, int64_t, int64_t, const float*, int64_t, int64_t,
                                       int64_t, int64_t, const float*, float*, int64_t);
template void run_blocks<c10::BFloat16, c10::BFloat16>(const char*, int64_t, int64_t, int64_t, const c10::BFloat16*,
                                                       int64_t, int64_t, int64_t, int64_t, const float*,
                                                       c10::BFloat16*, int64_t);
template void run_blocks<c10::Half, c10::Half>(const char*, int64_t, int64_t, int64_t, const c10::Half*, int64_t,
                                               int64_t, int64_t, int64_t, const float*, c10::Half*, int64_t);
template void run_blocks<c10::BFloat16, float>(const char*, int64_t, int64_t, int64_t, const c10::BFloat16*, int64_t,
                                               int64_t, int64_t, int64_t, const float*, float*, int64_t);
template void run_blocks<c10::Half, float>(const char*, int64_t, int64_t, int64_t, const c10::Half*, int64_t,
                                           int64_t, int64_t, int64_t, const float*, float*, int64_t);

}  // namespace iterserve

namespace {

using iterserve::run_blocks;

// Chunk length in blocks, a multiple of `unit` up to `longest`, giving each of `threads` threads at least `per`
// chunks: the longest whose busiest thread gets at most `unit` blocks more than the fewest possible.
inline int64_t balanced_chunk(int64_t blocks, int64_t threads, int64_t per, int64_t unit, int64_t longest) {
  auto busiest = [&](int64_t c) {  // chunks claimed in turn by threads of equal speed
    const int64_t n = (blocks + c - 1) / c, q = n / threads, r = n % threads, last = blocks - (n - 1) * c;
    return threads == 1 ? blocks : r == 0 ? q * c : r >= 2 ? (q + 1) * c : q * c + last;
  };
  auto allowed = [&](int64_t c) { return c == unit || (blocks + c - 1) / c >= per * threads; };
  int64_t fewest = blocks;
  for (int64_t c = unit; c <= longest && allowed(c); c += unit) fewest = std::min(fewest, busiest(c));
  int64_t best = unit;
  for (int64_t c = unit; c <= longest && allowed(c); c += unit)
    if (busiest(c) <= fewest + unit) best = c;
  return best;
}

template <typename T, typename Y>
void packed_linear_impl(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& bias, at::Tensor& y,
                        int64_t amx_min_rows) {
  const int64_t M = x.size(0), K = x.size(1), N = y.size(1);
  const int64_t blocks = packed.size(0), bstride = packed.numel() / blocks, Kw = packed.size(1);
  // x as the kernel reads it: bf16 k-pairs as 32-bit words (K padded as the weight is), or widened to float32.
  at::Tensor xk;
  int64_t xs = K;
  if constexpr (pairs<T>()) {
    xk = Kw * 2 != K ? at::constant_pad_nd(x, {0, Kw * 2 - K}) : x.contiguous();
    xs = Kw;
  } else {
    xk = x.to(at::kFloat).contiguous();
  }
  const char* xp = static_cast<const char*>(xk.data_ptr());
  const int64_t x_row_bytes = xk.stride(0) * xk.element_size();
  const at::Tensor bf = bias.defined() ? bias.to(at::kFloat).contiguous() : bias;
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  const T* wp = packed.data_ptr<T>();
  Y* yp = y.data_ptr<Y>();
  // Up to 8 rows (memory-bound): chunks of whole register tiles, at least four per thread so that a thread that
  // starts late or runs slower leaves less of the weight to the others, at most kGroup blocks, split so that no
  // thread gets more blocks than it must. Chunks of 4 blocks (o and down of SmolLM2, 36 blocks) left 8 rows a
  // short tile a chunk, computing 3 blocks for 1, and one thread a ninth chunk alone (docs/benchmarks-history.md).
  const int64_t threads = iterserve::ChunkPool::get().threads();
  int64_t chunk = balanced_chunk(blocks, threads, 4, nb_for(static_cast<int>(std::min<int64_t>(M, kMaxMR))), kGroup);
  // More rows: whole tiles, at least two chunks a thread, split so that no thread gets more blocks than it
  // must (a chunk's first tile is the one no earlier tile fetched ahead, so the longest such chunks): the
  // small-row chunk sizes, doubled, can leave one thread most of a projection's chunks.
  if (M > kMaxMR) {
    int64_t unit = nb_for(kBigMR);
#ifdef ITERSERVE_AMX
    if (pairs<T>() && M >= amx_min_rows) unit = kAmxNB;
#endif
    chunk = balanced_chunk(blocks, threads, 2, unit, 8 * kGroup);
  }
  iterserve::parallel_chunks(blocks, chunk, [&](int64_t b0, int64_t b1) {
#ifdef ITERSERVE_AMX
    if constexpr (pairs<T>()) {
      if (M >= amx_min_rows && amx_permitted()) {
        run_blocks_amx(xp, x_row_bytes, M, wp, bstride, Kw, b0, b1, bp, yp, N);
        return;
      }
    }
#endif
    run_blocks<T, Y>(xp, x_row_bytes, xs, M, wp, bstride, Kw, b0, b1, bp, yp, N);
  });
}

}  // namespace

// W [N, K] -> the packed layout packed_linear reads: [ceil(N / V), K, V], or [ceil(N / 16), ceil(K / 2), 16, 2]
// for bf16 on a CPU with AVX512-BF16; zero padded.
at::Tensor pack_linear_weight(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2, "pack_linear_weight: a 2-D [N, K] weight expected");
  const int64_t N = w.size(0), K = w.size(1), blocks = (N + kV - 1) / kV;
  bool use_pairs = false;
  AT_DISPATCH_SWITCH(w.scalar_type(), "pack_linear_weight",
                     AT_DISPATCH_CASE(at::kFloat, [&] { use_pairs = pairs<scalar_t>(); })
                     AT_DISPATCH_CASE(at::kBFloat16, [&] { use_pairs = pairs<scalar_t>(); })
                     AT_DISPATCH_CASE(at::kHalf, [&] { use_pairs = pairs<scalar_t>(); }));
  if (use_pairs) {
    const int64_t K2 = ((K + 1) / 2 + kPairAlign - 1) / kPairAlign * kPairAlign;
    at::Tensor padded = at::constant_pad_nd(w, {0, K2 * 2 - K, 0, blocks * kV - N});
    return padded.view({blocks, kV, K2, 2}).permute({0, 2, 1, 3}).contiguous();
  }
  at::Tensor padded = at::constant_pad_nd(w, {0, 0, 0, blocks * kV - N});
  return padded.view({blocks, kV, K}).transpose(1, 2).contiguous();
}

// x [M, K] @ W^T (+ bias) -> [M, N] in x's dtype (float32 with float_out: logits not rounded to bf16, whose
// steps tie close candidates), W given as pack_linear_weight(W).
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N, const c10::optional<at::Tensor>& bias,
                         int64_t amx_min_rows, bool float_out) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "packed_linear: x [rows, K] with contiguous rows expected");
  TORCH_CHECK(packed.scalar_type() == x.scalar_type() && packed.is_contiguous(), "packed_linear: weight dtype != x");
  TORCH_CHECK(packed.size(0) == (N + kV - 1) / kV && (packed.size(1) == x.size(1) || (packed.dim() == 4 &&
              packed.size(1) * 2 >= x.size(1) && packed.size(1) * 2 < x.size(1) + 2 * kPairAlign)),
              "packed_linear: weight packed for another shape or vector width");
  const at::Tensor b = bias.has_value() ? *bias : at::Tensor();
  TORCH_CHECK(!b.defined() || b.numel() == N, "packed_linear: bias must have N elements");
  const bool to_float = float_out && x.scalar_type() != at::kFloat;
  at::Tensor y = at::empty({x.size(0), N}, to_float ? x.options().dtype(at::kFloat) : x.options());
  if (x.size(0) == 0) return y;
  AT_DISPATCH_SWITCH(x.scalar_type(), "packed_linear",
    AT_DISPATCH_CASE(at::kFloat, [&] { packed_linear_impl<scalar_t, scalar_t>(x, packed, b, y, amx_min_rows); })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      if (to_float) packed_linear_impl<scalar_t, float>(x, packed, b, y, amx_min_rows);
      else packed_linear_impl<scalar_t, scalar_t>(x, packed, b, y, amx_min_rows);
    })
    AT_DISPATCH_CASE(at::kHalf, [&] {
      if (to_float) packed_linear_impl<scalar_t, float>(x, packed, b, y, amx_min_rows);
      else packed_linear_impl<scalar_t, scalar_t>(x, packed, b, y, amx_min_rows);
    }));
  return y;
}

TORCH_LIBRARY_FRAGMENT(iterserve, m) {
  m.def("pack_linear_weight(Tensor w) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor packed, int N, Tensor? bias=None, int amx_min_rows=8, bool float_out=False) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(iterserve, CPU, m) {
  m.impl("pack_linear_weight", &pack_linear_weight);
  m.impl("packed_linear", &packed_linear);
}
