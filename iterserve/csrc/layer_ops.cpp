// The small per-layer ops, each fused into one pass a row: RMSNorm (with the residual add), RoPE in place,
// SiLU(gate) * up, and the greedy sampler's argmax. Every op has a PyTorch reference path
// (iterserve/attention/reference.py, iterserve/engine/sampler.py); all arithmetic is float32 with one rounding
// to the storage dtype at the end.

#include <torch/extension.h>

#include "ops.h"
#include "parallel.h"
#include "vec.h"

#include <cmath>
#include <vector>

using namespace iterserve::vec;

namespace {

// Offset of row r of a tensor whose last dim is contiguous, for 2-D and 3-D tensors.
inline int64_t row_offset(const at::Tensor& t, int64_t r) {
  return t.dim() == 2 ? r * t.stride(0) : (r / t.size(1)) * t.stride(0) + (r % t.size(1)) * t.stride(1);
}

template <typename T>
void rms_norm_impl(at::Tensor& out, const at::Tensor& x, at::Tensor* residual, const at::Tensor& weight, double eps) {
  const int64_t dim = x.size(-1), rows = x.numel() / dim;
  const T* w = weight.data_ptr<T>();
  iterserve::parallel_chunks(rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(dim), wf(dim), res(dim);
    to_float(w, wf.data(), dim);
    for (int64_t r = begin; r < end; ++r) {
      T* xr = x.data_ptr<T>() + row_offset(x, r);
      to_float(xr, buf.data(), dim);
      if (residual != nullptr) {
        // The residual stream is kept in the storage dtype, as the reference's x + residual is.
        T* rr = residual->data_ptr<T>() + row_offset(*residual, r);
        to_float(rr, res.data(), dim);
        for (int64_t i = 0; i < dim; ++i) buf[i] += res[i];
        from_float(buf.data(), rr, dim);
        to_float(rr, buf.data(), dim);
      }
      const float inv = 1.f / std::sqrt(dot(buf.data(), buf.data(), dim) / dim + static_cast<float>(eps));
      for (int64_t i = 0; i < dim; ++i) buf[i] = buf[i] * inv * wf[i];
      from_float(buf.data(), out.data_ptr<T>() + row_offset(out, r), dim);
    }
  });
}

void check_rows(const at::Tensor& t) {
  TORCH_CHECK((t.dim() == 2 || t.dim() == 3) && t.stride(-1) == 1, "expected a 2-D/3-D tensor, last dim contiguous");
}

}  // namespace

// weight * x / rms(x), in a new tensor.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x);
  at::Tensor out = at::empty(x.sizes(), x.options());
  DISPATCH_FLOAT_TYPES(x.scalar_type(), "rms_norm", [&] {
    rms_norm_impl<scalar_t>(out, x, nullptr, weight.contiguous(), eps);
  });
  return out;
}

// In place: residual += x, then x = weight * residual / rms(residual).
void fused_add_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps) {
  check_rows(x);
  check_rows(residual);
  TORCH_CHECK(x.sizes() == residual.sizes() && x.scalar_type() == residual.scalar_type(), "x/residual mismatch");
  DISPATCH_FLOAT_TYPES(x.scalar_type(), "fused_add_rms_norm", [&] {
    rms_norm_impl<scalar_t>(x, x, &residual, weight.contiguous(), eps);
  });
}

namespace {

// o = v * cos + rotate_half(v) * sin for one head of dim = 2 * half. Written out per element, GCC kept the loop
// scalar (it could not rule out aliasing between the four buffers), so the vectors are written out.
inline void rotate_half(const float* v, const float* c, const float* s, float* o, int64_t half) {
  int64_t d = 0;
  for (; d + kVecSize <= half; d += kVecSize) {
    const Vec lo = Vec::loadu(v + d), hi = Vec::loadu(v + d + half);
    (lo * Vec::loadu(c + d) - hi * Vec::loadu(s + d)).store(o + d);
    (hi * Vec::loadu(c + d + half) + lo * Vec::loadu(s + d + half)).store(o + d + half);
  }
  for (; d < half; ++d) {
    o[d] = v[d] * c[d] - v[d + half] * s[d];
    o[d + half] = v[d + half] * c[d + half] + v[d] * s[d + half];
  }
}

template <typename T>
void rope_impl(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  T* xp = x.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  const int64_t xs0 = x.stride(0), xs1 = x.stride(1), cs0 = cos.stride(0), ss0 = sin.stride(0);
  iterserve::parallel_chunks(tokens, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> c(dim), s(dim), v(dim), o(dim);
    for (int64_t i = begin; i < end; ++i) {
      to_float(cp + i * cs0, c.data(), dim);
      to_float(sp + i * ss0, s.data(), dim);
      for (int64_t h = 0; h < heads; ++h) {
        T* row = xp + i * xs0 + h * xs1;
        to_float(row, v.data(), dim);
        rotate_half(v.data(), c.data(), s.data(), o.data(), half);
        from_float(o.data(), row, dim);
      }
    }
  });
}

}  // namespace

