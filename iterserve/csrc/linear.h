// What linear.cpp's packed kernel shares with the LoRA products of lora.cpp: the packed weight's layout
// (pack_linear_weight) and one thread's walk of its blocks for a few rows.
#pragma once

#include <ATen/cpu/vec/vec.h>

#include "ops.h"

#include <type_traits>

#if defined(ITERSERVE_DPBF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define ITERSERVE_AMX 1
#endif

namespace iterserve {

constexpr int64_t kV = at::vec::Vectorized<float>::size();  // output columns of a packed block
constexpr int kGroup = 12;  // blocks per chunk and per AMX column walk: a multiple of both tile widths (3 and 4)

// Whether T's weight is packed as k-pairs for vdpbf16ps: bf16 on a CPU with AVX512-BF16.
template <typename T>
constexpr bool pairs() {
#ifdef ITERSERVE_DPBF16
  return std::is_same_v<T, c10::BFloat16>;
#else
  return false;
#endif
}

// The k-pairs of a packed bf16 weight are padded to a multiple of this (AMX B tiles take 16 k-pairs).
#ifdef ITERSERVE_AMX
constexpr int64_t kPairAlign = 16;
#else
constexpr int64_t kPairAlign = 1;
#endif

// One thread's blocks [b0, b1) of a packed weight for the M rows of x, into y[m, b * kV + c] (plus bias) for
// the columns below N, the row stride of y (in T, or float32 for the LM head's logits). x as the kernel reads it:
// bf16 k-pairs as 32-bit words (xs words a row) for a k-pair weight, else float32 (xs floats a row); K: the
// weight's k (or k-pair) count.
template <typename T, typename Y = T>
void run_blocks(const char* x, int64_t x_row_bytes, int64_t xs, int64_t M, const T* packed, int64_t bstride,
                int64_t K, int64_t b0, int64_t b1, const float* bias, Y* y, int64_t N);

}  // namespace iterserve
