// The KV-cache write: this step's K/V rows copied into their slots, K in rows or in key groups; and the check
// of a cache's layout that paged_decode (attention.cpp) shares. Every op has a PyTorch reference path
// (iterserve/attention/reference.py).

#include <torch/library.h>

#include "ops.h"
#include "parallel.h"

#include <cstdint>
#include <cstring>

// K in key groups: where the CPU has AVX512-BF16, a bf16 K cache with a head dim that is a multiple of 32 and
// blocks of a multiple of 16 keys is [blocks, kv_heads, block_size / 16, head_dim / 2, 16, 2]: each 16 keys of
// a block's head keep their dimension pairs side by side, so that one vdpbf16ps scores sixteen keys on one
// pair of the query (group_scores_keyed) and no sum crosses lanes. V keeps rows. K in rows is scored a key at a
// time, with sixteen keys' lanes summed by shuffles after, which costs more (docs/benchmarks-history.md).
bool keys_in_groups(at::ScalarType dtype, int64_t head_dim, int64_t block_size) {
#if defined(ITERSERVE_DPBF16) && defined(CPU_CAPABILITY_AVX512)
  return dtype == at::kBFloat16 && head_dim % 32 == 0 && block_size % kKeyGroup == 0;
#else
  return false;
#endif
}

// The K cache (rows [blocks, kv_heads, block_size, head_dim], or in key groups: keys_in_groups) and the V cache
// (rows) for keys k and values v; paged_decode passes its query as both, whose dtype and head_dim they share.
void check_caches(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache, const at::Tensor& v_cache) {
  TORCH_CHECK(k_cache.scalar_type() == k.scalar_type() && v_cache.scalar_type() == v.scalar_type(),
              "KV cache dtype differs from the query");
  TORCH_CHECK(v_cache.dim() == 4 && v_cache.stride(3) == 1, "V cache must be [blocks, kv_heads, block_size, head_dim]");
  TORCH_CHECK(v_cache.size(3) == v.size(-1), "KV cache head_dim differs from the query");
  TORCH_CHECK(k_cache.dim() >= 2 && k_cache.size(1) == v_cache.size(1), "K and V caches hold different kv_heads");
  if (k_cache.dim() == 6) {
    TORCH_CHECK(k_cache.is_contiguous() && k_cache.size(4) == kKeyGroup && k_cache.size(5) == 2 &&
                    k_cache.size(3) * 2 == k.size(-1) && k_cache.size(2) * kKeyGroup == v_cache.size(2),
                "K cache in key groups must be [blocks, kv_heads, block_size / 16, head_dim / 2, 16, 2]");
    TORCH_CHECK(keys_in_groups(k_cache.scalar_type(), k.size(-1), v_cache.size(2)),
                "K in key groups needs bf16 on a CPU with AVX512-BF16, head_dim % 32 == 0, block_size % 16 == 0");
    return;
  }
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.stride(3) == 1, "K cache must be [blocks, kv_heads, block_size, head_dim]");
  TORCH_CHECK(k_cache.size(3) == k.size(-1), "KV cache head_dim differs from the query");
}

// k_cache[blocks[i], :, offsets[i]] = k[i] (and the same for v); k/v may be strided views of the QKV output.
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
              const at::Tensor& slot_blocks, const at::Tensor& slot_offsets) {
  check_caches(k, v, k_cache, v_cache);
  TORCH_CHECK(k.dim() == 3 && k.stride(2) == 1 && v.stride(2) == 1, "k/v must be [tokens, kv_heads, head_dim]");
  TORCH_CHECK(slot_blocks.is_contiguous() && slot_offsets.is_contiguous() && slot_blocks.scalar_type() == at::kLong,
              "slots must be contiguous int64");
  const int64_t tokens = k.size(0), kv_heads = k.size(1), dim = k.size(2);
  const int64_t* blocks = slot_blocks.data_ptr<int64_t>();
  const int64_t* offsets = slot_offsets.data_ptr<int64_t>();
  const int64_t bytes = dim * k.element_size();
  auto* kp = static_cast<const char*>(k.data_ptr());
  auto* vp = static_cast<const char*>(v.data_ptr());
  auto* kc = static_cast<char*>(k_cache.data_ptr());
  auto* vc = static_cast<char*>(v_cache.data_ptr());
  const int64_t es = k.element_size();
  const bool keyed = k_cache.dim() == 6;
  iterserve::parallel_chunks(tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      for (int64_t h = 0; h < kv_heads; ++h) {
        const char* src = kp + (i * k.stride(0) + h * k.stride(1)) * es;
        if (keyed) {  // dimension pair p of key t at word p * 16 + t % 16 of t's group
          auto* group = reinterpret_cast<uint32_t*>(
              kc + (blocks[i] * k_cache.stride(0) + h * k_cache.stride(1) + offsets[i] / kKeyGroup * k_cache.stride(2)) * es);
          for (int64_t p = 0; p < dim / 2; ++p)
            std::memcpy(group + p * kKeyGroup + offsets[i] % kKeyGroup, src + p * 2 * es, 2 * es);
        } else {
          std::memcpy(kc + (blocks[i] * k_cache.stride(0) + h * k_cache.stride(1) + offsets[i] * k_cache.stride(2)) * es,
                      src, bytes);
        }
        std::memcpy(vc + (blocks[i] * v_cache.stride(0) + h * v_cache.stride(1) + offsets[i] * v_cache.stride(2)) * es,
                    vp + (i * v.stride(0) + h * v.stride(1)) * es, bytes);
      }
    }
  });
}

TORCH_LIBRARY_FRAGMENT(iterserve, m) {
  m.def("write_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_blocks, "
        "Tensor slot_offsets) -> ()");
  // Whether paged_decode and write_kv take a K cache of this kind in key groups (no tensor: any backend)
  m.def("keys_in_groups(ScalarType dtype, int head_dim, int block_size) -> bool", &keys_in_groups);
}

TORCH_LIBRARY_IMPL(iterserve, CPU, m) { m.impl("write_kv", &write_kv); }
