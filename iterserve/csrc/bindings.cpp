// The extension's Python module: each op family registers its functions (attention.cpp, layer_ops.cpp,
// linear.cpp, lora.cpp, decoder.cpp, kv_quant.cpp; quant_ops.cpp and kquant_ops.cpp register under torch.ops), and the
// kernels' thread pool (parallel.h) is sized from here.

#include <torch/extension.h>

#include "parallel.h"

void register_attention(pybind11::module& m);  // attention.cpp
void register_layer_ops(pybind11::module& m);  // layer_ops.cpp
void register_linear(pybind11::module& m);  // linear.cpp
void register_lora(pybind11::module& m);  // lora.cpp
void register_decoder(pybind11::module& m);  // decoder.cpp
void register_kv_quant(pybind11::module& m);  // kv_quant.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  register_attention(m);
  register_layer_ops(m);
  register_linear(m);
  register_lora(m);
  register_decoder(m);
  register_kv_quant(m);
  m.def("set_threads", [](int64_t n) { iterserve::ChunkPool::get().resize(static_cast<int>(n)); },
        "Run the kernels' parallel loops on n threads (the caller included)");
  m.def("threads", [] { return iterserve::ChunkPool::get().threads(); }, "Threads of the kernels' pool");
  m.def("pool_solos", [] { return iterserve::ChunkPool::get().solos(); },
        "Times the pool's caller, stalled by descheduled workers, went on alone for a while");
}
