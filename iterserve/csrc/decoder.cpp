// The decoder stack's decode step in one call: for every layer, RMSNorm (with the residual add), the
// fused QKV matmul, QK-norm where the model has it, RoPE, the KV-cache write, paged decode attention, the
// output projection, RMSNorm again and the gate/up -> SiLU * up -> down MLP; the same kernels, in the same
// order, as the Python layers of iterserve/models/llama.py call through the CPU backend, without going
// back to Python between them: a decode step of a small model is short enough that Python's module calls
// and op dispatch were a large share of it (docs/benchmarks-history.md). Every token of such a step is
// attended as a decode (short prompts included, see CpuBackend.decode_prompts_up_to); a step with a longer
// prompt chunk takes the Python path (SDPA's).
// A step's LoRA adapters come as each linear layer's packed weights per adapter (LoRABatch.native, flattened by
// CpuBackend.decode_layers) and are added by the kernel LoRABatch.add calls (lora_add_, lora.cpp), so a row gets the same
// values on either path. Gemma 3's layers (iterserve/models/gemma3.py) run here too, in their own order: four norms a
// layer in float32 with (1 + w) weights, q/k norms, GELU-tanh, and each local layer its window, its RoPE and, with
// hybrid SWA memory, its own pool's tables. The stack is a torch custom class (torch.classes.iterserve.DecoderStack).

#include "ops.h"

#include <torch/custom_class.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
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

using OptionalTensors = std::vector<c10::optional<at::Tensor>>;

// The step's LoRA weights of every linear layer (4 a layer: qkv, o, gate_up, down): each slot's packed A (a[i][s],
// none where that adapter leaves the layer alone), the packed B parts b[i] and what they cover (parts[i]), all
// empty when no row has an adapter, and each row's slot (none: every row is under slot 0): out + each row's
// (x @ A_s.T) @ B_s.T, by lora_add_ (lora.cpp).
struct LoRARows {
  std::vector<OptionalTensors> a;
  std::vector<std::vector<at::Tensor>> b;
  std::vector<std::vector<int64_t>> parts;
  const c10::optional<at::Tensor>& row_slots;

  at::Tensor add(const at::Tensor& out, const at::Tensor& x, size_t i) const {
    if (a.empty() || a[i].empty()) return out;
    return lora_add_(out, x, a[i], b[i], parts[i], row_slots);
  }
};

// A schema takes no list of lists: every linear layer's entries come one after another, counts[i * stride + at]
// lists of `each` entries for layer i; this gives each layer its own list again.
template <typename T>
std::vector<std::vector<T>> per_linear(const std::vector<T>& flat, const std::vector<int64_t>& counts, size_t stride,
                                       size_t at, int64_t each) {
  std::vector<std::vector<T>> out;
  out.reserve(counts.size() / stride);
  auto it = flat.begin();
  for (size_t i = at; i < counts.size(); i += stride) {
    const int64_t n = counts[i] * each;
    TORCH_CHECK(n >= 0 && flat.end() - it >= n, "LoRA counts exceed the weights given");
    out.emplace_back(it, it + n);
    it += n;
  }
  TORCH_CHECK(it == flat.end(), "LoRA weights left over past the counts");
  return out;
}

// The step's LoRA weights as LoRARows holds them: counts has two numbers per linear layer, its slots of A and its
// blocks of B; parts has four numbers per block of B (lora_add_'s `parts`).
LoRARows lora_rows(const OptionalTensors& a, const std::vector<at::Tensor>& b, const std::vector<int64_t>& parts,
                   const std::vector<int64_t>& counts, const c10::optional<at::Tensor>& row_slots) {
  return LoRARows{per_linear(a, counts, 2, 0, 1), per_linear(b, counts, 2, 1, 1), per_linear(parts, counts, 2, 1, 4),
                  row_slots};
}

// weights and params as DecoderStack.add_linear takes them: one weight and one param, or for GGUF the parts and
// their type ids followed by their row counts.
Linear make_linear(int64_t kind, const std::vector<at::Tensor>& weights, int64_t n, const std::vector<int64_t>& params,
                   const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(kind >= kDense && kind <= kGguf, "unknown linear kind ", kind);
  if (kind != kGguf) {
    TORCH_CHECK(weights.size() == 1 && params.size() == 1, "a non-GGUF linear takes one weight and one param");
    return Linear{kind, weights[0], n, params[0], bias, {}, {}, {}};
  }
  TORCH_CHECK(!weights.empty() && params.size() == 2 * weights.size(),
              "a GGUF linear needs a type id and a row count per part");
  const auto half = params.begin() + static_cast<std::ptrdiff_t>(weights.size());
  return Linear{kind, {}, n, 0, bias, weights, {params.begin(), half}, {half, params.end()}};
}

inline bool is_quantized(const at::Tensor& cache) {
  const auto t = cache.scalar_type();
  return t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2 || t == at::kChar;
}

