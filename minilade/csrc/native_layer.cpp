// minilade_native_layer::layers: every transformer layer of a forward pass (decoding steps and prompts) over w7a8
// weights, in C++ (native_steps.py). A model's layers are registered once (add_layer, under a key; forget_model
// when it goes).
//
// x (R, dim) float32 holds the rows of one or more calls, each over its own KV cache: call c owns rows
// [start_c, start_c + T_c), writes their keys and values into its cache at slots [past_c, past_c + T_c), and each
// of its rows attends over the slots listed for it (visible_slots[row_offsets[r] : row_offsets[r + 1]], in
// ascending order). Every operation but the weight matmuls is written here, row by row: the same code computes a
// row whatever the other rows, in an order of sums fixed by the code (lanes of kLanes, then a fixed tree), so a
// row's result does not depend on how many rows the pass has or which. The weight matmuls are fbgemm's w7a8 kernel
// over all rows at once, which gives each row the same bits at every row count (the load-time check verifies it).
// Attention over a row's keys visits them in slot order, which is their positions' order: a token's keys and
// values come out the same whether the token was a row of a wide step or a step of its own. The caches keep keys
// and values in float16 (a call's keys and values rounded once, as they are written): attention over many caches
// reads as many bytes of them as of weights, and fewer bytes make it faster.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/quantized/PackedParams.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace {

using Packed = c10::intrusive_ptr<LinearPackedParamsBase>;

constexpr int64_t kLanes = 16;        // the partial sums of every reduction
constexpr double kCodesScale = 1.0;   // w7a8 activation codes are the integers themselves
constexpr int64_t kZeroPoint = 128;   // integer_linear.ZERO_POINT
constexpr float kActivationLevels = 127.0f;
constexpr float kLog2E = 1.4426950408889634f;
constexpr int64_t kAttentionGrain = 1 << 10;  // keys x heads below which a pass's attention stays on one thread
constexpr int64_t kPrefetchSlots = 32;        // how far ahead of its scores attention asks for a row's keys

// kLanes floats as one value (GCC's vector extension: one AVX-512 register, two AVX2 ones), and loads of one from
// memory of any alignment.
typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));
typedef float UnalignedLanes __attribute__((vector_size(kLanes * sizeof(float)), aligned(alignof(float))));

inline Lanes load(const float* p) { return *reinterpret_cast<const UnalignedLanes*>(p); }

// Keys and values are kept in the caches as IEEE half floats (half the bytes a pass reads), each rounded to the
// nearest once, as it is written; a read widens kLanes of them to floats (exact).
using Half = _Float16;

inline Lanes load(const Half* p) {  // the processor's conversion instructions (the compiler's widen one at a time)
  Lanes v;
#if defined(__AVX512F__)
  v = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__F16C__)
  const __m256 low = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256 high = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
  std::memcpy(&v, &low, sizeof low);
  std::memcpy(reinterpret_cast<char*>(&v) + sizeof low, &high, sizeof high);
#else
  for (int64_t l = 0; l < kLanes; ++l) v[l] = static_cast<float>(p[l]);
#endif
  return v;
}

// a * b + c rounded once, lane by lane (as std::fma: the same bits in a loop's vector body and its scalar remainder).
inline Lanes fused(Lanes a, Lanes b, Lanes c) {
#if defined(__AVX512F__)
  c = _mm512_fmadd_ps(a, b, c);  // Lanes is __m512's type
#else
  for (int64_t l = 0; l < kLanes; ++l) c[l] = std::fma(a[l], b[l], c[l]);
#endif
  return c;
}

// Ask for the cache lines of a row of D halves ahead of its reads: a row's keys and values are short runs of memory
// (some 32 KB a head), which the processor's own prefetching does not reach in time.
inline void prefetch_row(const Half* row, int64_t D) {
  for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(Half)); b += 64) {
    __builtin_prefetch(reinterpret_cast<const char*>(row) + b);
  }
}

