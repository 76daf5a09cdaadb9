// minilade_native_layer::layers: every transformer layer of a forward pass (decoding steps and prompts) over w7a8
// weights, in C++ (native_steps.py); ::head: the final norm and output head over the rows whose logits a pass wants,
// and each row's greedy choice.
// A model's weights are registered once (add_layer, add_head, under a key; forget_model when it goes).
//
// x (R, dim) float32 holds the rows of one or more calls, each over its own KV cache: call c owns rows
// [start_c, start_c + T_c), writes their keys and values into its cache at slots [past_c, past_c + T_c), and each
// of its rows attends over the slots listed for it (visible_slots[row_offsets[r] : row_offsets[r + 1]], in
// ascending order). Every operation is written here (the arithmetic of lanes in native_lanes.h, attention in
// native_attention.h, the weight matmuls in native_matmul.h), row by row: the same code computes a row whatever the
// other rows, in an order of sums fixed by the code (lanes of kLanes, then a fixed tree), so a row's result does not
// depend on how many rows the pass has or which. The weight matmuls sum integer products, exact in any order, and
// give fbgemm's w7a8 call's bits (which serves where the processor has no integer dot products for them).
// Attention over a row's keys visits them in slot order, which is their positions' order: a token's keys and
// values come out the same whether the token was a row of a wide step or a step of its own. The caches keep keys
// and values in float16 (a call's keys and values rounded once, as they are written): attention over many caches
// reads as many bytes of them as of weights, and fewer bytes make it faster.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/quantized/PackedParams.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <unordered_map>
#include <tuple>
#include <utility>
#include <vector>

#include "native_attention.h"
#include "native_lanes.h"
#include "native_matmul.h"

namespace {

using Packed = c10::intrusive_ptr<LinearPackedParamsBase>;

constexpr double kCodesScale = 1.0;   // w7a8 activation codes are the integers themselves
constexpr int64_t kZeroPoint = 128;   // integer_linear.ZERO_POINT
constexpr float kActivationLevels = 127.0f;
constexpr int64_t kAttentionGrain = 1 << 10;  // keys x heads below which a pass's attention stays on one thread

// out = x / rms(x) * weight over each of the R rows of n columns (eps inside the root, as RMSNorm).
void rms_norm(const float* __restrict x, const float* __restrict weight, float eps, int64_t R, int64_t n,
              float* __restrict out) {
  for (int64_t r = 0; r < R; ++r) {
    const float* __restrict row = x + r * n;
    float* __restrict normed = out + r * n;
    const float inverse = 1.0f / std::sqrt(dot(row, row, n) / static_cast<float>(n) + eps);
    for (int64_t i = 0; i < n; ++i) normed[i] = row[i] * inverse * weight[i];
  }
}

// A w7a8 weight: its codes laid out for integer_matmul (native_matmul.h) where this build has the instructions for it,
// else fbgemm's packed object (a registered layer holds one or the other).
struct Linear {
  Packed packed;
  MatmulCodes codes;
};

// fbgemm's packing of w7a8 codes (N, K) int8 with their scales (N,): integer_linear.pack_weight's, the same call.
Packed fbgemm_packing(const at::Tensor& codes, const at::Tensor& scales) {
  static const auto prepack = c10::Dispatcher::singleton()
                                  .findSchemaOrThrow("quantized::linear_prepack", "")
                                  .typed<Packed(at::Tensor, std::optional<at::Tensor>)>();
  const at::Tensor quantized = at::_make_per_channel_quantized_tensor(
      codes.contiguous(), scales.to(at::kDouble), at::zeros({codes.size(0)}, at::kLong), 0);
  return prepack.call(quantized, std::nullopt);
}

void check_codes(const at::Tensor& codes, const at::Tensor& scales) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kChar && scales.dim() == 1 &&
                  scales.scalar_type() == at::kFloat && scales.size(0) == codes.size(0),
              "native layer: a w7a8 weight is codes (N, K) int8 with scales (N,) float32");
}