// Rotate-half RoPE on q [tokens, heads, D] and k [tokens, kv_heads, D] in place; cos/sin are the
// per-token tables [tokens, D] (any leading view whose rows are contiguous).
void rope_(at::Tensor q, at::Tensor k, const at::Tensor& cos, const at::Tensor& sin) {
  for (const at::Tensor* t : {&q, &k}) {
    TORCH_CHECK(t->dim() == 3 && t->stride(2) == 1 && t->size(2) % 2 == 0, "q/k must be [tokens, heads, even D]");
    TORCH_CHECK(t->scalar_type() == cos.scalar_type(), "cos/sin must share the dtype of q/k");
  }
  TORCH_CHECK(cos.size(0) == q.size(0) && cos.stride(-1) == 1 && sin.stride(-1) == 1, "cos/sin must be [tokens, D]");
  DISPATCH_FLOAT_TYPES(q.scalar_type(), "rope_", [&] {
    rope_impl<scalar_t>(q, cos, sin);
    rope_impl<scalar_t>(k, cos, sin);
  });
}

// silu(x[:, :I]) * x[:, I:] for x = [tokens, 2I].
at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0, "x must be [tokens, 2 * intermediate]");
  const int64_t tokens = x.size(0), inter = x.size(1) / 2;
  at::Tensor out = at::empty({tokens, inter}, x.options());
  DISPATCH_FLOAT_TYPES(x.scalar_type(), "silu_and_mul", [&] {
    using T = scalar_t;
    const T* xp = x.data_ptr<T>();
    T* op = out.data_ptr<T>();
    const int64_t xs = x.stride(0);
    // One pass a row, widening and rounding on the way, rather than three passes through float buffers.
    iterserve::parallel_chunks(tokens, 8, [&](int64_t begin, int64_t end) {
      const Vec one(1.f);
      for (int64_t i = begin; i < end; ++i) {
        const T* g = xp + i * xs;
        const T* u = g + inter;
        T* o = op + i * inter;
        int64_t d = 0;
        for (; d + kVecSize <= inter; d += kVecSize) {
          const Vec gv = load_f(g + d);
          store_f(gv / (one + gv.neg().exp_u20()) * load_f(u + d), o + d);
        }
        for (; d < inter; ++d) {
          const float gf = static_cast<float>(g[d]);
          o[d] = static_cast<T>(gf / (1.f + std::exp(-gf)) * static_cast<float>(u[d]));
        }
      }
    });
  });
  return out;
}

// Each row's index of its largest value: the first of equal ones, and the first NaN where there is one (as
// torch.argmax). torch's CPU argmax compares one element at a time, many times slower than a vector max over
// the row. Here the vector max, then a scan for its first index.
at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 && x.size(1) > 0,
              "argmax_rows: float32 [rows, n > 0] with contiguous rows expected");
  const int64_t n = x.size(1), xs = x.stride(0);
  at::Tensor out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  iterserve::parallel_chunks(x.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * xs;
      // at::vec::maximum propagates NaN, so `top` is NaN exactly when the row holds one.
      const float top = at::vec::reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, row, n);
      int64_t i = 0;
      if (std::isnan(top)) {
        while (!std::isnan(row[i])) ++i;
      } else {
        while (row[i] != top) ++i;
      }
      op[r] = i;
    }
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(iterserve, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("rope_(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("argmax_rows(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(iterserve, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("rope_", &rope_);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("argmax_rows", &argmax_rows);
}