// n floats rounded to halves (to the nearest, ties to even: as torch's conversion).
inline void store_halves(const float* __restrict from, Half* __restrict to, int64_t n) {
  for (int64_t i = 0; i < n; ++i) to[i] = static_cast<Half>(from[i]);
}

// The sum of the lanes, halved in a fixed tree: lanes l and l + 8, then l and l + 4, and so on.
inline float lane_sum(Lanes v) {
  v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 8, 9, 10, 11, 12, 13, 14, 15);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  v += __builtin_shufflevector(v, v, 1, 0, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  return v[0];
}

// Sum of a[i] * b[i], i < n: kLanes partial sums (lane i % kLanes), then lane_sum.
inline float dot(const float* a, const float* b, int64_t n) {
  Lanes acc = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) acc += load(a + i) * load(b + i);
  for (int64_t l = 0; i + l < n; ++l) acc[l] += a[i + l] * b[i + l];
  return lane_sum(acc);
}

// The largest |a[i]|, i < n (exact in any order; kLanes partial maxima so that the compiler vectorises it).
inline float largest_magnitude(const float* __restrict a, int64_t n) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) acc[l] = std::max(acc[l], std::fabs(a[i + l]));
  }
  for (int64_t l = 0; i + l < n; ++l) acc[l] = std::max(acc[l], std::fabs(a[i + l]));
  float largest = 0.0f;
  for (int64_t l = 0; l < kLanes; ++l) largest = std::max(largest, acc[l]);
  return largest;
}

// 2^x to a few units in the last place, in operations the compiler vectorises (so a loop's vector body and its
// scalar remainder give the same bits): x = k + f with k the nearest integer, 2^f by its Taylor polynomial of
// degree 7 (relative error under 1e-8 for |f| <= 1/2), 2^k in the exponent bits; 0 for x below -126.
inline float exp2_approx(float x) {
  const float clamped = x < -126.0f ? -126.0f : (x > 127.0f ? 127.0f : x);
  const float k = std::nearbyint(clamped);
  const float f = clamped - k;
  float p = 1.5252733804059841e-5f;  // ln(2)^7 / 7!
  p = p * f + 1.5403530393381609e-4f;
  p = p * f + 1.3333558146428443e-3f;
  p = p * f + 9.6181291076284772e-3f;
  p = p * f + 5.5504108664821580e-2f;
  p = p * f + 2.4022650695910071e-1f;
  p = p * f + 6.9314718055994531e-1f;
  p = p * f + 1.0f;
  const float scale = __builtin_bit_cast(float, (static_cast<int32_t>(k) + 127) << 23);
  return x < -126.0f ? 0.0f : p * scale;
}

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

