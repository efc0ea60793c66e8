// The kernels' entry points, for the C++ that calls them directly (decoder.cpp's decode loop) as well as
// through Python. Each is defined, with what it expects of its arguments, in the file named beside it.
#pragma once

#include <torch/extension.h>

// AVX512-BF16 (vdpbf16ps: 32 exact bf16 products summed into 16 float32 lanes), where the compiler targets it.
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define ITERSERVE_DPBF16 1
#endif

// attention.cpp
void paged_decode(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                  int64_t sliding_window);

// kv_write.cpp
constexpr int64_t kKeyGroup = 16;  // keys per group of a K cache in key groups (keys_in_groups)
bool keys_in_groups(at::ScalarType dtype, int64_t head_dim, int64_t block_size);
void check_caches(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache, const at::Tensor& v_cache);
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
              const at::Tensor& slot_blocks, const at::Tensor& slot_offsets);

// layer_ops.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
void fused_add_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps);
void rope_(at::Tensor q, at::Tensor k, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor silu_and_mul(const at::Tensor& x);
at::Tensor argmax_rows(const at::Tensor& x);

// kv_quant_decode.cpp, kv_quant_write.cpp
void paged_decode_quant(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale,
                        const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                        int64_t sliding_window, int64_t isa);
void write_kv_quant(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
                    const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale,
                    const at::Tensor& slot_blocks, const at::Tensor& slot_offsets);

// linear.cpp
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N, const c10::optional<at::Tensor>& bias,
                         int64_t amx_min_rows, bool float_out = false);

// lora.cpp
at::Tensor lora_add_(at::Tensor out, const at::Tensor& x, const std::vector<c10::optional<at::Tensor>>& a,
                     const std::vector<at::Tensor>& b, const std::vector<int64_t>& parts,
                     const c10::optional<at::Tensor>& row_slots);

// quant_ops.cpp
at::Tensor qgemm(const at::Tensor& x, const at::Tensor& w, int64_t n, int64_t bits, int64_t isa,
                 bool float_out = false);

// kquant_ops.cpp
at::Tensor kgemm(const at::Tensor& x, at::TensorList ws, at::IntArrayRef types, at::IntArrayRef ns, int64_t isa,
                 bool float_out = false);
