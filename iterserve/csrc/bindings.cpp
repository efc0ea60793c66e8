// The extension's op library, torch.ops.iterserve: it opens here with the kernels' thread pool (parallel.h),
// and each op family adds its ops as a fragment beside their code (attention.cpp, kv_write.cpp, layer_ops.cpp,
// linear.cpp, lora.cpp, kv_quant_decode.cpp, kv_quant_write.cpp, quant_ops.cpp, kquant_ops.cpp) and decoder.cpp its
// DecoderStack class (torch.classes.iterserve). Python loads the library with torch.ops.load_library
// (iterserve/kernels.py), so every op is called one way, through the dispatcher.

#include <torch/library.h>

#include "parallel.h"

TORCH_LIBRARY(iterserve, m) {
  // Run the kernels' parallel loops on n threads (the caller included)
  m.def("set_threads(int n) -> ()",
        [](int64_t n) { iterserve::ChunkPool::get().resize(static_cast<int>(n)); });
  m.def("threads() -> int", []() -> int64_t { return iterserve::ChunkPool::get().threads(); });
  // Times the pool's caller, stalled by descheduled workers, went on alone for a while
  m.def("pool_solos() -> int", []() -> int64_t { return iterserve::ChunkPool::get().solos(); });
}
