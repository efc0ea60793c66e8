// The decoder stack's decode step in one call: for every layer, RMSNorm (with the residual add), the
// fused QKV matmul, QK-norm where the model has it, RoPE, the KV-cache write, paged decode attention, the
// output projection, RMSNorm again and the gate/up -> SiLU * up -> down MLP; the same kernels, in the same
// order, as the Python layers of iterserve/models/llama.py call through the CPU backend, without going
// back to Python between them. A decode step of a small model is short enough that Python's share
// was large: SmolLM2-135M in Q4_1 spent about 1.5 of its 5.9 ms a step (batch 1) in 30 layers of module
// calls and op dispatch. Every token of such a step is attended as a decode (short prompts included, see
// CpuBackend.decode_prompts_up_to); a step with a longer prompt chunk takes the Python path (SDPA's).
// A step's LoRA adapters come as each linear layer's packed weights per adapter (iterserve.lora.batch.LoRABatch.native)
// and are added by the kernel LoRABatch.add calls (lora_add_, lora.cpp), so a row gets the same values on either path.

#include "ops.h"

#include <optional>
#include <tuple>
#include <variant>
#include <vector>

namespace {

// How one linear layer multiplies (iterserve.models.linear.LinearMethod.native): F.linear on the plain
// weight, packed_linear on the packed one (param: AMX's minimum rows), qgemm on quantized blocks (param:
// bits), or kgemm on GGUF blocks as stored (weight: the parts; param: their type ids, then their row counts).
enum LinearKind : int64_t { kDense = 0, kPacked = 1, kQuantized = 2, kGguf = 3 };

struct Linear {
  int64_t kind;
  at::Tensor weight;
  int64_t out_features;
  int64_t param;
  c10::optional<at::Tensor> bias;
  std::vector<at::Tensor> parts;
  std::vector<int64_t> types, rows;

  at::Tensor operator()(const at::Tensor& x) const {
    switch (kind) {
      case kDense: return at::linear(x, weight, bias);
      case kPacked: return packed_linear(x, weight, out_features, bias, param);
      default: {
        at::Tensor y = kind == kGguf ? kgemm(x, parts, types, rows, 0) : qgemm(x, weight, out_features, param, 0);
        return bias.has_value() ? y.add_(*bias) : y;
      }
    }
  }
};

using LinearArgs = std::tuple<int64_t, std::variant<at::Tensor, std::vector<at::Tensor>>, int64_t,
                              std::variant<int64_t, std::vector<int64_t>>, c10::optional<at::Tensor>>;
using OptionalTensors = std::vector<c10::optional<at::Tensor>>;

// The step's LoRA weights of every linear layer (4 a layer: qkv, o, gate_up, down): each slot's packed A (a[i][s],
// none where that adapter leaves the layer alone), the packed B parts b[i] and what they cover (parts[i]), all
// empty when no row has an adapter, and each row's slot (none: every row is under slot 0): out + each row's
// (x @ A_s.T) @ B_s.T, by lora_add_ (lora.cpp).
struct LoRARows {
  const std::vector<OptionalTensors>& a;
  const std::vector<std::vector<at::Tensor>>& b;
  const std::vector<std::vector<int64_t>>& parts;
  const c10::optional<at::Tensor>& row_slots;

  at::Tensor add(const at::Tensor& out, const at::Tensor& x, size_t i) const {
    if (a.empty() || a[i].empty()) return out;
    return lora_add_(out, x, a[i], b[i], parts[i], row_slots);
  }
};

Linear make_linear(const LinearArgs& a) {
  const auto& [kind, weight, n, param, bias] = a;
  TORCH_CHECK(kind >= kDense && kind <= kGguf, "unknown linear kind ", kind);
  const bool parts = kind == kGguf;
  TORCH_CHECK(std::holds_alternative<std::vector<at::Tensor>>(weight) == parts &&
                  std::holds_alternative<std::vector<int64_t>>(param) == parts,
              "a GGUF linear takes lists of parts and of their types and rows, the others one weight and param");
  if (!parts) return Linear{kind, std::get<at::Tensor>(weight), n, std::get<int64_t>(param), bias, {}, {}, {}};
  const auto& ws = std::get<std::vector<at::Tensor>>(weight);
  const auto& meta = std::get<std::vector<int64_t>>(param);
  TORCH_CHECK(!ws.empty() && meta.size() == 2 * ws.size(), "a GGUF linear needs a type id and a row count per part");
  const auto half = meta.begin() + static_cast<std::ptrdiff_t>(ws.size());
  return Linear{kind, {}, n, 0, bias, ws, {meta.begin(), half}, {half, meta.end()}};
}

inline bool is_quantized(const at::Tensor& cache) {
  const auto t = cache.scalar_type();
  return t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2 || t == at::kChar;
}

struct Layer {
  at::Tensor input_norm, post_norm;
  c10::optional<at::Tensor> q_norm, k_norm;
  Linear qkv, o, gate_up, down;
};

class DecoderStack {
 public:
  DecoderStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale)
      : heads_(num_heads), kv_heads_(num_kv_heads), dim_(head_dim), eps_(eps), scale_(scale) {}

