// Paged decode attention: each query attends its sequence's K/V read from the cache's blocks in place, a
// tile of keys at a time with an online softmax, a long context split into fixed pieces merged after. The
// inner loops are in attention_loops.h and attention_bf16.h; the KV-cache write is kv_write.cpp's. Every op
// has a PyTorch reference path (iterserve/attention/reference.py).
//
// All arithmetic is float32 with one rounding to the storage dtype at the end; bf16 decode attention on a
// CPU with AVX512-BF16 also rounds its softmax weights to bf16 for P . V, as PyTorch's CPU attention does.

#include <torch/library.h>

#include <ATen/Parallel.h>

#include "attention_bf16.h"
#include "attention_loops.h"
#include "ops.h"
#include "parallel.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using namespace iterserve_attention;

template <typename T>
struct GroupKernels {
  void (*scores)(const float*, const T* const*, int64_t, int64_t, float*, RowPrefetch<T>&);
  void (*values)(const float*, const T* const*, int64_t, int64_t, float*);
};

// On AVX512-BF16, a bf16 group of dim 64 (1-8 heads) or 128 (1-4 heads) takes P . V on k-pairs.
template <typename T>
inline void use_pair_kernels([[maybe_unused]] GroupKernels<T>& k, [[maybe_unused]] int64_t group,
                             [[maybe_unused]] int64_t dim) {
#if defined(ITERSERVE_DPBF16) && defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    using Values = decltype(k.values);
    static constexpr Values v64[] = {group_values_pairs<1, 2>, group_values_pairs<2, 2>, group_values_pairs<3, 2>,
                                     group_values_pairs<4, 2>, group_values_pairs<5, 2>, group_values_pairs<6, 2>,
                                     group_values_pairs<7, 2>, group_values_pairs<8, 2>};
    static constexpr Values v128[] = {group_values_pairs<1, 4>, group_values_pairs<2, 4>, group_values_pairs<3, 4>,
                                      group_values_pairs<4, 4>};
    if (dim == 64) {
      k.values = v64[group - 1];
    } else if (dim == 128 && group <= 4) {
      k.values = v128[group - 1];
    }
  }
#endif
}

// The register-blocked kernels for groups of 1-8 heads and whole vectors; {nullptr, nullptr} for the rest,
// which take the per-head loops.
template <typename T>
inline GroupKernels<T> group_kernels(int64_t group, int64_t dim) {
  static constexpr GroupKernels<T> table[] = {
      {group_scores<1, T>, group_values<1, T>}, {group_scores<2, T>, group_values<2, T>},
      {group_scores<3, T>, group_values<3, T>}, {group_scores<4, T>, group_values<4, T>},
      {group_scores<5, T>, group_values<5, T>}, {group_scores<6, T>, group_values<6, T>},
      {group_scores<7, T>, group_values<7, T>}, {group_scores<8, T>, group_values<8, T>}};
  if (group < 1 || group > 8 || dim % kVecSize != 0) return {nullptr, nullptr};
  GroupKernels<T> k = table[group - 1];
  use_pair_kernels(k, group, dim);
  return k;
}

// Keys per piece of a context split across threads. Fixed, not sized to the batch: a row's sums then run in one
// order alone or batched (a piece's merge alone equals the unsplit path bit for bit).
constexpr int64_t kPiece = 128;

// Where one head's K or V rows [from, to) lie, walking the block table a block at a time: a division per
// row, four times per key (two prefetches, two reads), was a large share of a decode task's time.
template <typename T>
inline void head_rows(const T* cache, const int64_t* table, int64_t block_size, int64_t s0, int64_t s2,
                      int64_t head_offset, int64_t from, int64_t to, const T** rows) {
  int64_t b = from / block_size, off = from % block_size;
  for (int64_t pos = from; pos < to; ++b, off = 0) {
    const T* base = cache + table[b] * s0 + head_offset;
    for (; off < block_size && pos < to; ++off, ++pos) *rows++ = base + off * s2;
  }
}

// Ask for n rows ahead of use. At batch 1 the step streams the weights between two layers' attention, so
// every layer's K/V comes from DRAM; fetched on demand, each row's latency is paid in turn, many times the
// time its bytes take at the streaming read rate.
template <typename T, int Locality = 3>
inline void prefetch_rows(const T* const* rows, int64_t n, int64_t row_bytes) {
  for (int64_t j = 0; j < n; ++j)
    for (int64_t b = 0; b < row_bytes; b += 64)
      __builtin_prefetch(reinterpret_cast<const char*>(rows[j]) + b, 0, Locality);
}