// y = x @ W.T for a w7a8 weight, each row of x rounded to 8-bit codes by its largest magnitude (integer_linear.py's
// W7A8Linear.forward, the same operations): x (R, K) -> (R, N). By integer_matmul where the weight's codes are laid
// out for it, else through fbgemm's call: the same bits either way.
at::Tensor w7a8_linear(const at::Tensor& x, const Linear& weight) {
  const int64_t R = x.size(0), K = x.size(1);
  std::vector<float> scales(R);
  for (int64_t r = 0; r < R; ++r) {
    const float* __restrict in = x.const_data_ptr<float>() + r * K;
    scales[r] = std::max(largest_magnitude(in, K), std::numeric_limits<float>::min()) / kActivationLevels;
  }
  if (weight.codes.codes.defined()) {
    const int64_t stride = weight.codes.K4;
    std::vector<uint8_t> codes(R * stride, 0);
    for (int64_t r = 0; r < R; ++r) {
      const float* __restrict in = x.const_data_ptr<float>() + r * K;
      uint8_t* __restrict out = codes.data() + r * stride;
      const float scale = scales[r];
      for (int64_t i = 0; i < K; ++i) out[i] = static_cast<uint8_t>(std::nearbyint(in[i] / scale) + kZeroPoint);
    }
    at::Tensor y = at::empty({R, weight.codes.N}, x.options());
    integer_matmul(weight.codes, codes.data(), R, scales.data(), y.mutable_data_ptr<float>());
    return y;
  }
  at::Tensor codes = at::empty_like(x);
  for (int64_t r = 0; r < R; ++r) {
    const float* __restrict in = x.const_data_ptr<float>() + r * K;
    float* __restrict out = codes.mutable_data_ptr<float>() + r * K;
    const float scale = scales[r];
    for (int64_t i = 0; i < K; ++i) out[i] = std::nearbyint(in[i] / scale);
  }
  at::Tensor y = weight.packed->apply_with_input_q_dq_qweight_dq_output_fp32(codes, kCodesScale, kZeroPoint);
  const int64_t N = y.size(1);
  for (int64_t r = 0; r < R; ++r) {
    float* __restrict row = y.mutable_data_ptr<float>() + r * N;
    const float scale = scales[r];
    for (int64_t i = 0; i < N; ++i) row[i] *= scale;
  }
  return y;
}

// x * cos + roll(x, D/2) * sin_signed over one head's D columns (model.apply_rope).
inline void rotate(float* __restrict x, const float* __restrict cos, const float* __restrict sin, int64_t D) {
  float rotated[512];
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; ++i) rotated[i] = x[i] * cos[i] + x[i + half] * sin[i];
  for (int64_t i = half; i < D; ++i) rotated[i] = x[i] * cos[i] + x[i - half] * sin[i];
  std::memcpy(x, rotated, D * sizeof(float));
}

// A layer's weights, registered once per model (add_layer) so that a pass hands the operator none of them; their
// matmuls are integer_matmul's unless registered without (every one through fbgemm's call, to compare the two).
struct LayerWeights {
  at::Tensor attention_norm, ffn_norm;  // (dim,) float32
  float eps;
  Linear wqkv, wo, gate_up, down;
  int64_t n_heads, n_kv_heads;
};

// A model's final norm and output head, registered once (add_head) beside its layers.
struct HeadWeights {
  at::Tensor norm;  // (dim,) float32
  float eps;
  Linear weight;    // (vocab, dim)
};

std::unordered_map<int64_t, std::vector<LayerWeights>>& models() {
  static std::unordered_map<int64_t, std::vector<LayerWeights>> by_key;
  return by_key;
}
std::unordered_map<int64_t, HeadWeights>& heads() {
  static std::unordered_map<int64_t, HeadWeights> by_key;
  return by_key;
}
std::mutex models_lock;

// A weight as a registered model keeps it, from its codes (N, K) int8 and scales (N,): the codes laid out for
// integer_matmul, or fbgemm's packing of them where its call computes the matmul (this build has no integer dot
// products, or integer_matmul is false).
Linear registered_linear(const at::Tensor& codes, const at::Tensor& scales, bool integer_matmul) {
  check_codes(codes, scales);
  if (integer_matmul && kHasDotProducts) return Linear{Packed(), matmul_codes(codes.contiguous(), scales)};
  return Linear{fbgemm_packing(codes, scales), {}};
}

void check_norm(const at::Tensor& norm) {
  TORCH_CHECK(norm.scalar_type() == at::kFloat && norm.dim() == 1 && norm.is_contiguous(),
              "native layer: norms must be (dim,) float32, contiguous");
}

