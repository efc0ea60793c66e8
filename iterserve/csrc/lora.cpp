// A step's LoRA products (vLLM's punica SGMV on the CPU): the base matmul has run once for every row, and each
// row then gets its own adapter's (x @ A^T) @ B^T. Rows are grouped by adapter (slot), so that each group
// multiplies its own adapter's weights only, packed as the dense layers' weights are (pack_linear_weight) and
// multiplied by their kernel (linear.h's run_blocks) on the kernels' thread pool. A fused layer (qkv, gate/up)
// holds an adapter's parts side by side: their A one above the other, their B block-diagonal. B comes as its
// parts, each multiplying only its own ranks of the shrunk rows into its own output columns, so that the expand
// never multiplies B's zero blocks.

#include <torch/extension.h>

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include "linear.h"
#include "ops.h"
#include "parallel.h"

#include <algorithm>
#include <vector>

namespace {

using iterserve::kGroup;
using iterserve::kV;
using iterserve::pairs;

// One B part: slot's shrunk columns from rank0 on, into out's columns [col0, col0 + cols).
struct Part {
  int64_t slot, rank0, col0, cols;
  const at::Tensor* b;
};

// One pool task: grouped rows [r0, r1), all under one slot, by blocks [b0, b1) of one weight (item: a slot's A
// in the shrink, a B part in the expand).
struct Task {
  int64_t item, r0, r1, b0, b1;
};

constexpr int64_t kTaskRows = 64;  // rows a task: a prompt chunk's rows split across the pool, a decode step's not

// Tasks over the grouped rows [start[s], start[s + 1]) of item i's slot s = slot_of[i], by its blocks[i] blocks.
std::vector<Task> tasks_of(const std::vector<int64_t>& start, const std::vector<int64_t>& slot_of,
                           const std::vector<int64_t>& blocks) {
  std::vector<Task> tasks;
  for (size_t i = 0; i < blocks.size(); ++i) {
    const int64_t s = slot_of[i];
    for (int64_t r = start[s]; r < start[s + 1]; r += kTaskRows)
      for (int64_t b = 0; b < blocks[i]; b += kGroup)
        tasks.push_back({static_cast<int64_t>(i), r, std::min(start[s + 1], r + kTaskRows), b,
                         std::min(blocks[i], b + kGroup)});
  }
  return tasks;
}

// x [rows, K] as the kernel reads it (see packed_linear): bf16 k-pairs padded as `packed`'s K, or float32.
template <typename T>
at::Tensor kernel_rows(const at::Tensor& x, const at::Tensor& packed) {
  if constexpr (pairs<T>()) {
    const int64_t Kw = packed.size(1);
    return Kw * 2 != x.size(1) ? at::constant_pad_nd(x, {0, Kw * 2 - x.size(1)}) : x.contiguous();
  }
  return x.to(at::kFloat).contiguous();
}

// Rows [r0, r1) of xk (kernel_rows), from its column k0 on, @ blocks [b0, b1) of w's blocks from block w0 on,
// into y[r - r0, b * kV + c] for the columns below N, y's row stride.
template <typename T>
void run_rows(const at::Tensor& xk, int64_t k0, int64_t r0, int64_t r1, const at::Tensor& w, int64_t w0, int64_t b0,
              int64_t b1, T* y, int64_t N) {
  const int64_t x_bytes = xk.stride(0) * xk.element_size(), xs = pairs<T>() ? xk.stride(0) / 2 : xk.stride(0);
  const int64_t bstride = w.numel() / w.size(0);
  const char* x = static_cast<const char*>(xk.data_ptr()) + r0 * x_bytes + k0 * xk.element_size();
  iterserve::run_blocks<T>(x, x_bytes, xs, r1 - r0, w.data_ptr<T>() + w0 * bstride, bstride, w.size(1), b0, b1,
                           nullptr, y, N);
}

// shrunk [grouped rows, width] = each slot's grouped rows of xk @ its A^T (columns past its rank stay zero).
template <typename T>
void shrink(const at::Tensor& xk, const std::vector<const at::Tensor*>& a, const std::vector<int64_t>& start,
            at::Tensor& shrunk) {
  const int64_t S = static_cast<int64_t>(a.size()), width = shrunk.size(1);
  std::vector<int64_t> slot_of(S), blocks(S, 0);
  for (int64_t s = 0; s < S; ++s) {
    slot_of[s] = s;
    if (a[s]) blocks[s] = std::min(a[s]->size(0), (width + kV - 1) / kV);  // columns no B part reads: not needed
  }
  const auto tasks = tasks_of(start, slot_of, blocks);
  T* y = shrunk.data_ptr<T>();
  iterserve::parallel_chunks(static_cast<int64_t>(tasks.size()), 1, [&](int64_t t0, int64_t t1) {
    for (const Task* t = &tasks[t0]; t != &tasks[0] + t1; ++t)
      run_rows<T>(xk, 0, t->r0, t->r1, *a[t->item], 0, t->b0, t->b1, y + t->r0 * width, width);
  });
}

// o[c] += d[c] for c < n, rounded as torch's out + y rounds it: in float32, once to T.
template <typename T>
void add_to(T* o, const T* d, int64_t n) {
  using VT = at::vec::Vectorized<T>;
  int64_t c = 0;
  for (; c + VT::size() <= n; c += VT::size()) {
    if constexpr (std::is_same_v<T, float>) {
      (VT::loadu(o + c) + VT::loadu(d + c)).store(o + c);
    } else {
      const auto [o0, o1] = at::vec::convert_to_float<T>(VT::loadu(o + c));
      const auto [d0, d1] = at::vec::convert_to_float<T>(VT::loadu(d + c));
      at::vec::convert_from_float<T>(o0 + d0, o1 + d1).store(o + c);
    }
  }
  for (; c < n; ++c) o[c] = static_cast<T>(static_cast<float>(o[c]) + static_cast<float>(d[c]));
}

// out[rows[r]] += each B part's product of grouped row r's shrunk ranks, rounded to T, in its own columns.
template <typename T>
void expand(const at::Tensor& sk, const std::vector<Part>& parts, const std::vector<int64_t>& start,
            const std::vector<int64_t>& rows, at::Tensor& out) {
  std::vector<int64_t> slot_of, blocks;
  for (const Part& p : parts) {
    slot_of.push_back(p.slot);
    blocks.push_back(p.b->size(0));
  }
  const auto tasks = tasks_of(start, slot_of, blocks);
  const int64_t N = out.size(1);
  T* op = out.data_ptr<T>();
  iterserve::parallel_chunks(static_cast<int64_t>(tasks.size()), 1, [&](int64_t t0, int64_t t1) {
    alignas(64) T y[kTaskRows * kGroup * kV];  // a task's product, [rows, n]: tasks never share it
    for (const Task* t = &tasks[t0]; t != &tasks[0] + t1; ++t) {
      const Part& p = parts[t->item];
      const int64_t c0 = t->b0 * kV, n = std::min((t->b1 - t->b0) * kV, p.cols - c0);
      run_rows<T>(sk, p.rank0, t->r0, t->r1, *p.b, t->b0, 0, t->b1 - t->b0, y, n);
      for (int64_t r = t->r0; r < t->r1; ++r) add_to(op + rows[r] * N + p.col0 + c0, y + (r - t->r0) * n, n);
    }
  });
}

// Checks each slot's A and each B part against x, out and each other; the B parts, and the shrunk rows' width
// (as wide as the widest B part reads them: k-pairs read their padded rank).
template <typename T>
std::vector<Part> checked_parts(const at::Tensor& x, const at::Tensor& out, const std::vector<const at::Tensor*>& a,
                                const std::vector<at::Tensor>& b, const std::vector<int64_t>& parts,
                                int64_t& width) {
  const int64_t S = static_cast<int64_t>(a.size()), N = out.size(1), dims = pairs<T>() ? 4 : 3;
  const int64_t pair = pairs<T>() ? 2 : 1;
  TORCH_CHECK(parts.size() == 4 * b.size(), "lora_add_: four numbers per B part expected (its slot, first rank "
                                            "column, first output column and output columns)");
  std::vector<Part> out_parts;
  std::vector<int64_t> first(S, -1);
  for (int64_t s = 0; s < S; ++s) {
    if (!a[s]) continue;
    TORCH_CHECK(a[s]->dim() == dims && a[s]->is_contiguous() && a[s]->size(1) * pair >= x.size(1) &&
                    a[s]->size(1) * pair < x.size(1) + pair * iterserve::kPairAlign,
                "lora_add_: slot ", s, "'s A is not packed by pack_linear_weight for this layer (or for another ",
                "in_features than x's ", x.size(1), ")");
  }
  width = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    const Part p{parts[4 * i], parts[4 * i + 1], parts[4 * i + 2], parts[4 * i + 3], &b[i]};
    TORCH_CHECK(p.slot >= 0 && p.slot < S && a[p.slot], "lora_add_: B part ", i, "'s slot ", p.slot,
                " has no A: a slot has A or B alone");
    TORCH_CHECK(b[i].scalar_type() == x.scalar_type(), "lora_add_: B part ", i, " is not in x's dtype");
    TORCH_CHECK(p.col0 >= 0 && p.cols > 0 && p.col0 + p.cols <= N && b[i].dim() == dims && b[i].is_contiguous() &&
                    b[i].size(0) == (p.cols + kV - 1) / kV,
                "lora_add_: B part ", i, " is not packed by pack_linear_weight for its ", p.cols,
                " output columns from ", p.col0, " of out's ", N);
    TORCH_CHECK(p.rank0 >= 0 && p.rank0 % pair == 0, "lora_add_: B part ", i, " starts at rank column ", p.rank0,
                pair == 2 ? "; bf16 k-pairs need an even one" : "");
    for (const Part& q : out_parts)
      TORCH_CHECK(q.slot != p.slot || q.col0 >= p.col0 + p.cols || p.col0 >= q.col0 + q.cols,
                  "lora_add_: slot ", p.slot, "'s B parts overlap in out's columns");
    width = std::max(width, p.rank0 + b[i].size(1) * pair);
    first[p.slot] = i;
    out_parts.push_back(p);
  }
  for (int64_t s = 0; s < S; ++s)
    TORCH_CHECK(!a[s] || first[s] >= 0, "lora_add_: slot ", s, " has A or B alone");
  return out_parts;
}