struct Layer {
  at::Tensor input_norm, post_norm;
  c10::optional<at::Tensor> q_norm, k_norm;
  std::vector<Linear> linears;  // qkv, o, gate_up, down
  c10::optional<at::Tensor> pre_ffn_norm, post_ffn_norm;  // Gemma 3's norms around the MLP
  int64_t window;  // Gemma 3: this layer's sliding window (0: global)
};

// Gemma 3's RMSNorm with its (1 + w) weight given in float32, by the ops and in the order GemmaRMSNorm.normed uses.
at::Tensor gemma_norm(const at::Tensor& x, const at::Tensor& w1, double eps) {
  at::Tensor x32 = x.to(at::kFloat);
  x32 = x32 * at::rsqrt(x32.pow(2).mean(-1, true) + eps);
  return (x32 * w1).to(x.scalar_type());
}

// Where a decode step's new K/V go and what it attends: the slots, the tables and the context lengths.
struct Paging {
  const at::Tensor &slot_blocks, &slot_offsets, &block_tables, &context_lens;
};

// A torch custom class (torch.classes.iterserve.DecoderStack), built once per model: add_layer, then that
// layer's four linear layers with add_linear, layer after layer; forward runs a decode step.
class DecoderStack : public torch::CustomClassHolder {
 public:
  DecoderStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale, bool gemma)
      : heads_(num_heads), kv_heads_(num_kv_heads), dim_(head_dim), eps_(eps), scale_(scale), gemma_(gemma) {}

  // A layer's norms (Gemma 3: all four and the q/k norms, as float32 (1 + w)) and its sliding window (Gemma 3).
  void add_layer(const at::Tensor& input_norm, const at::Tensor& post_norm, const c10::optional<at::Tensor>& q_norm,
                 const c10::optional<at::Tensor>& k_norm, const c10::optional<at::Tensor>& pre_ffn_norm,
                 const c10::optional<at::Tensor>& post_ffn_norm, int64_t window) {
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "QK-norm needs both weights");
    TORCH_CHECK(!gemma_ || (q_norm.has_value() && pre_ffn_norm.has_value() && post_ffn_norm.has_value()),
                "a Gemma 3 layer needs its q/k norms and its norms around the MLP");
    TORCH_CHECK(layers_.empty() || layers_.back().linears.size() == 4, "the last layer lacks its linear layers");
    layers_.push_back(Layer{input_norm.contiguous(), post_norm.contiguous(), q_norm, k_norm, {}, pre_ffn_norm,
                            post_ffn_norm, window});
  }

  // The last added layer's next linear layer (qkv, o, gate_up, down in turn); see make_linear.
  void add_linear(int64_t kind, const std::vector<at::Tensor>& weights, int64_t out_features,
                  const std::vector<int64_t>& params, const c10::optional<at::Tensor>& bias) {
    TORCH_CHECK(!layers_.empty() && layers_.back().linears.size() < 4, "add_linear needs a layer with room");
    layers_.back().linears.push_back(make_linear(kind, weights, out_features, params, bias));
  }

  // x [tokens, hidden], every token a decode (one query over its sequence's cached context) -> the last
  // layer's output and the residual stream before it, as iterserve.models.llama.DecoderLayer returns them
  // (Gemma 3, whose layers add their own residuals: the output twice). The LoRA weights come flat, with two counts per linear layer
  // (lora_rows). Gemma 3's local layers take the local RoPE and their window's paging (`local`: cos, sin, slot
  // blocks, slot offsets, block tables, context lengths).
  std::tuple<at::Tensor, at::Tensor> forward(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                                             const std::vector<at::Tensor>& k_caches,
                                             const std::vector<at::Tensor>& v_caches, const at::Tensor& slot_blocks,
                                             const at::Tensor& slot_offsets, const at::Tensor& block_tables,
                                             const at::Tensor& context_lens, int64_t sliding_window,
                                             const std::vector<at::Tensor>& k_scales,
                                             const std::vector<at::Tensor>& v_scales, const OptionalTensors& lora_a,
                                             const std::vector<at::Tensor>& lora_b, const std::vector<int64_t>& lora_parts,
                                             const std::vector<int64_t>& lora_counts,
                                             const c10::optional<at::Tensor>& lora_slots,
                                             const std::vector<at::Tensor>& local) const {
    TORCH_CHECK(k_caches.size() == layers_.size() && v_caches.size() == layers_.size(),
                "one K and one V cache per layer expected");
    TORCH_CHECK(layers_.empty() || layers_.back().linears.size() == 4, "the last layer lacks its linear layers");
    TORCH_CHECK(lora_counts.empty() || lora_counts.size() == 8 * layers_.size(),
                "LoRA weights for 4 linear layers per decoder layer expected");
    TORCH_CHECK(!gemma_ || local.size() == 6, "Gemma 3's local layers need their RoPE and paging (6 tensors)");
    TORCH_CHECK(block_tables.size(0) == x.size(0), "every token of a decode-only step is a decode");
    const Paging global{slot_blocks, slot_offsets, block_tables, context_lens};
    const Caches caches{k_caches, v_caches, k_scales, v_scales};
    if (gemma_) {
      const Paging windowed{local[2], local[3], local[4], local[5]};
      for (size_t l = 0; l < layers_.size(); ++l) {
        const bool is_local = layers_[l].window > 0;
        x = gemma_layer(l, x, is_local ? local[0] : cos, is_local ? local[1] : sin, is_local ? windowed : global,
                        caches);
      }
      return {x, x};
    }
    const LoRARows lora = lora_rows(lora_a, lora_b, lora_parts, lora_counts, lora_slots);
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
      const at::Tensor qkv = lora.add(L.linears[0](h), h, 4 * l);
      at::Tensor q = qkv.narrow(1, 0, q_size).view({n, heads_, dim_});
      at::Tensor k = qkv.narrow(1, q_size, kv_size).view({n, kv_heads_, dim_});
      const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({n, kv_heads_, dim_});
      if (L.q_norm.has_value()) {
        q = rms_norm(q, *L.q_norm, eps_);
        k = rms_norm(k, *L.k_norm, eps_);
      }
      rope_(q, k, cos, sin);
      const at::Tensor attn_out = attend(l, q, k, v, global, sliding_window, caches).view({n, q_size});
      x = lora.add(L.linears[1](attn_out), attn_out, 4 * l + 1);
      fused_add_rms_norm(x, residual, L.post_norm, eps_);
      const at::Tensor act = silu_and_mul(lora.add(L.linears[2](x), x, 4 * l + 2));
      x = lora.add(L.linears[3](act), act, 4 * l + 3);
    }
    return {x, residual};
  }

 private:
  struct Caches {
    const std::vector<at::Tensor>&k, &v, &k_scales, &v_scales;
  };

  // Write layer l's new K/V and attend with the paged decode kernel of its cache's kind (kv_quant_decode.cpp for
  // fp8 / int8, whose int8 caches come with scales).
  at::Tensor attend(size_t l, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const Paging& p,
                    int64_t window, const Caches& c) const {
    at::Tensor attn = at::empty({q.size(0), heads_, dim_}, q.options());
    if (is_quantized(c.k[l])) {
      const auto ks = c.k_scales.empty() ? c10::optional<at::Tensor>() : c.k_scales[l];
      const auto vs = c.v_scales.empty() ? c10::optional<at::Tensor>() : c.v_scales[l];
      write_kv_quant(k, v, c.k[l], c.v[l], ks, vs, p.slot_blocks, p.slot_offsets);
      paged_decode_quant(attn, q, c.k[l], c.v[l], ks, vs, p.block_tables, p.context_lens, scale_, window, 0);
    } else {
      write_kv(k, v, c.k[l], c.v[l], p.slot_blocks, p.slot_offsets);
      paged_decode(attn, q, c.k[l], c.v[l], p.block_tables, p.context_lens, scale_, window);
    }
    return attn;
  }

  // Gemma 3's layer l as Gemma3DecoderLayer.forward runs it (no LoRA: Gemma 3 takes none).
  at::Tensor gemma_layer(size_t l, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const Paging& p,
                         const Caches& c) const {
    const Layer& L = layers_[l];
    const int64_t n = x.size(0), q_size = heads_ * dim_, kv_size = kv_heads_ * dim_;
    const at::Tensor qkv = L.linears[0](gemma_norm(x, L.input_norm, eps_));
    at::Tensor q = gemma_norm(qkv.narrow(1, 0, q_size).view({n, heads_, dim_}), *L.q_norm, eps_);
    at::Tensor k = gemma_norm(qkv.narrow(1, q_size, kv_size).view({n, kv_heads_, dim_}), *L.k_norm, eps_);
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({n, kv_heads_, dim_});
    rope_(q, k, cos, sin);
    const at::Tensor attn_out = attend(l, q, k, v, p, L.window, c).view({n, q_size});
    const at::Tensor h = x + gemma_norm(L.linears[1](attn_out), L.post_norm, eps_);
    const at::Tensor gate_up = L.linears[2](gemma_norm(h, *L.pre_ffn_norm, eps_));
    const int64_t width = gate_up.size(1) / 2;
    const at::Tensor act = at::gelu(gate_up.narrow(1, 0, width), "tanh") * gate_up.narrow(1, width, width);
    return h + gemma_norm(L.linears[3](act), *L.post_ffn_norm, eps_);
  }

  int64_t heads_, kv_heads_, dim_;
  double eps_, scale_;
  bool gemma_;
  std::vector<Layer> layers_;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(iterserve, m) {
  m.class_<DecoderStack>("DecoderStack")
      .def(torch::init<int64_t, int64_t, int64_t, double, double, bool>())
      .def("add_layer", &DecoderStack::add_layer)
      .def("add_linear", &DecoderStack::add_linear)
      .def("forward", &DecoderStack::forward);
}