// A tile walk's per-thread state: the query widened, the running output, max and sum of exps of each head of
// the GQA group, and the K/V rows of this tile, the next, the one after it and the next task's first.
template <typename T>
struct TileWalk {
  float *qf, *acc, *rows, *scores, *m, *l;
  const T* krows[2][kTile];  // this tile's keys and values, and the next tile's
  const T* vrows[2][kTile];
  const T* far_k[kTile];  // the tile after the next one
  const T* far_v[kTile];
  const T* ahead_k[kTile];  // the next task's first tile, found and asked for by the task before it
  const T* ahead_v[kTile];
  int64_t ahead_n = 0;
};

// The task after this one in the chunk: its sequence, head and keys, and whether its second tile is still to ask for.
struct NextTask {
  int64_t s = 0, h = 0, lo = 0, hi = 0;
  bool far = false;
};

// One decode attention over paged K/V: a task per (sequence, KV head, piece of its context) reads its head's K/V
// once for the whole GQA group. Pieces of kPiece keys also keep every thread busy at small batches (3 pairs for
// SmolLM2 at batch 1); their partial softmaxes are merged after, empty ones (shorter contexts) weighing nothing.
template <typename T>
struct PagedDecode {
  const T *q_ptr, *k_ptr, *v_ptr;
  T* out_ptr;
  const int64_t *tables, *ctx_lens;
  int64_t seqs, heads, dim, kv_heads, block_size, group, sliding_window;
  int64_t q_s0, q_s1, o_s0, o_s1, kc_s0, kc_s1, kc_s2, vc_s0, vc_s1, vc_s2, table_stride, row_bytes;
  bool keyed;  // K in key groups
  float fscale;
  int64_t splits = 1, pstride = 0;
  float* partial = nullptr;  // per (sequence, head, piece): the running max, the sum of exps, the output
  GroupKernels<T> blocked{};

  int64_t first_key(int64_t s) const {
    return sliding_window > 0 ? std::max<int64_t>(0, ctx_lens[s] - sliding_window) : int64_t{0};
  }

  // Task -> its sequence, KV head and key range [lo, hi).
  void span(int64_t task, int64_t& s, int64_t& h, int64_t& lo, int64_t& hi) const {
    s = task / (kv_heads * splits);
    h = (task / splits) % kv_heads;
    lo = first_key(s) + (task % splits) * kPiece;
    hi = std::min(ctx_lens[s], lo + kPiece);
  }

  // Where keys and values [from, to) of sequence s's head h lie in the caches.
  void key_rows(int64_t s, int64_t h, int64_t from, int64_t to, const T** out) const {
    head_rows(k_ptr, tables + s * table_stride, block_size, kc_s0, kc_s2, h * kc_s1, from, to, out);
  }
  void value_rows(int64_t s, int64_t h, int64_t from, int64_t to, const T** out) const {
    head_rows(v_ptr, tables + s * table_stride, block_size, vc_s0, vc_s2, h * vc_s1, from, to, out);
  }

  // Sequence s's head h, keys [from, to) (at most a tile), asked for into L2 all at once.
  void into_l2(TileWalk<T>& w, int64_t s, int64_t h, int64_t from, int64_t to) const {
    if (to <= from) return;
    key_rows(s, h, from, to, w.far_k);
    value_rows(s, h, from, to, w.far_v);
    prefetch_rows<T, 2>(w.far_k, to - from, row_bytes);
    prefetch_rows<T, 2>(w.far_v, to - from, row_bytes);
  }

  // The tasks of a chunk run in order, so a task asks for the next one's first tile of K and V as it starts:
  // a task that started cold waited on DRAM for it.
  void run(int64_t begin, int64_t end) const {
    thread_local std::vector<float> scratch;  // per thread, grown once: a malloc per task showed at batch 64
    scratch.resize(2 * group * dim + kTile * dim + group * kTile + 2 * group);
    TileWalk<T> w;
    w.qf = scratch.data();
    w.acc = w.qf + group * dim;
    w.rows = w.acc + group * dim;
    w.scores = w.rows + kTile * dim;
    w.m = w.scores + group * kTile;
    w.l = w.m + group;
    for (int64_t task = begin; task < end; ++task) attend(w, task, task == begin, task + 1 < end);
  }

