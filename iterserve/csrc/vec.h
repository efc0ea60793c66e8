// Float32 vectors over the storage dtypes (float32, bfloat16, float16) for the kernels that widen a row, compute
// in float32 and round once on the way out: ATen's at::vec::Vectorized, compiled for the capability PyTorch
// itself detected (AVX2/AVX512).
#pragma once

#include <torch/extension.h>

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <type_traits>

// float32, bfloat16 and float16 storage; double has no use in serving.
#define DISPATCH_FLOAT_TYPES(TYPE, NAME, ...)                                                 \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)                     \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__) AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

namespace iterserve::vec {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kVecSize = Vec::size();

inline Vec load_f(const float* p) { return Vec::loadu(p); }
inline Vec load_f(const c10::BFloat16* p) {
  Vec out;
  at::vec::load_to_float(p, out);
  return out;
}
inline Vec load_f(const c10::Half* p) {
  Vec out;
  at::vec::load_to_float(p, out);
  return out;
}

// Convert n values of a row to float32.
template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + kVecSize <= n; i += kVecSize) load_f(src + i).store(dst + i);
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// Round one vector of float32 values to the storage dtype.
inline void store_f(const Vec& v, float* dst) { v.store(dst); }
template <typename T>
inline void store_f(const Vec& v, T* dst) {
  at::vec::convert_from_float<T>(v, v).store(dst, kVecSize);
}

// Round n float32 values to the storage dtype.
template <typename T>
inline void from_float(const float* src, T* dst, int64_t n) {
  int64_t i = 0;
  if constexpr (std::is_same_v<T, float>) {
    std::copy(src, src + n, dst);
    return;
  } else {
    for (; i + kVecSize <= n; i += kVecSize) store_f(Vec::loadu(src + i), dst + i);
    for (; i < n; ++i) dst[i] = static_cast<T>(src[i]);
  }
}

inline float dot(const float* a, const float* b, int64_t n) {
  Vec acc(0.f);
  int64_t i = 0;
  for (; i + kVecSize <= n; i += kVecSize) acc = at::vec::fmadd(Vec::loadu(a + i), Vec::loadu(b + i), acc);
  float s = acc.reduce_add();
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

}  // namespace iterserve::vec