// lora_add_ on the rows grouped by slot: grouped row i is out's row rows[i], slot s's rows start at start[s].
template <typename T>
void lora_add_impl(at::Tensor& out, const at::Tensor& x, const std::vector<const at::Tensor*>& a,
                   const std::vector<at::Tensor>& b, const std::vector<int64_t>& parts,
                   const std::vector<int64_t>& rows, const std::vector<int64_t>& start) {
  int64_t width = 0;
  const auto ps = checked_parts<T>(x, out, a, b, parts, width);
  if (rows.empty()) return;
  const bool same = static_cast<int64_t>(rows.size()) == x.size(0) && std::is_sorted(rows.begin(), rows.end());
  const at::Tensor xg = same ? x : x.index_select(0, at::tensor(rows, at::kLong));
  const at::Tensor* a0 = *std::find_if(a.begin(), a.end(), [](const at::Tensor* t) { return t != nullptr; });
  // Zero past each slot's rank, where the products of A's zero padding leave it (and B's k padding is zero).
  at::Tensor shrunk = at::zeros({static_cast<int64_t>(rows.size()), width}, out.options());
  shrink<T>(kernel_rows<T>(xg, *a0), a, start, shrunk);
  expand<T>(pairs<T>() ? shrunk : shrunk.to(at::kFloat), ps, start, rows, out);
}

}  // namespace