  void attend(TileWalk<T>& w, int64_t task, bool cold, bool has_next) const {
    int64_t s, h, lo, hi;
    span(task, s, h, lo, hi);
    const int64_t first = std::max<int64_t>(0, std::min(hi, lo + kTile) - lo);
    if (cold) {
      key_rows(s, h, lo, lo + first, w.krows[0]);
      value_rows(s, h, lo, lo + first, w.vrows[0]);
      prefetch_rows(w.krows[0], first, row_bytes);
      prefetch_rows(w.vrows[0], first, row_bytes);
    } else {
      std::copy(w.ahead_k, w.ahead_k + first, w.krows[0]);
      std::copy(w.ahead_v, w.ahead_v + first, w.vrows[0]);
    }
    w.ahead_n = 0;
    NextTask next;
    if (has_next) {  // asked for during this task's last tile
      span(task + 1, next.s, next.h, next.lo, next.hi);
      next.far = true;
      w.ahead_n = std::max<int64_t>(0, std::min(next.hi, next.lo + kTile) - next.lo);
      key_rows(next.s, next.h, next.lo, next.lo + w.ahead_n, w.ahead_k);
      value_rows(next.s, next.h, next.lo, next.lo + w.ahead_n, w.ahead_v);
    }
    const T* q_group = q_ptr + s * q_s0 + h * group * q_s1;
    if (!keyed) {  // the float kernels' query: widened and scaled
      for (int64_t g = 0; g < group; ++g) {
        to_float(q_group + g * q_s1, w.qf + g * dim, dim);
        scale_(w.qf + g * dim, fscale, dim);
      }
    }
    std::fill(w.acc, w.acc + group * dim, 0.f);
    std::fill(w.m, w.m + group, -std::numeric_limits<float>::infinity());
    std::fill(w.l, w.l + group, 0.f);
    for (int64_t t0 = lo, cur = 0; t0 < hi; t0 += kTile, cur ^= 1) tile(w, s, h, t0, hi, cur, q_group, next);
    store(w, s, h, task);
  }

  void tile(TileWalk<T>& w, int64_t s, int64_t h, int64_t t0, int64_t hi, int64_t cur, const T* q_group,
            NextTask& next_task) const {
    const int64_t n = std::min(kTile, hi - t0);
    // The next tile's K and V (the next task's first, after the last) arrive while this tile is computed.
    const int64_t next = std::min(hi, t0 + n + kTile);
    key_rows(s, h, t0 + n, next, w.krows[cur ^ 1]);
    value_rows(s, h, t0 + n, next, w.vrows[cur ^ 1]);
    RowPrefetch<T> pf = next > t0 + n ? RowPrefetch<T>{w.krows[cur ^ 1], w.vrows[cur ^ 1], next - t0 - n, row_bytes}
                                      : RowPrefetch<T>{w.ahead_k, w.ahead_v, w.ahead_n, row_bytes};
    // The tile after that into L2, all at once, so that the next tile's fetch finds it there rather than
    // DRAM (docs/cpu.md, "Keeping the memory busy"); past this task's end, the next task's second tile.
    if (next < hi) {
      into_l2(w, s, h, next, std::min(hi, next + kTile));
    } else if (next_task.far) {
      next_task.far = false;
      into_l2(w, next_task.s, next_task.h, next_task.lo + w.ahead_n,
              std::min(next_task.hi, next_task.lo + w.ahead_n + kTile));
    }
    scores(w, cur, n, t0, q_group, pf);
    for (int64_t g = 0; g < group; ++g) {
      float* sc = w.scores + g * kTile;
      const float new_m = std::max(w.m[g], max_of(sc, n));
      const float correction = std::exp(w.m[g] - new_m);  // 0 on the first tile (m = -inf)
      w.l[g] = w.l[g] * correction + exp_sum_(sc, new_m, n);
      if (correction != 1.f) scale_(w.acc + g * dim, correction, dim);  // 1 once the tiles' max settles
      w.m[g] = new_m;
    }
    if (blocked.values != nullptr) {
      blocked.values(w.scores, w.vrows[cur], n, dim, w.acc);
      return;
    }
    for (int64_t j = 0; j < n; ++j) to_float(w.vrows[cur][j], w.rows + j * dim, dim);
    for (int64_t g = 0; g < group; ++g)
      for (int64_t j = 0; j < n; ++j) axpy(w.acc + g * dim, w.scores[g * kTile + j], w.rows + j * dim, dim);
  }

