// The quantized KV cache's store: this step's K/V rows quantized into their slots (kv_quant.h's quantize_row),
// the bytes iterserve/attention/kv_quant.py's quantize stores.

#include <torch/library.h>

#include <ATen/Dispatch.h>

#include "kv_quant.h"
#include "ops.h"
#include "parallel.h"

#include <vector>

using namespace iterserve_kv_quant;

// k_cache[blocks[i], :, offsets[i]] = quantize(k[i]) (scales too for int8), and the same for v.
void write_kv_quant(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
                    const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale,
                    const at::Tensor& slot_blocks, const at::Tensor& slot_offsets) {
  TORCH_CHECK(k.dim() == 3 && k.stride(2) == 1 && v.stride(2) == 1 && k.sizes() == v.sizes(),
              "k/v must be [tokens, kv_heads, head_dim]");
  check_pools(k_cache, v_cache, k_scale, v_scale, k.size(2));
  TORCH_CHECK(slot_blocks.is_contiguous() && slot_offsets.is_contiguous() && slot_blocks.scalar_type() == at::kLong &&
                  slot_offsets.scalar_type() == at::kLong, "slots must be contiguous int64");
  const Kind kind = kind_of(k_cache);
  const int64_t heads = k.size(1), dim = k.size(2), bs = k_cache.size(2);
  const int64_t* blocks = slot_blocks.data_ptr<int64_t>();
  const int64_t* offsets = slot_offsets.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "write_kv_quant", [&] {
    iterserve::parallel_chunks(k.size(0), 16, [&](int64_t begin, int64_t end) {
      std::vector<float> row(dim);
      for (int64_t i = begin; i < end; ++i)
        for (int64_t h = 0; h < heads; ++h)
          for (int which = 0; which < 2; ++which) {
            const at::Tensor& x = which ? v : k;
            at::Tensor& cache = which ? v_cache : k_cache;
            const c10::optional<at::Tensor>& sc = which ? v_scale : k_scale;
            const scalar_t* src = x.data_ptr<scalar_t>() + i * x.stride(0) + h * x.stride(1);
            for (int64_t d = 0; d < dim; ++d) row[d] = static_cast<float>(src[d]);
            auto* dst = static_cast<uint8_t*>(cache.data_ptr()) + blocks[i] * cache.stride(0) + h * cache.stride(1) +
                        offsets[i] * cache.stride(2);
            const c10::Half s = quantize_row(row.data(), dim, kind, dst);
            if (sc.has_value()) sc->data_ptr<c10::Half>()[(blocks[i] * heads + h) * bs + offsets[i]] = s;
          }
    });
  });
}

TORCH_LIBRARY_FRAGMENT(iterserve, m) {
  m.def("write_kv_quant(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor(c!)? k_scale, "
        "Tensor(d!)? v_scale, Tensor slot_blocks, Tensor slot_offsets) -> ()");
}

TORCH_LIBRARY_IMPL(iterserve, CPU, m) { m.impl("write_kv_quant", &write_kv_quant); }
