// The arithmetic of minilade_native_layer's rows (native_layer.cpp) in lanes of kLanes floats: loads (of floats, and
// of the float16 halves the caches keep), fused multiply-adds, sums in a fixed tree, maxima and 2^x, each computing
// the same bits in a loop's vector body and its scalar remainder, whatever the other rows.

#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace {

constexpr int64_t kLanes = 16;  // the partial sums of every reduction
#if defined(__AVX512F__)
constexpr int64_t kVectorRegisters = 32, kLaneRegisters = 1;  // the processor's vector registers; a Lanes value's
#elif defined(__AVX__)
constexpr int64_t kVectorRegisters = 16, kLaneRegisters = 2;
#else
constexpr int64_t kVectorRegisters = 16, kLaneRegisters = 4;
#endif
constexpr float kLog2E = 1.4426950408889634f;

// Keys and values are kept in the caches as IEEE half floats (half the bytes a pass reads), each rounded to the
// nearest once, as it is written; a read widens kLanes of them to floats (exact).
using Half = _Float16;

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)
// kLanes floats as one value: on AVX2, two registers of 8, lanes 0-7 and 8-15, each operation spelled out on both.
// GCC compiles its vector extension at twice the register's width (the type below) into code that moves every fused
// result and widened half through the stack and general registers; on these two registers attention runs several
// times faster (perf on an AMD Zen 3), with the same operations lane by lane, so the same bits.
struct Lanes {
  __m256 lo, hi;
};
inline Lanes splat(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline Lanes zero_lanes() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline Lanes load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline Lanes load(const Half* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline void store(float* p, Lanes v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}
inline Lanes operator+(Lanes a, Lanes b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline Lanes operator*(Lanes a, Lanes b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline Lanes operator*(Lanes a, float b) { return a * splat(b); }
inline Lanes& operator+=(Lanes& a, Lanes b) { return a = a + b; }
// a * b + c rounded once, lane by lane (as std::fma: the same bits in a loop's vector body and its scalar remainder).
inline Lanes fused(Lanes a, Lanes b, Lanes c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
// The sum of the lanes, halved in a fixed tree: lanes l and l + 8, then l and l + 4, and so on.
inline float lane_sum(Lanes v) {
  const __m256 eights = _mm256_add_ps(v.lo, v.hi);
  const __m128 fours = _mm_add_ps(_mm256_castps256_ps128(eights), _mm256_extractf128_ps(eights, 1));
  const __m128 twos = _mm_add_ps(fours, _mm_movehl_ps(fours, fours));
  return _mm_cvtss_f32(_mm_add_ss(twos, _mm_movehdup_ps(twos)));
}
// The lane sums of kLanes values, v[s * kLanes ...] the lanes of the s-th (lane s of the result: lane_sum of it), each
// the same additions of the same pairs as lane_sum's tree, so the same bits, levels of it shared across the sums:
// lanes l and l + 8 of each (one addition a register, e[s]), then l and l + 4 of two e at a time (their halves in a
// register's two 128-bit halves), l and l + 2 of four at a time, l and l + 1 of eight, which leaves sums 0, 2, 4, 6
// in the low half and 1, 3, 5, 7 in the high half: one permutation puts them in order.
inline Lanes lane_sums(const float* v) {
  __m256 e[kLanes], fours[kLanes / 2], twos[kLanes / 4], ones[kLanes / 8];
  for (int s = 0; s < kLanes; ++s) {
    const Lanes lanes = load(v + s * kLanes);
    e[s] = _mm256_add_ps(lanes.lo, lanes.hi);
  }
  for (int p = 0; p < kLanes / 2; ++p) {  // [e[2p]'s lanes l + (l + 4), l < 4 | e[2p + 1]'s]
    fours[p] = _mm256_add_ps(_mm256_permute2f128_ps(e[2 * p], e[2 * p + 1], 0x20),
                             _mm256_permute2f128_ps(e[2 * p], e[2 * p + 1], 0x31));
  }
  for (int p = 0; p < kLanes / 4; ++p) {  // [sums 4p: l + (l + 2), l < 2, then 4p + 2's | 4p + 1's, 4p + 3's]
    twos[p] = _mm256_add_ps(_mm256_shuffle_ps(fours[2 * p], fours[2 * p + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                            _mm256_shuffle_ps(fours[2 * p], fours[2 * p + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  for (int p = 0; p < kLanes / 8; ++p) {  // [sums 8p, 8p + 2, 8p + 4, 8p + 6 | 8p + 1, 8p + 3, 8p + 5, 8p + 7]
    ones[p] = _mm256_add_ps(_mm256_shuffle_ps(twos[2 * p], twos[2 * p + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                            _mm256_shuffle_ps(twos[2 * p], twos[2 * p + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  }
  const __m256i in_order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  return {_mm256_permutevar8x32_ps(ones[0], in_order), _mm256_permutevar8x32_ps(ones[1], in_order)};
}
#else
// kLanes floats as one value (GCC's vector extension: one AVX-512 register), and loads of one from memory of any
// alignment.
typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));
typedef float UnalignedLanes __attribute__((vector_size(kLanes * sizeof(float)), aligned(alignof(float))));

inline Lanes splat(float x) { return Lanes{} + x; }
inline Lanes zero_lanes() { return Lanes{}; }
inline Lanes load(const float* p) { return *reinterpret_cast<const UnalignedLanes*>(p); }
inline Lanes load(const Half* p) {  // the processor's conversion instructions (the compiler's widen one at a time)
#if defined(__AVX512F__)
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#else
  Lanes v;
  for (int64_t l = 0; l < kLanes; ++l) v[l] = static_cast<float>(p[l]);
  return v;
#endif
}
inline void store(float* p, Lanes v) { *reinterpret_cast<UnalignedLanes*>(p) = v; }

// a * b + c rounded once, lane by lane (as std::fma: the same bits in a loop's vector body and its scalar remainder).
inline Lanes fused(Lanes a, Lanes b, Lanes c) {
#if defined(__AVX512F__)
  c = _mm512_fmadd_ps(a, b, c);  // Lanes is __m512's type
#else
  for (int64_t l = 0; l < kLanes; ++l) c[l] = std::fma(a[l], b[l], c[l]);
#endif
  return c;
}

// The sum of the lanes, halved in a fixed tree: lanes l and l + 8, then l and l + 4, and so on.
inline float lane_sum(Lanes v) {
  v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 8, 9, 10, 11, 12, 13, 14, 15);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  v += __builtin_shufflevector(v, v, 1, 0, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  return v[0];
}

// The lane sums of kLanes values, v[s * kLanes ...] the lanes of the s-th (lane s of the result: lane_sum of it), each
// the same additions of the same pairs as lane_sum's tree, so the same bits: four levels of two-register shuffles
// serve all kLanes sums at once.
inline Lanes lane_sums(const float* lanes) {
  Lanes v[kLanes], halves[8], quarters[4], eighths[2];
  for (int s = 0; s < kLanes; ++s) v[s] = load(lanes + s * kLanes);
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
#endif

// v with a[l] * b[l] added to each of its first n lanes (n < kLanes), each rounded once (std::fma): a sum's
// remainder past its last whole kLanes, in the lanes the vector body would have used.
inline Lanes fused_remainder(const float* a, const float* b, int64_t n, Lanes v) {
  alignas(64) float lanes[kLanes];
  store(lanes, v);
  for (int64_t l = 0; l < n; ++l) lanes[l] = std::fma(a[l], b[l], lanes[l]);
  return load(lanes);
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

// Sum of a[i] * b[i], i < n: kLanes partial sums (lane i % kLanes), then lane_sum.
inline float dot(const float* a, const float* b, int64_t n) {
  Lanes acc = zero_lanes();
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) acc += load(a + i) * load(b + i);
  if (i < n) {
    alignas(64) float lanes[kLanes];
    store(lanes, acc);
    for (int64_t l = 0; i + l < n; ++l) lanes[l] += a[i + l] * b[i + l];
    acc = load(lanes);
  }
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

}  // namespace