void add_layer(int64_t model, const at::Tensor& attention_norm, const at::Tensor& ffn_norm, double eps,
               at::TensorList codes, at::TensorList scales, int64_t n_heads, int64_t n_kv_heads,
               bool integer_matmul) {
  check_norm(attention_norm);
  check_norm(ffn_norm);
  TORCH_CHECK(codes.size() == 4 && scales.size() == 4,
              "native layer: a layer has four weights (wqkv, wo, gate_up, down)");
  TORCH_CHECK(n_kv_heads > 0 && n_heads % n_kv_heads == 0, "native layer: heads must group evenly");
  auto linear = [&](size_t i) { return registered_linear(codes[i], scales[i], integer_matmul); };
  LayerWeights weights{attention_norm, ffn_norm, static_cast<float>(eps), linear(0), linear(1), linear(2),
                       linear(3), n_heads, n_kv_heads};
  std::lock_guard<std::mutex> guard(models_lock);
  models()[model].push_back(std::move(weights));
}

void add_head(int64_t model, const at::Tensor& norm, double eps, const at::Tensor& codes, const at::Tensor& scales,
              bool integer_matmul) {
  check_norm(norm);
  HeadWeights head{norm, static_cast<float>(eps), registered_linear(codes, scales, integer_matmul)};
  std::lock_guard<std::mutex> guard(models_lock);
  heads().insert_or_assign(model, std::move(head));
}

void forget_model(int64_t model) {
  std::lock_guard<std::mutex> guard(models_lock);
  models().erase(model);
  heads().erase(model);
}

at::Tensor layer(const at::Tensor& x_in, const at::Tensor& cos, const at::Tensor& sin, const LayerWeights& weights,
                 int64_t layer_index, at::TensorList keys, at::TensorList values, at::IntArrayRef call_rows,
                 at::IntArrayRef call_past, const at::Tensor& visible_slots, const at::Tensor& row_offsets) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "native layer: x must be (rows, dim) float32");
  const at::Tensor x = x_in.contiguous();
  const int64_t R = x.size(0), dim = x.size(1), D = cos.size(1);
  const int64_t H = weights.n_heads, Hkv = weights.n_kv_heads, G = H / Hkv;
  TORCH_CHECK(D <= 512 && D % 2 == 0, "native layer: head_dim must be even, at most 512");
  TORCH_CHECK(cos.size(0) == R && sin.size(0) == R && cos.is_contiguous() && sin.is_contiguous(),
              "native layer: cos and sin must be (rows, head_dim), contiguous");
  TORCH_CHECK(keys.size() == call_rows.size() && values.size() == call_rows.size() &&
                  call_past.size() == call_rows.size(), "native layer: one cache, row count and length a call");
  TORCH_CHECK(visible_slots.scalar_type() == at::kInt && row_offsets.scalar_type() == at::kLong &&
                  row_offsets.numel() == R + 1, "native layer: visible_slots int32, row_offsets int64 (rows + 1)");
  const float* cos_rows = cos.const_data_ptr<float>();
  const float* sin_rows = sin.const_data_ptr<float>();
  const float epsilon = weights.eps;

  // Attention: norm, q k v, rotary, the rows' keys and values into each call's cache, then each row over its slots.
  at::Tensor h = at::empty_like(x);
  rms_norm(x.const_data_ptr<float>(), weights.attention_norm.const_data_ptr<float>(), epsilon, R, dim,
           h.mutable_data_ptr<float>());
  at::Tensor qkv = w7a8_linear(h, weights.wqkv);  // (R, (H + 2 Hkv) D)
  float* qkv_rows = qkv.mutable_data_ptr<float>();
  const int64_t width = (H + 2 * Hkv) * D;
  std::vector<CallCache> caches;
  std::vector<int64_t> row_call(R);
  int64_t row = 0;
  for (int64_t c = 0; c < static_cast<int64_t>(call_rows.size()); ++c) {
    caches.push_back(layer_cache(keys[c], values[c], layer_index));
    for (int64_t t = 0; t < call_rows[c]; ++t, ++row) {
      row_call[row] = c;
      float* q = qkv_rows + row * width;
      for (int64_t head = 0; head < H + Hkv; ++head) rotate(q + head * D, cos_rows + row * D, sin_rows + row * D, D);
      const CallCache& cache = caches.back();
      for (int64_t kv = 0; kv < Hkv; ++kv) {
        const int64_t slot = call_past[c] + t;
        store_halves(q + (H + kv) * D, cache.keys + kv * cache.key_head_stride + slot * cache.key_slot_stride, D);
        store_halves(q + (H + Hkv + kv) * D, cache.values + kv * cache.value_head_stride +
                     slot * cache.value_slot_stride, D);
      }
    }
  }
  TORCH_CHECK(row == R, "native layer: the calls' rows must add up to x's");
  at::Tensor y = at::empty({R, H * D}, x.options());
  float* y_rows = y.mutable_data_ptr<float>();
  const int32_t* slots = visible_slots.const_data_ptr<int32_t>();
  const int64_t* offsets = row_offsets.const_data_ptr<int64_t>();
  // Tasks of one row and one key-value head's group of query heads, or of one query head where that leaves fewer
  // than two tasks a thread (a one-row step: its key-value heads would split unevenly); a pass with few keys in all
  // stays on this thread. A head's result is the same either way (attend's heads are computed independently).
  const int64_t heads_a_task = R * Hkv < 2 * at::get_num_threads() ? 1 : G, tasks_a_row = H / heads_a_task;
  const int64_t grain = std::max<int64_t>(1, kAttentionGrain * R / std::max<int64_t>(1, offsets[R] * H));
  at::parallel_for(0, R * tasks_a_row, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> weights;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / tasks_a_row, head = task % tasks_a_row * heads_a_task;
      const int64_t n = offsets[r + 1] - offsets[r];
      weights.resize(heads_a_task * padded_slots(n));
      attend(qkv_rows + r * width + head * D, caches[row_call[r]], head / G, slots + offsets[r], n, heads_a_task, D,
             weights.data(), y_rows + r * H * D + head * D);
    }
  });
  at::Tensor out = w7a8_linear(y, weights.wo);
  float* __restrict out_rows = out.mutable_data_ptr<float>();
  const float* __restrict x_rows = x.const_data_ptr<float>();
  for (int64_t i = 0; i < R * dim; ++i) out_rows[i] += x_rows[i];

  // Feed-forward: norm, gate and up, silu(gate) * up, down, residual.
  rms_norm(out_rows, weights.ffn_norm.const_data_ptr<float>(), epsilon, R, dim, h.mutable_data_ptr<float>());
  at::Tensor gu = w7a8_linear(h, weights.gate_up);  // (R, 2I)
  const int64_t I = gu.size(1) / 2;
  at::Tensor act = at::empty({R, I}, x.options());
  for (int64_t r = 0; r < R; ++r) {
    const float* __restrict gate = gu.const_data_ptr<float>() + r * 2 * I;
    const float* __restrict up = gate + I;
    float* __restrict row = act.mutable_data_ptr<float>() + r * I;
    for (int64_t i = 0; i < I; ++i) row[i] = gate[i] / (1.0f + exp2_approx(-gate[i] * kLog2E)) * up[i];
  }
  at::Tensor ffn = w7a8_linear(act, weights.down);
  const float* __restrict ffn_rows = ffn.const_data_ptr<float>();
  for (int64_t i = 0; i < R * dim; ++i) out_rows[i] += ffn_rows[i];
  return out;
}

