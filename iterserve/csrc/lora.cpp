// A step's LoRA products (vLLM's punica SGMV on the CPU): the base matmul has run once for every row, and each
// row then gets its own adapter's (x @ A^T) @ B^T. Rows are grouped by adapter (slot), so that each group
// multiplies its own adapter's weights only, packed as the dense layers' weights are (pack_linear_weight) and
// multiplied by their kernel (linear.h's run_blocks) on the kernels' thread pool. A fused layer (qkv, gate/up)
// holds an adapter's parts side by side: their A one above the other, their B block-diagonal. B comes as its
// parts, each multiplying only its own ranks of the shrunk rows into its own output columns, so that the expand
// never multiplies B's zero blocks. A call is one pool run: a task takes some rows of one slot through both.

#include <torch/extension.h>

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include "linear.h"
#include "ops.h"
#include "parallel.h"

#include <algorithm>
#include <vector>

namespace {

using iterserve::kV;
using iterserve::pairs;

// One B part: slot's shrunk columns from rank0 on, into out's columns [col0, col0 + cols).
struct Part {
  int64_t slot, rank0, col0, cols;
  const at::Tensor* b;
};

// One pool task: grouped rows [r0, r1), all under one slot: their shrink, then each of the slot's B parts.
struct Task {
  int64_t slot, r0, r1;
};

// Rows a task: enough tasks for every thread to get two in a decode step, up to 64 rows in a prompt's chunk.
int64_t task_rows(int64_t rows) {
  const int64_t threads = iterserve::ChunkPool::get().threads(), per = (rows + 2 * threads - 1) / (2 * threads);
  return std::clamp<int64_t>((per + 7) / 8 * 8, 8, 64);
}

// The tasks over the grouped rows [start[s], start[s + 1]) of each slot s.
std::vector<Task> tasks_of(const std::vector<int64_t>& start) {
  const int64_t S = static_cast<int64_t>(start.size()) - 1, per = task_rows(start[S]);
  std::vector<Task> tasks;
  for (int64_t s = 0; s < S; ++s)
    for (int64_t r = start[s]; r < start[s + 1]; r += per) tasks.push_back({s, r, std::min(start[s + 1], r + per)});
  return tasks;
}

// x's rows rows[r0, r1) as the kernel reads them, from xk on (a thread's own buffer): bf16 k-pairs padded to the
// packed weight's 2 Kw columns, or float32; returns the row stride in elements.
template <typename T>
int64_t gather_rows(const at::Tensor& x, const int64_t* rows, int64_t n, int64_t Kw, std::vector<char>& buf) {
  const int64_t K = x.size(1), width = pairs<T>() ? 2 * Kw : K, size = pairs<T>() ? sizeof(T) : sizeof(float);
  buf.resize(n * width * size);
  const T* xp = x.data_ptr<T>();
  for (int64_t r = 0; r < n; ++r) {
    const T* src = xp + rows[r] * x.stride(0);
    if constexpr (pairs<T>()) {
      T* dst = reinterpret_cast<T*>(buf.data()) + r * width;
      std::copy(src, src + K, dst);
      std::fill(dst + K, dst + width, T(0));
    } else {
      float* dst = reinterpret_cast<float*>(buf.data()) + r * width;
      for (int64_t k = 0; k < K; ++k) dst[k] = static_cast<float>(src[k]);
    }
  }
  return width;
}

// n rows of x (row stride xs elements, as gather_rows left them) @ w's blocks [0, blocks) into y [n, N].
template <typename T>
void run_rows(const char* x, int64_t xs, int64_t n, const at::Tensor& w, int64_t blocks, T* y, int64_t N) {
  const int64_t size = pairs<T>() ? sizeof(T) : sizeof(float);
  iterserve::run_blocks<T>(x, xs * size, pairs<T>() ? xs / 2 : xs, n, w.data_ptr<T>(), w.numel() / w.size(0),
                           w.size(1), 0, blocks, nullptr, y, N);
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

// A thread's buffers for its tasks: the rows as the kernel reads them, their shrunk ranks (in T, and in float32
// for a kernel that reads float32) and a B part's product.
template <typename T>
struct Buffers {
  std::vector<char> x;
  std::vector<T> shrunk, y;
  std::vector<float> shrunk_f;
};

// One task: its rows' shrink by the slot's A into `width` ranks (zero past the slot's rank, where A's zero padding
// leaves the products), rounded to T, then each of the slot's B parts from its first rank column into out.
template <typename T>
void run_task(const Task& t, at::Tensor& out, const at::Tensor& x, const at::Tensor& a, const std::vector<Part>& parts,
              const std::vector<int64_t>& rows, int64_t width, Buffers<T>& buf) {
  const int64_t n = t.r1 - t.r0, N = out.size(1);
  const int64_t xs = gather_rows<T>(x, rows.data() + t.r0, n, a.size(1), buf.x);
  buf.shrunk.assign(n * width, T(0));
  run_rows<T>(buf.x.data(), xs, n, a, std::min(a.size(0), (width + kV - 1) / kV), buf.shrunk.data(), width);
  const char* sk = reinterpret_cast<const char*>(buf.shrunk.data());
  if constexpr (!pairs<T>() && !std::is_same_v<T, float>) {
    buf.shrunk_f.assign(buf.shrunk.begin(), buf.shrunk.end());
    sk = reinterpret_cast<const char*>(buf.shrunk_f.data());
  }
  const int64_t size = pairs<T>() ? sizeof(T) : sizeof(float);
  T* op = out.data_ptr<T>();
  for (const Part& p : parts) {
    if (p.slot != t.slot) continue;
    buf.y.resize(n * p.cols);
    run_rows<T>(sk + p.rank0 * size, width, n, *p.b, p.b->size(0), buf.y.data(), p.cols);
    for (int64_t r = 0; r < n; ++r) add_to(op + rows[t.r0 + r] * N + p.col0, buf.y.data() + r * p.cols, p.cols);
  }
}

// lora_add_ on the rows grouped by slot: grouped row i is out's row rows[i], slot s's rows start at start[s].
// One pool run: a task's rows need only their own shrunk ranks.
template <typename T>
void lora_add_impl(at::Tensor& out, const at::Tensor& x, const std::vector<const at::Tensor*>& a,
                   const std::vector<at::Tensor>& b, const std::vector<int64_t>& parts,
                   const std::vector<int64_t>& rows, const std::vector<int64_t>& start) {
  int64_t width = 0;
  const auto ps = checked_parts<T>(x, out, a, b, parts, width);
  if (rows.empty()) return;
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  const auto tasks = tasks_of(start);
  iterserve::parallel_chunks(static_cast<int64_t>(tasks.size()), 1, [&](int64_t t0, int64_t t1) {
    thread_local Buffers<T> buf;
    for (int64_t t = t0; t < t1; ++t) run_task<T>(tasks[t], out, xc, *a[tasks[t].slot], ps, rows, width, buf);
  });
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