  void scores(TileWalk<T>& w, int64_t cur, int64_t n, int64_t t0, [[maybe_unused]] const T* q_group,
              RowPrefetch<T>& pf) const {
    if (keyed) {
#if defined(ITERSERVE_DPBF16) && defined(CPU_CAPABILITY_AVX512)
      if constexpr (std::is_same_v<T, c10::BFloat16>)
        scores_keyed(q_group, q_s1, w.krows[cur], t0 % kKeyGroup, n, dim, group, fscale, w.scores, pf);
#endif
    } else if (blocked.scores != nullptr) {
      blocked.scores(w.qf, w.krows[cur], n, dim, w.scores, pf);
    } else {
      pf.rest();
      for (int64_t j = 0; j < n; ++j) to_float(w.krows[cur][j], w.rows + j * dim, dim);
      for (int64_t g = 0; g < group; ++g)
        for (int64_t j = 0; j < n; ++j) w.scores[g * kTile + j] = dot(w.qf + g * dim, w.rows + j * dim, dim);
    }
  }

  // A whole context normalised into out; a piece of one kept for the merge.
  void store(const TileWalk<T>& w, int64_t s, int64_t h, int64_t task) const {
    for (int64_t g = 0; g < group; ++g) {
      if (splits == 1) {
        scale_(w.acc + g * dim, 1.f / w.l[g], dim);
        from_float(w.acc + g * dim, out_ptr + s * o_s0 + (h * group + g) * o_s1, dim);
        continue;
      }
      float* p = partial + ((s * heads + h * group + g) * splits + task % splits) * pstride;
      p[0] = w.m[g];  // -inf for an empty piece (a shorter context than the longest): it weighs nothing
      p[1] = w.l[g];
      std::copy(w.acc + g * dim, w.acc + (g + 1) * dim, p + 2);
    }
  }

  // Merge the pieces of each (sequence, head): rescale each to the largest max and normalise once.
  void merge() const { merge_pieces(partial, seqs, heads, splits, dim, out_ptr, o_s0, o_s1); }
};

template <typename T>
void paged_decode_impl(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                       int64_t sliding_window) {
  const bool keyed = k_cache.dim() == 6;
  const int64_t dim = q.size(2), kv_heads = v_cache.size(1);
  PagedDecode<T> d{q.data_ptr<T>(), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(), out.data_ptr<T>(),
                   block_tables.data_ptr<int64_t>(), context_lens.data_ptr<int64_t>(),
                   q.size(0), q.size(1), dim, kv_heads, v_cache.size(2), q.size(1) / kv_heads, sliding_window,
                   q.stride(0), q.stride(1), out.stride(0), out.stride(1),
                   // in key groups, key t of a block's head lies in the group that starts where row t would
                   k_cache.stride(0), k_cache.stride(1), keyed ? dim : k_cache.stride(2),
                   v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
                   dim * static_cast<int64_t>(sizeof(T)), keyed, static_cast<float>(scale)};
  int64_t longest = 0;
  for (int64_t s = 0; s < d.seqs; ++s) longest = std::max(longest, d.ctx_lens[s] - d.first_key(s));
  d.splits = std::max<int64_t>(1, (longest + kPiece - 1) / kPiece);
  d.pstride = dim + 2;
  std::vector<float> partial(d.splits > 1 ? d.seqs * d.heads * d.splits * d.pstride : 0);
  d.partial = partial.data();
  d.blocked = group_kernels<T>(d.group, dim);
  // Four chunks a thread, as for the matmuls.
  const int64_t tasks = d.seqs * kv_heads * d.splits;
  const int64_t chunk = std::max<int64_t>(1, tasks / (4 * iterserve::ChunkPool::get().threads()));
  iterserve::parallel_chunks(tasks, chunk, [&](int64_t begin, int64_t end) { d.run(begin, end); });
  if (d.splits > 1) d.merge();
}

}  // namespace

// out[s, head] = softmax(q[s, head] . K_s^T * scale) V_s over the context of sequence s, K_s/V_s read
// from the blocks listed in block_tables[s]; sliding_window <= 0 means no window.
void paged_decode(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                  int64_t sliding_window) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && out.stride(2) == 1, "q/out must be [seqs, heads, head_dim]");
  check_caches(q, q, k_cache, v_cache);
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "heads must be a multiple of kv_heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "block tables and context lengths must be int64");
  TORCH_CHECK(block_tables.stride(1) == 1 && context_lens.is_contiguous(), "block tables must be row-major");
  DISPATCH_FLOAT_TYPES(q.scalar_type(), "paged_decode", [&] {
    paged_decode_impl<scalar_t>(out, q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window);
  });
}

TORCH_LIBRARY_FRAGMENT(iterserve, m) {
  m.def("paged_decode(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor context_lens, float scale, int sliding_window) -> ()");
}

TORCH_LIBRARY_IMPL(iterserve, CPU, m) { m.impl("paged_decode", &paged_decode); }
