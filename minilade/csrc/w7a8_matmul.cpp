// minilade::w7a8_matmul's C++ body (integer_linear.load_native_matmul builds and loads it in place of the Python
// one): the same fbgemm call with the same arguments, so the same bits, without a trip through Python on each of
// a compiled step's 121 matmuls (about 10 us each, 1.2 ms of a 9.6 ms one-row step of the demo model).
//
// A graph cannot hold fbgemm's packed weight, so the operator is handed the layer's weight scales and finds the
// packed weight by their address, which W7A8Linear registers (w7a8_register) and drops when the layer goes
// (w7a8_forget, only if the address still holds that layer's weight: a newer layer may have taken it).

#include <ATen/native/quantized/PackedParams.h>
#include <torch/library.h>

#include <mutex>
#include <unordered_map>

namespace {

using Packed = c10::intrusive_ptr<LinearPackedParamsBase>;

constexpr double kCodesScale = 1.0;   // the codes are the integers themselves (integer_linear.W7A8Linear.forward)
constexpr int64_t kZeroPoint = 128;   // integer_linear.ZERO_POINT: codes in [-127, 127] as u8

std::unordered_map<int64_t, Packed>& layers() {
  static std::unordered_map<int64_t, Packed> by_address;
  return by_address;
}
std::mutex layers_lock;

int64_t address_of(const at::Tensor& scales) {
  return reinterpret_cast<int64_t>(scales.const_data_ptr());
}

void w7a8_register(const at::Tensor& scales, const Packed& packed) {
  std::lock_guard<std::mutex> guard(layers_lock);
  layers()[address_of(scales)] = packed;
}

void w7a8_forget(int64_t address, const Packed& packed) {
  std::lock_guard<std::mutex> guard(layers_lock);
  auto found = layers().find(address);
  if (found != layers().end() && found->second.get() == packed.get()) {
    layers().erase(found);
  }
}

at::Tensor w7a8_matmul(const at::Tensor& codes, const at::Tensor& scales) {
  Packed packed;
  {
    std::lock_guard<std::mutex> guard(layers_lock);
    auto found = layers().find(address_of(scales));
    TORCH_CHECK(found != layers().end(), "minilade::w7a8_matmul: no w7a8 layer has these weight scales (a layer "
                "is found once its codes are packed: integer_linear.pack_layers)");
    packed = found->second;
  }
  return packed->apply_with_input_q_dq_qweight_dq_output_fp32(codes, kCodesScale, kZeroPoint);
}

}  // namespace

TORCH_LIBRARY(minilade_native, m) {
  m.def("w7a8_register(Tensor scales, __torch__.torch.classes.quantized.LinearPackedParamsBase packed) -> ()",
        w7a8_register);
  m.def("w7a8_forget(int address, __torch__.torch.classes.quantized.LinearPackedParamsBase packed) -> ()",
        w7a8_forget);
}

TORCH_LIBRARY_IMPL(minilade, CPU, m) {
  m.impl("w7a8_matmul", w7a8_matmul);
}
