// minilade_attention::weighted_sums: the sums that end a compiled step's attention (compiled.step_attention) as one
// operator, row by row in a fixed order of its own (attention_op.py builds and loads it; its docstring says why).
//
// Given each row's softmax numerators w (exactly 0 where a slot is hidden), for each batch entry b, key-value head
// and query row r (the G heads' rows of that key-value head, as compiled.chunked_attention stacks them):
//   chunk  = sum of w[s] * value[s] over a chunk's keys, in slot order: first the shared chunks (slots
//            [c * key_chunk, (c + 1) * key_chunk), weighted by shared[s]), then each tail chunk j (the tail slots
//            tail_keys[i] that tail_select[j, r, i] picks, in order)
//   total  = the chunks' sums added in that order
//   out    = total[:D] / total[D]                                   (values' column D holds ones)
// chunked_attention's sums, grouped the same way. Every number a row gets comes from its own weights in an order fixed
// by its keys, never by how many rows or slots the call has: a row's result is the same in a step of any width. Every
// key of a chunk is added, those a row does not see with weight 0: a sum starts at +0 and never becomes -0, so adding a
// zero product (the values are finite: PaddedKVCache) leaves it as it is, and padding (hidden slots, chunks no key of
// which a row sees) changes nothing. Each product is added by std::fma (one rounding, by definition, in vector and
// scalar code alike), and the build has -ffp-contract=off, so the compiler fuses nothing else: a row's bits do not
// depend on which place among the rows of a block it takes.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kRows = 4;  // rows that share each read of a value row

// The sums of up to kRows rows of one key-value head: w[i] each row's weights (Sp,) or nullptr (no row: its sums are
// computed from zero weights and not kept), picks[i] its tail_select row (tail chunk t at t * pick_stride), totals
// (kRows, Dp) the rows' totals. kDp: Dp where the compiler knows it (the
// demo model's 80), 0 where it does not (dp then says).
template <int64_t kDp>
void row_block_sums(const std::array<const float*, kRows>& w, const std::array<const float*, kRows>& picks,
                    const float* values, int64_t value_stride, const float* shared, const int64_t* tail, int64_t Sp,
                    int64_t C, int64_t n_tail, int64_t pick_stride, int64_t key_chunk, int64_t dp, float* totals) {
  const int64_t Dp = kDp > 0 ? kDp : dp;
  std::vector<float> acc_store(kRows * Dp);
  float* __restrict acc = acc_store.data();
  std::fill(totals, totals + kRows * Dp, 0.0f);
  auto add_to_totals = [&] {
    for (int64_t i = 0; i < kRows * Dp; ++i) totals[i] += acc[i];
  };
  for (int64_t c = 0; c < Sp / key_chunk; ++c) {
    std::fill(acc, acc + kRows * Dp, 0.0f);
    for (int64_t s = c * key_chunk; s < (c + 1) * key_chunk; ++s) {
      const float* __restrict v = values + s * value_stride;
      float ws[kRows];
      for (int64_t i = 0; i < kRows; ++i) ws[i] = w[i] != nullptr ? w[i][s] * shared[s] : 0.0f;
      for (int64_t i = 0; i < kRows; ++i)
        for (int64_t j = 0; j < Dp; ++j) acc[i * Dp + j] = std::fma(ws[i], v[j], acc[i * Dp + j]);
    }
    add_to_totals();
  }
  for (int64_t t = 0; t < n_tail; ++t) {
    std::fill(acc, acc + kRows * Dp, 0.0f);
    for (int64_t k = 0; k < C; ++k) {
      const int64_t s = tail[k];
      const float* __restrict v = values + s * value_stride;
      float ws[kRows];
      for (int64_t i = 0; i < kRows; ++i) ws[i] = w[i] != nullptr ? w[i][s] * picks[i][t * pick_stride + k] : 0.0f;
      for (int64_t i = 0; i < kRows; ++i)
        for (int64_t j = 0; j < Dp; ++j) acc[i * Dp + j] = std::fma(ws[i], v[j], acc[i * Dp + j]);
    }
    add_to_totals();
  }
}