// out[r] += (x[r] @ A_s^T) @ B_s^T, each product rounded to out's dtype, for every row r under a slot s
// (row_slots[r]; none given: every row is under slot 0) whose a[s] is given; a row under -1 or under a slot
// without weights gets nothing. a[s]: pack_linear_weight of A_s [rank, in]. B_s comes as parts: b[i] is
// pack_linear_weight of B_s's block [cols, ranks], and parts[4 i .. 4 i + 4) say (s, its first rank column,
// its first output column, cols); the rest of B_s is zero. A row's values depend on that row alone, not on the
// others nor on the threads.
at::Tensor lora_add_(at::Tensor out, const at::Tensor& x, const std::vector<c10::optional<at::Tensor>>& a,
                     const std::vector<at::Tensor>& b, const std::vector<int64_t>& parts,
                     const c10::optional<at::Tensor>& row_slots) {
  const int64_t S = static_cast<int64_t>(a.size()), M = x.size(0);
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && out.size(0) == M && out.is_contiguous(),
              "lora_add_: x [rows, in] and a contiguous out [rows, out] with as many rows expected");
  TORCH_CHECK(x.scalar_type() == out.scalar_type(), "lora_add_: x and out differ in dtype");
  std::vector<const at::Tensor*> pa(S, nullptr);
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(!a[s].has_value() || a[s]->scalar_type() == x.scalar_type(),
                "lora_add_: slot ", s, "'s A is not in x's dtype");
    pa[s] = a[s].has_value() ? &*a[s] : nullptr;
  }
  std::vector<int64_t> slot(M, 0);
  if (row_slots.has_value()) {
    const at::Tensor rs = row_slots->to(at::kLong).contiguous();
    TORCH_CHECK(rs.numel() == M, "lora_add_: one slot per row expected");
    std::copy(rs.data_ptr<int64_t>(), rs.data_ptr<int64_t>() + M, slot.begin());
  }
  auto served = [&](int64_t s) { return s >= 0 && s < S && pa[s] != nullptr; };
  std::vector<int64_t> start(S + 1, 0);  // grouped by slot, in order within each: a counting sort
  for (int64_t s : slot)
    if (served(s)) ++start[s + 1];
  for (int64_t s = 0; s < S; ++s) start[s + 1] += start[s];
  std::vector<int64_t> rows(start[S]), next(start.begin(), start.end() - 1);
  for (int64_t r = 0; r < M; ++r)
    if (served(slot[r])) rows[next[slot[r]]++] = r;
  AT_DISPATCH_SWITCH(x.scalar_type(), "lora_add_",
                     AT_DISPATCH_CASE(at::kFloat, [&] { lora_add_impl<scalar_t>(out, x, pa, b, parts, rows, start); })
                     AT_DISPATCH_CASE(at::kBFloat16, [&] { lora_add_impl<scalar_t>(out, x, pa, b, parts, rows, start); })
                     AT_DISPATCH_CASE(at::kHalf, [&] { lora_add_impl<scalar_t>(out, x, pa, b, parts, rows, start); }));
  return out;
}

TORCH_LIBRARY_FRAGMENT(iterserve, m) {
  m.def("lora_add_(Tensor(a!) out, Tensor x, Tensor?[] a, Tensor[] b, int[] parts, Tensor? row_slots=None) "
        "-> Tensor(a!)");
}

TORCH_LIBRARY_IMPL(iterserve, CPU, m) { m.impl("lora_add_", &lora_add_); }