// y = x @ W.T for a w7a8 weight, each row of x rounded to 8-bit codes by its largest magnitude (integer_linear.py's
// W7A8Linear.forward, the same operations): x (R, K) -> (R, N).
at::Tensor w7a8_linear(const at::Tensor& x, const Packed& weight) {
  const int64_t R = x.size(0), K = x.size(1);
  at::Tensor codes = at::empty_like(x);
  std::vector<float> scales(R);
  for (int64_t r = 0; r < R; ++r) {
    const float* __restrict in = x.const_data_ptr<float>() + r * K;
    float* __restrict out = codes.mutable_data_ptr<float>() + r * K;
    const float scale = std::max(largest_magnitude(in, K), std::numeric_limits<float>::min()) / kActivationLevels;
    for (int64_t i = 0; i < K; ++i) out[i] = std::nearbyint(in[i] / scale);
    scales[r] = scale;
  }
  at::Tensor y = weight->apply_with_input_q_dq_qweight_dq_output_fp32(codes, kCodesScale, kZeroPoint);
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

// One layer of a call's cache: slot s of key-value head h at keys + h * key_head_stride + s * key_slot_stride, and
// likewise in values (its first D columns).
struct CallCache {
  Half* keys;
  Half* values;
  int64_t key_head_stride, key_slot_stride, value_head_stride, value_slot_stride;
};

CallCache layer_cache(const at::Tensor& k, const at::Tensor& v, int64_t layer) {
  // k: (L, 1, Hkv, S, D), v: (L, 1, Hkv, S, Dv), Dv >= D
  TORCH_CHECK(k.size(1) == 1 && v.size(1) == 1, "native layer: one sequence a cache");
  TORCH_CHECK(k.scalar_type() == at::kHalf && v.scalar_type() == at::kHalf, "native layer: float16 caches");
  TORCH_CHECK(k.stride(4) == 1 && v.stride(4) == 1, "native layer: cache rows must be contiguous");
  return {reinterpret_cast<Half*>(k.mutable_data_ptr<at::Half>()) + layer * k.stride(0),
          reinterpret_cast<Half*>(v.mutable_data_ptr<at::Half>()) + layer * v.stride(0),
          k.stride(2), k.stride(3), v.stride(2), v.stride(3)};
}

// The G heads' weighted sums of the values over columns [d, d + B * kLanes): out_g = sum_j w_g[j] v_j / total_g,
// the terms added in slot order, the G x B column blocks side by side so that their sums do not wait on each other;
// each value row read once for all G heads.
template <int64_t G, int64_t B>
void weighted_columns(const float* w, const Half* values, const int32_t* slots, int64_t n, int64_t slot_stride,
                      int64_t d, int64_t D, const float* inverse_total, float* out) {
  Lanes sum[G][B] = {};
  for (int64_t j = 0; j < n; ++j) {
    const Half* value = values + slots[j] * slot_stride + d;
    Lanes v[B];
    for (int64_t b = 0; b < B; ++b) v[b] = load(value + b * kLanes);
    for (int64_t g = 0; g < G; ++g) {
      const float weight = w[g * n + j];
      for (int64_t b = 0; b < B; ++b) sum[g][b] = fused(Lanes{} + weight, v[b], sum[g][b]);
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t b = 0; b < B; ++b) {
      const Lanes mean = sum[g][b] * inverse_total[g];
      std::memcpy(out + g * D + d + b * kLanes, &mean, sizeof mean);
    }
  }
}

// The lane sums of v[0..kLanes) (lane s of the result: lane_sum(v[s])), each the same additions of the same pairs as
// lane_sum's tree, so the same bits: four levels of two-register shuffles serve all kLanes sums at once.
inline Lanes lane_sums(const Lanes* v) {
  Lanes halves[8], quarters[4], eighths[2];
  for (int p = 0; p < 8; ++p) {  // lanes l and l + 8 of v[2p] (into lanes 0-7) and of v[2p + 1] (8-15)
    halves[p] = __builtin_shufflevector(v[2 * p], v[2 * p + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22,
                                        23) +
                __builtin_shufflevector(v[2 * p], v[2 * p + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29,
                                        30, 31);
  }
  for (int p = 0; p < 4; ++p) {  // then l and l + 4 of each, four vectors' a register
    quarters[p] = __builtin_shufflevector(halves[2 * p], halves[2 * p + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19,
                                          24, 25, 26, 27) +
                  __builtin_shufflevector(halves[2 * p], halves[2 * p + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23,
                                          28, 29, 30, 31);
  }
  for (int p = 0; p < 2; ++p) {  // then l and l + 2, eight vectors' a register
    eighths[p] = __builtin_shufflevector(quarters[2 * p], quarters[2 * p + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20,
                                         21, 24, 25, 28, 29) +
                 __builtin_shufflevector(quarters[2 * p], quarters[2 * p + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22,
                                         23, 26, 27, 30, 31);
  }
  return __builtin_shufflevector(eighths[0], eighths[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(eighths[0], eighths[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

// The largest of a[0..n) (exact in any order; kLanes partial maxima so that the compiler vectorises it).
inline float largest(const float* __restrict a, int64_t n) {
  float acc[kLanes];
  for (int64_t l = 0; l < kLanes; ++l) acc[l] = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) acc[l] = std::max(acc[l], a[i + l]);
  }
  for (int64_t l = 0; i + l < n; ++l) acc[l] = std::max(acc[l], a[i + l]);
  float most = acc[0];
  for (int64_t l = 1; l < kLanes; ++l) most = std::max(most, acc[l]);
  return most;
}

// One row's attention for the G query heads of one key-value head (q: G heads of D floats, out likewise):
// softmax(q . k_s / sqrt(D)) over the row's n slots s, times v_s. The G heads read each key and value once.
// weights: G * n floats of room (head g's at g * n).
// Every sum has an order the code fixes, the same whatever n and the other rows: a score is dot()'s (kLanes partial
// sums over the head width, then lane_sum's tree, here kLanes slots' trees at once by lane_sums); a head's total
// and its weighted sum of values add the slots' terms in slot order.
template <int64_t G>
void attend_heads(const float* q, const Half* keys, const Half* values, int64_t key_stride, int64_t value_stride,
                  const int32_t* slots, int64_t n, int64_t D, float* weights, float* out) {
  const float scale = kLog2E / std::sqrt(static_cast<float>(D));
  Lanes partial[G][kLanes];
  for (int64_t first = 0; first < n; first += kLanes) {  // scores, kLanes slots at a time
    const int64_t m = std::min(kLanes, n - first);
    for (int64_t s = 0; s < kLanes; ++s) {
      for (int64_t g = 0; g < G; ++g) partial[g][s] = Lanes{};
      if (s >= m) continue;  // past the last slot: lanes of their own, never read
      const Half* key = keys + slots[first + s] * key_stride;
      prefetch_row(values + slots[first + s] * value_stride, D);  // for the weighted sums after the scores
      if (first + s + kPrefetchSlots < n) prefetch_row(keys + slots[first + s + kPrefetchSlots] * key_stride, D);
      int64_t i = 0;
      for (; i + kLanes <= D; i += kLanes) {
        const Lanes k = load(key + i);
        for (int64_t g = 0; g < G; ++g) partial[g][s] = fused(load(q + g * D + i), k, partial[g][s]);
      }
      for (int64_t g = 0; g < G; ++g) {
        for (int64_t l = 0; i + l < D; ++l) {
          partial[g][s][l] = std::fma(q[g * D + i + l], static_cast<float>(key[i + l]), partial[g][s][l]);
        }
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      const Lanes scores = lane_sums(partial[g]) * scale;
      std::memcpy(weights + g * n + first, &scores, m * sizeof(float));
    }
  }
  float inverse_total[G];
  {
    float total[G];
    for (int64_t g = 0; g < G; ++g) {
      float* w = weights + g * n;
      const float most = largest(w, n);
      for (int64_t j = 0; j < n; ++j) w[j] = exp2_approx(w[j] - most);
      total[g] = 0.0f;
    }
    for (int64_t j = 0; j < n; ++j) {  // the G heads' totals side by side, each in slot order
      for (int64_t g = 0; g < G; ++g) total[g] += weights[g * n + j];
    }
    for (int64_t g = 0; g < G; ++g) inverse_total[g] = 1.0f / total[g];
  }
  int64_t d = 0;
  for (; d + 4 * kLanes <= D; d += 4 * kLanes) weighted_columns<G, 4>(weights, values, slots, n, value_stride, d, D,
                                                                       inverse_total, out);
  for (; d + kLanes <= D; d += kLanes) weighted_columns<G, 1>(weights, values, slots, n, value_stride, d, D,
                                                              inverse_total, out);
  for (; d < D; ++d) {  // a head width that is not a multiple of kLanes: its last columns one at a time
    for (int64_t g = 0; g < G; ++g) {
      float sum = 0.0f;
      for (int64_t j = 0; j < n; ++j) {
        sum = std::fma(weights[g * n + j], static_cast<float>(values[slots[j] * value_stride + d]), sum);
      }
      out[g * D + d] = sum * inverse_total[g];
    }
  }
}

// One row's attention (attend_heads) for the G query heads of one key-value head, the groups of the models served
// compiled as such; any other group one head at a time.
void attend(const float* q, const CallCache& cache, int64_t kv_head, const int32_t* slots, int64_t n, int64_t G,
            int64_t D, float* weights, float* out) {
  const Half* keys = cache.keys + kv_head * cache.key_head_stride;
  const Half* values = cache.values + kv_head * cache.value_head_stride;
  const int64_t ks = cache.key_slot_stride, vs = cache.value_slot_stride;
  switch (G) {
    case 1: return attend_heads<1>(q, keys, values, ks, vs, slots, n, D, weights, out);
    case 2: return attend_heads<2>(q, keys, values, ks, vs, slots, n, D, weights, out);
    case 3: return attend_heads<3>(q, keys, values, ks, vs, slots, n, D, weights, out);
    case 4: return attend_heads<4>(q, keys, values, ks, vs, slots, n, D, weights, out);
    default:
      for (int64_t g = 0; g < G; ++g) {
        attend_heads<1>(q + g * D, keys, values, ks, vs, slots, n, D, weights, out + g * D);
      }
  }
}

// A layer's weights, registered once per model (add_layer) so that a pass hands the operator none of them.
struct LayerWeights {
  at::Tensor attention_norm, ffn_norm;  // (dim,) float32
  float eps;
  Packed wqkv, wo, gate_up, down;
  int64_t n_heads, n_kv_heads;
};

std::unordered_map<int64_t, std::vector<LayerWeights>>& models() {
  static std::unordered_map<int64_t, std::vector<LayerWeights>> by_key;
  return by_key;
}
std::mutex models_lock;

void add_layer(int64_t model, const at::Tensor& attention_norm, const at::Tensor& ffn_norm, double eps,
               const Packed& wqkv, const Packed& wo, const Packed& gate_up, const Packed& down, int64_t n_heads,
               int64_t n_kv_heads) {
  TORCH_CHECK(attention_norm.scalar_type() == at::kFloat && ffn_norm.scalar_type() == at::kFloat &&
                  attention_norm.is_contiguous() && ffn_norm.is_contiguous(), "native layer: float32 norms");
  TORCH_CHECK(n_kv_heads > 0 && n_heads % n_kv_heads == 0, "native layer: heads must group evenly");
  std::lock_guard<std::mutex> guard(models_lock);
  models()[model].push_back({attention_norm, ffn_norm, static_cast<float>(eps), wqkv, wo, gate_up, down, n_heads,
                             n_kv_heads});
}

void forget_model(int64_t model) {
  std::lock_guard<std::mutex> guard(models_lock);
  models().erase(model);
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
  // Tasks of one row and one key-value head; a pass with few keys in all stays on this thread.
  const int64_t grain = std::max<int64_t>(1, kAttentionGrain * R / std::max<int64_t>(1, offsets[R] * H));
  at::parallel_for(0, R * Hkv, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> weights;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / Hkv, kv = task % Hkv;
      const int64_t n = offsets[r + 1] - offsets[r];
      weights.resize(G * n);
      attend(qkv_rows + r * width + kv * G * D, caches[row_call[r]], kv, slots + offsets[r], n, G, D,
             weights.data(), y_rows + r * H * D + kv * G * D);
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

}  // namespace

TORCH_LIBRARY(minilade_native_layer, m) {
  m.def(
      "add_layer(int model, Tensor attention_norm, Tensor ffn_norm, float eps, "
      "__torch__.torch.classes.quantized.LinearPackedParamsBase wqkv, "
      "__torch__.torch.classes.quantized.LinearPackedParamsBase wo, "
      "__torch__.torch.classes.quantized.LinearPackedParamsBase gate_up, "
      "__torch__.torch.classes.quantized.LinearPackedParamsBase down, int n_heads, int n_kv_heads) -> ()",
      add_layer);
  m.def("forget_model(int model) -> ()", forget_model);
  m.def(
      "layers(int model, Tensor x, Tensor cos, Tensor sin, Tensor[] keys, Tensor[] values, int[] call_rows, "
      "int[] call_past, Tensor visible_slots, Tensor row_offsets) -> Tensor",
      layers);
}
