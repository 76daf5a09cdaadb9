// One row's attention over the slots of a float16 KV cache for minilade_native_layer (native_layer.cpp): scores,
// softmax and the weighted sum of values, each sum in slot order or in lanes' fixed trees, so that a row's result
// does not depend on the other rows of its pass.

#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "native_lanes.h"

namespace {

// How far ahead of its scores attention asks for a row's keys (prefetch_row says why), on AVX-512 builds. On a Zen 3
// (AVX2) passes of 1 to 16 rows, and of 8 one-row calls over caches of their own, ran 3-5% faster without asking:
// there the processor's own prefetching follows the ascending slots in time, so AVX2 builds do not ask.
#if defined(__AVX512F__)
constexpr int64_t kPrefetchSlots = 32;
#else
constexpr int64_t kPrefetchSlots = 0;
#endif

// The floats of room attend_heads needs for each head's weights over n slots: n rounded up to whole kLanes, so that
// every block of kLanes scores is stored whole.
inline int64_t padded_slots(int64_t n) { return (n + kLanes - 1) / kLanes * kLanes; }

// Column blocks of kLanes that the weighted sums of G heads add at once: as many (4, 2 or 1) as keep the G x blocks
// sums in half the processor's vector registers (kLaneRegisters a block), the rest for the values and weights.
constexpr int64_t column_blocks(int64_t G) {
  for (int64_t blocks : {4, 2}) {
    if (G * blocks * kLaneRegisters <= kVectorRegisters / 2) return blocks;
  }
  return 1;
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
void weighted_columns(const float* w, int64_t w_stride, const Half* values, const int32_t* slots, int64_t n,
                      int64_t slot_stride, int64_t d, int64_t D, const float* inverse_total, float* out) {
  Lanes sum[G][B];
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t b = 0; b < B; ++b) sum[g][b] = zero_lanes();
  }
  for (int64_t j = 0; j < n; ++j) {
    const Half* value = values + slots[j] * slot_stride + d;
    Lanes v[B];
    for (int64_t b = 0; b < B; ++b) v[b] = load(value + b * kLanes);
    for (int64_t g = 0; g < G; ++g) {
      const float weight = w[g * w_stride + j];
      for (int64_t b = 0; b < B; ++b) sum[g][b] = fused(splat(weight), v[b], sum[g][b]);
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t b = 0; b < B; ++b) {
      store(out + g * D + d + b * kLanes, sum[g][b] * inverse_total[g]);
    }
  }
}

// One row's attention for the G query heads of one key-value head (q: G heads of D floats, out likewise):
// softmax(q . k_s / sqrt(D)) over the row's n slots s, times v_s. The G heads read each key and value once.
// weights: G * padded_slots(n) floats of room (head g's at g * padded_slots(n)).
// Every sum has an order the code fixes, the same whatever n and the other rows: a score is dot()'s (kLanes partial
// sums over the head width, then lane_sum's tree, here kLanes slots' trees at once by lane_sums); a head's total
// and its weighted sum of values add the slots' terms in slot order.
template <int64_t G>
void attend_heads(const float* q, const Half* keys, const Half* values, int64_t key_stride, int64_t value_stride,
                  const int32_t* slots, int64_t n, int64_t D, float* weights, float* out) {
  const float scale = kLog2E / std::sqrt(static_cast<float>(D));
  const int64_t stride = padded_slots(n);
  for (int64_t first = 0; first < n; first += kLanes) {  // scores, kLanes slots at a time
    const int64_t m = std::min(kLanes, n - first);
    alignas(64) float partial[G][kLanes][kLanes];  // head g's lanes for slot first + s at partial[g][s]
    for (int64_t s = 0; s < m; ++s) {
      const Half* key = keys + slots[first + s] * key_stride;
      prefetch_row(values + slots[first + s] * value_stride, D);  // for the weighted sums after the scores
      if (kPrefetchSlots && first + s + kPrefetchSlots < n) {
        prefetch_row(keys + slots[first + s + kPrefetchSlots] * key_stride, D);
      }
      Lanes acc[G];
      for (int64_t g = 0; g < G; ++g) acc[g] = zero_lanes();
      int64_t i = 0;
      for (; i + 2 * kLanes <= D; i += 2 * kLanes) {  // two loads of the key ahead of their multiply-adds
        const Lanes k0 = load(key + i), k1 = load(key + i + kLanes);
        for (int64_t g = 0; g < G; ++g) acc[g] = fused(load(q + g * D + i), k0, acc[g]);
        for (int64_t g = 0; g < G; ++g) acc[g] = fused(load(q + g * D + i + kLanes), k1, acc[g]);
      }
      for (; i + kLanes <= D; i += kLanes) {
        const Lanes k = load(key + i);
        for (int64_t g = 0; g < G; ++g) acc[g] = fused(load(q + g * D + i), k, acc[g]);
      }
      if (i < D) {
        float k[kLanes];
        for (int64_t l = 0; i + l < D; ++l) k[l] = static_cast<float>(key[i + l]);
        for (int64_t g = 0; g < G; ++g) acc[g] = fused_remainder(q + g * D + i, k, D - i, acc[g]);
      }
      for (int64_t g = 0; g < G; ++g) store(partial[g][s], acc[g]);
    }
    for (int64_t s = m; s < kLanes; ++s) {  // slots past the last: zero lanes, sums never read
      for (int64_t g = 0; g < G; ++g) store(partial[g][s], zero_lanes());
    }
    for (int64_t g = 0; g < G; ++g) store(weights + g * stride + first, lane_sums(partial[g][0]) * scale);
  }
  float inverse_total[G];
  {
    float total[G];
    for (int64_t g = 0; g < G; ++g) {
      float* w = weights + g * stride;
      const float most = largest(w, n);
      for (int64_t j = 0; j < n; ++j) w[j] = exp2_approx(w[j] - most);
      total[g] = 0.0f;
    }
    for (int64_t j = 0; j < n; ++j) {  // the G heads' totals side by side, each in slot order
      for (int64_t g = 0; g < G; ++g) total[g] += weights[g * stride + j];
    }
    for (int64_t g = 0; g < G; ++g) inverse_total[g] = 1.0f / total[g];
  }
  constexpr int64_t B = column_blocks(G);
  int64_t d = 0;
  for (; d + B * kLanes <= D; d += B * kLanes) {
    weighted_columns<G, B>(weights, stride, values, slots, n, value_stride, d, D, inverse_total, out);
  }
  for (; d + kLanes <= D; d += kLanes) {
    weighted_columns<G, 1>(weights, stride, values, slots, n, value_stride, d, D, inverse_total, out);
  }
  for (; d < D; ++d) {  // a head width that is not a multiple of kLanes: its last columns one at a time
    for (int64_t g = 0; g < G; ++g) {
      float sum = 0.0f;
      for (int64_t j = 0; j < n; ++j) {
        sum = std::fma(weights[g * stride + j], static_cast<float>(values[slots[j] * value_stride + d]), sum);
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

}  // namespace