  void add_layer(const at::Tensor& input_norm, const at::Tensor& post_norm, const c10::optional<at::Tensor>& q_norm,
                 const c10::optional<at::Tensor>& k_norm, const LinearArgs& qkv, const LinearArgs& o,
                 const LinearArgs& gate_up, const LinearArgs& down) {
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "QK-norm needs both weights");
    layers_.push_back(Layer{input_norm.contiguous(), post_norm.contiguous(), q_norm, k_norm, make_linear(qkv),
                            make_linear(o), make_linear(gate_up), make_linear(down)});
  }

  // x [tokens, hidden], every token a decode (one query over its sequence's cached context) -> the last
  // layer's output and the residual stream before it, as iterserve.models.llama.DecoderLayer returns them.
  std::tuple<at::Tensor, at::Tensor> forward(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                                             const std::vector<at::Tensor>& k_caches,
                                             const std::vector<at::Tensor>& v_caches, const at::Tensor& slot_blocks,
                                             const at::Tensor& slot_offsets, const at::Tensor& block_tables,
                                             const at::Tensor& context_lens, int64_t sliding_window,
                                             const std::vector<at::Tensor>& k_scales,
                                             const std::vector<at::Tensor>& v_scales,
                                             const std::vector<OptionalTensors>& lora_a,
                                             const std::vector<std::vector<at::Tensor>>& lora_b,
                                             const std::vector<std::vector<int64_t>>& lora_parts,
                                             const c10::optional<at::Tensor>& lora_slots) const {
    TORCH_CHECK(k_caches.size() == layers_.size() && v_caches.size() == layers_.size(),
                "one K and one V cache per layer expected");
    TORCH_CHECK(lora_a.empty() || (lora_a.size() == 4 * layers_.size() && lora_b.size() == lora_a.size() &&
                                   lora_parts.size() == lora_a.size()),
                "LoRA weights for 4 linear layers per decoder layer expected");
    const LoRARows lora{lora_a, lora_b, lora_parts, lora_slots};
    TORCH_CHECK(block_tables.size(0) == x.size(0), "every token of a decode-only step is a decode");
    const int64_t n = x.size(0), q_size = heads_ * dim_, kv_size = kv_heads_ * dim_;
    at::Tensor residual;
    for (size_t l = 0; l < layers_.size(); ++l) {
      const Layer& L = layers_[l];
      at::Tensor h;
      if (!residual.defined()) {
        h = rms_norm(x, L.input_norm, eps_);
        residual = x;
      } else {
        fused_add_rms_norm(x, residual, L.input_norm, eps_);
        h = x;
      }
      const at::Tensor qkv = lora.add(L.qkv(h), h, 4 * l);
      at::Tensor q = qkv.narrow(1, 0, q_size).view({n, heads_, dim_});
      at::Tensor k = qkv.narrow(1, q_size, kv_size).view({n, kv_heads_, dim_});
      const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({n, kv_heads_, dim_});
      if (L.q_norm.has_value()) {
        q = rms_norm(q, *L.q_norm, eps_);
        k = rms_norm(k, *L.k_norm, eps_);
      }
      rope_(q, k, cos, sin);
      at::Tensor attn = at::empty({n, heads_, dim_}, q.options());
      if (is_quantized(k_caches[l])) {  // kv_cache_dtype fp8 / int8 (kv_quant.cpp); int8 caches come with scales
        const auto ks = k_scales.empty() ? c10::optional<at::Tensor>() : k_scales[l];
        const auto vs = v_scales.empty() ? c10::optional<at::Tensor>() : v_scales[l];
        write_kv_quant(k, v, k_caches[l], v_caches[l], ks, vs, slot_blocks, slot_offsets);
        paged_decode_quant(attn, q, k_caches[l], v_caches[l], ks, vs, block_tables, context_lens, scale_,
                           sliding_window, 0);
      } else {
        write_kv(k, v, k_caches[l], v_caches[l], slot_blocks, slot_offsets);
        paged_decode(attn, q, k_caches[l], v_caches[l], block_tables, context_lens, scale_, sliding_window);
      }
      const at::Tensor attn_out = attn.view({n, q_size});
      x = lora.add(L.o(attn_out), attn_out, 4 * l + 1);
      fused_add_rms_norm(x, residual, L.post_norm, eps_);
      const at::Tensor act = silu_and_mul(lora.add(L.gate_up(x), x, 4 * l + 2));
      x = lora.add(L.down(act), act, 4 * l + 3);
    }
    return {x, residual};
  }

 private:
  int64_t heads_, kv_heads_, dim_;
  double eps_, scale_;
  std::vector<Layer> layers_;
};

}  // namespace

void register_decoder(pybind11::module& m) {
  pybind11::class_<DecoderStack>(m, "DecoderStack", "The decoder stack's decode step in one call (decoder.cpp)")
      .def(pybind11::init<int64_t, int64_t, int64_t, double, double>(), pybind11::arg("num_heads"),
           pybind11::arg("num_kv_heads"), pybind11::arg("head_dim"), pybind11::arg("eps"), pybind11::arg("scale"))
      .def("add_layer", &DecoderStack::add_layer)
      .def("forward", &DecoderStack::forward, pybind11::call_guard<pybind11::gil_scoped_release>());
}