// q (B, H, T, D): the queries whose sums these are (only their shape is read: rows = H / Hkv * T); weights (B, Hkv,
// R, Sp), whose first `rows` rows are theirs, and values (B, Hkv, Sp, Dp), each row of Sp (Dp) floats contiguous;
// the layout of compiled.graph_layout with a leading dimension of 1 (one for all entries) or B (one each): shared
// (Bl, Sp), tail_keys (Bl, C) long, tail_select (Bl, n_tail, R, C). Returns (B, Hkv, rows, D).
at::Tensor weighted_sums(const at::Tensor& q, const at::Tensor& weights, const at::Tensor& values,
                         const at::Tensor& shared, const at::Tensor& tail_keys, const at::Tensor& tail_select,
                         int64_t key_chunk) {
  TORCH_CHECK(weights.scalar_type() == at::kFloat && values.scalar_type() == at::kFloat &&
              shared.scalar_type() == at::kFloat && tail_select.scalar_type() == at::kFloat &&
              tail_keys.scalar_type() == at::kLong, "weighted_sums takes float32 weights, values and layout");
  TORCH_CHECK(weights.stride(3) == 1 && values.stride(3) == 1, "weighted_sums: rows must be contiguous");
  const int64_t B = weights.size(0), Hkv = weights.size(1), R = weights.size(2), Sp = weights.size(3);
  const int64_t rows = q.size(1) / Hkv * q.size(2), D = q.size(3);
  const int64_t Dp = values.size(3), Bl = shared.size(0), C = tail_keys.size(1), n_tail = tail_select.size(1);
  TORCH_CHECK(values.size(2) == Sp && Sp % key_chunk == 0 && C <= Sp && rows <= R && D < Dp &&
              (Bl == 1 || Bl == B), "weighted_sums: sizes that do not fit together");
  const auto weigh = shared.contiguous(), tail = tail_keys.contiguous(), pick = tail_select.contiguous();
  const float* w_data = weights.const_data_ptr<float>();
  const int64_t ws0 = weights.stride(0), ws1 = weights.stride(1), ws2 = weights.stride(2);
  const float* v_data = values.const_data_ptr<float>();
  const int64_t vs0 = values.stride(0), vs1 = values.stride(1), vs2 = values.stride(2);
  const int64_t blocks = (rows + kRows - 1) / kRows;
  auto out = at::empty({B, Hkv, rows, D}, values.options());
  float* out_data = out.data_ptr<float>();

  at::parallel_for(0, B * Hkv * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> totals(kRows * Dp);
    for (int64_t index = begin; index < end; ++index) {
      const int64_t b = index / (Hkv * blocks), kv = index / blocks % Hkv, first = index % blocks * kRows;
      const int64_t lb = Bl == 1 ? 0 : b;
      std::array<const float*, kRows> w{}, picks{};
      for (int64_t i = 0; i < kRows && first + i < rows; ++i) {
        w[i] = w_data + b * ws0 + kv * ws1 + (first + i) * ws2;
        picks[i] = pick.const_data_ptr<float>() + (lb * n_tail * R + first + i) * C;
      }
      const float* v_head = v_data + b * vs0 + kv * vs1;
      const float* shared_row = weigh.const_data_ptr<float>() + lb * Sp;
      const int64_t* tail_row = tail.const_data_ptr<int64_t>() + lb * C;
      if (Dp == 80)
        row_block_sums<80>(w, picks, v_head, vs2, shared_row, tail_row, Sp, C, n_tail, R * C, key_chunk, Dp,
                           totals.data());
      else
        row_block_sums<0>(w, picks, v_head, vs2, shared_row, tail_row, Sp, C, n_tail, R * C, key_chunk, Dp,
                          totals.data());
      for (int64_t i = 0; i < kRows && first + i < rows; ++i) {
        const float* total = totals.data() + i * Dp;
        float* orow = out_data + ((b * Hkv + kv) * rows + first + i) * D;
        for (int64_t d = 0; d < D; ++d) orow[d] = total[d] / total[D];
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(minilade_attention, m) {
  m.def("weighted_sums(Tensor q, Tensor weights, Tensor values, Tensor shared, Tensor tail_keys, "
        "Tensor tail_select, int key_chunk) -> Tensor");
}

TORCH_LIBRARY_IMPL(minilade_attention, CPU, m) {
  m.impl("weighted_sums", &weighted_sums);
}
