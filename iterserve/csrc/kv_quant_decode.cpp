// Paged decode attention over a quantized KV cache (kv_quant.h has the kinds and the paths): each (sequence,
// KV head) attends its context tile by tile, in fixed 128-key pieces merged after, each tile's bytes widened by
// the widest path the isa and head dim allow.

#include <torch/library.h>

#include <ATen/Dispatch.h>

#include "attention_loops.h"
#include "kv_quant.h"
#include "kv_quant_registers.h"
#include "kv_quant_tiles.h"
#include "ops.h"
#include "parallel.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using namespace iterserve_kv_quant;

// How a tile's bytes become numbers: widened a tile at a time into L1 (any isa, any dim), widened in registers
// to float32 (AVX2 or AVX-512, dim % 64 == 0), or to bf16 for vdpbf16ps (a bf16 query, isa 4, dim % 64 == 0).
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
#if defined(KV_QUANT_FUSED_AVX2)
    if (isa >= kAvx2 && dim % 64 == 0) return kInRegisters;
#endif
    return kWidenTile;
  }
#if defined(KV_QUANT_FUSED_AVX2)
  // The register kernels (kInRegisters) of this isa for a group of up to 4 heads.
  const FusedKernels& fused_kernels(int64_t heads) const {
#if defined(__AVX512F__) && defined(__AVX2__)
    if (isa >= kAvx512) return fused(kind, heads);
#endif
    return fused_avx2(kind, heads);
  }
#endif
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
#if defined(KV_QUANT_FUSED_AVX2)
  const bool fused = a.path != kWidenTile;
  if (a.path == kInRegisters)
    for (int64_t g = 0; g < group; g += 4)
      a.fused_kernels(std::min<int64_t>(4, group - g)).scores(qf + g * dim, dim, w.krows, w.k_scale, n,
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
#if defined(KV_QUANT_FUSED_AVX2)
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
      a.fused_kernels(heads).values(scores + g * kTile, w.vrows, n, dim, acc + g * dim);
    }
    return;
  }
#endif
  for (int64_t j = 0; j < n; ++j)
    widen_row(a.isa, w.vrows[j], w.rows + j * dim, dim, a.kind, a.v.scale ? w.v_scale[j] : 1.f);
  tile_values(scores, w.rows, n, dim, group, kTile, acc);
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
  if (splits > 1) iterserve_attention::merge_pieces(partial.data(), seqs, heads, splits, dim, op, o_s0, o_s1);
}

}  // namespace

using namespace iterserve_kv_quant;

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
  DISPATCH_FLOAT_TYPES(q.scalar_type(), "paged_decode_quant", [&] { decode_impl<scalar_t>(out, q, a); });
}

TORCH_LIBRARY_FRAGMENT(iterserve, m) {
  m.def("paged_decode_quant(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor? k_scale, "
        "Tensor? v_scale, Tensor block_tables, Tensor context_lens, float scale, int sliding_window, int isa=0) -> ()");
  // Widest path built: 1 scalar, 2 AVX2 + F16C, 3 AVX-512, 4 AVX512-BF16 (bf16 queries)
  m.def("kv_quant_best_isa() -> int", &best_isa);
}

TORCH_LIBRARY_IMPL(iterserve, CPU, m) { m.impl("paged_decode_quant", &paged_decode_quant); }