// Every layer of a registered model over the rows of one or more calls (the file's first comment).
at::Tensor layers(int64_t model, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                  at::TensorList keys, at::TensorList values, at::IntArrayRef call_rows, at::IntArrayRef call_past,
                  const at::Tensor& visible_slots, const at::Tensor& row_offsets) {
  const std::vector<LayerWeights>* stack;
  {
    std::lock_guard<std::mutex> guard(models_lock);
    auto found = models().find(model);
    TORCH_CHECK(found != models().end(), "native layer: no model registered under ", model);
    stack = &found->second;  // entries are only erased by forget_model, once the model is gone
  }
  at::Tensor out = x;
  for (int64_t i = 0; i < static_cast<int64_t>(stack->size()); ++i) {
    out = layer(out, cos, sin, (*stack)[i], i, keys, values, call_rows, call_past, visible_slots, row_offsets);
  }
  return out;
}

// The first index of the largest of row[a, b) with its value, a NaN counting as larger than any number: the rule of
// torch.argmax and numpy's argmax (sampling.largest).
std::pair<float, int64_t> first_largest(const float* __restrict row, int64_t a, int64_t b) {
  bool any_nan = false;
  for (int64_t i = a; i < b; ++i) any_nan |= std::isnan(row[i]);
  const float most = any_nan ? std::numeric_limits<float>::quiet_NaN() : largest(row + a, b - a);
  for (int64_t i = a; i < b; ++i) {
    if (any_nan ? std::isnan(row[i]) : row[i] == most) return {row[i], i};
  }
  return {-std::numeric_limits<float>::infinity(), a};  // empty
}

// Each row's greedy choice over logits (R, V): first_largest of its row, as (R,) int64. The columns are split among
// the threads as the head's matmul splits its column blocks, so that each reads the logits it wrote, while they are
// still in its caches; the parts' winners are then taken in column order (the first of equal ones).
at::Tensor choices(const at::Tensor& logits) {
  const int64_t R = logits.size(0), V = logits.size(1);
  const float* data = logits.const_data_ptr<float>();
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), V / 4096));
  const int64_t span = (V + parts - 1) / parts;
  std::vector<std::pair<float, int64_t>> won(parts * R);
  at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t a = p * span, b = std::min(V, a + span);
      for (int64_t r = 0; r < R; ++r) won[p * R + r] = first_largest(data + r * V, a, b);
    }
  });
  at::Tensor out = at::empty({R}, at::kLong);
  int64_t* chosen = out.mutable_data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) {
    auto best = won[r];
    for (int64_t p = 1; p < parts; ++p) {
      const auto [value, index] = won[p * R + r];
      if (!std::isnan(best.first) && (std::isnan(value) || value > best.first)) best = {value, index};
    }
    chosen[r] = best.second;
  }
  return out;
}

// The logits of rows of the last layer's output, x (R, dim) -> (R, vocab): the final norm, then the output head, as
// the layers compute theirs (each row's own operations, the head's bits at every row count); and each row's greedy
// choice over them (choices), (R,) int64, found while they are still in the caches of the threads that wrote them.
std::tuple<at::Tensor, at::Tensor> head(int64_t model, const at::Tensor& x_in) {
  const HeadWeights* weights;
  {
    std::lock_guard<std::mutex> guard(models_lock);
    auto found = heads().find(model);
    TORCH_CHECK(found != heads().end(), "native layer: no head registered under ", model);
    weights = &found->second;  // erased only by forget_model, once the model is gone
  }
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.size(1) == weights->norm.size(0),
              "native layer: x must be (rows, dim) float32");
  const at::Tensor x = x_in.contiguous();
  at::Tensor normed = at::empty_like(x);
  rms_norm(x.const_data_ptr<float>(), weights->norm.const_data_ptr<float>(), weights->eps, x.size(0), x.size(1),
           normed.mutable_data_ptr<float>());
  at::Tensor logits = w7a8_linear(normed, weights->weight);
  return {logits, choices(logits)};
}

// One w7a8 matmul as a pass computes it, or through fbgemm's call (for tests: the two give the same bits).
at::Tensor linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, bool by_fbgemm) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "native layer: x must be (rows, K) float32");
  return w7a8_linear(x.contiguous(), registered_linear(codes, scales, !by_fbgemm));
}

}  // namespace

TORCH_LIBRARY(minilade_native_layer, m) {
  m.def(
      "add_layer(int model, Tensor attention_norm, Tensor ffn_norm, float eps, Tensor[] codes, Tensor[] scales, "
      "int n_heads, int n_kv_heads, bool integer_matmul=True) -> ()",
      add_layer);
  m.def("add_head(int model, Tensor norm, float eps, Tensor codes, Tensor scales, bool integer_matmul=True) -> ()",
        add_head);
  m.def("head(int model, Tensor x) -> (Tensor, Tensor)", head);
  m.def("choices(Tensor logits) -> Tensor", [](const at::Tensor& logits) {  // head's rule on any logits (tests)
    TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat, "native layer: logits must be (R, V) float32");
    return choices(logits.contiguous());
  });
  m.def("forget_model(int model) -> ()", forget_model);
  m.def(
      "layers(int model, Tensor x, Tensor cos, Tensor sin, Tensor[] keys, Tensor[] values, int[] call_rows, "
      "int[] call_past, Tensor visible_slots, Tensor row_offsets) -> Tensor",
      layers);
  m.def("linear(Tensor x, Tensor codes, Tensor scales, bool by_fbgemm) -> Tensor", linear);
  m.def("has_integer_matmul() -> bool", []() { return kHasDotProducts; });
  m.def("has_matrix_tiles() -> bool", []() { return kHasMatrixTiles && matrix_tiles_granted(); });
  m.def("use_matrix_tiles(bool on) -> ()", [](bool on) { matrix_tiles_on().store(on && kHasMatrixTiles); });
  m.def("uses_matrix_tiles() -> bool", []() { return matrix_tiles_on().load() && matrix_tiles_granted(); });
}
