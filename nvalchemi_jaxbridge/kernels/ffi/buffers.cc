// XLA's FFI buffers as torch tensors (no copy) and torch's results written back into them, with the
// errors a call reports when the two disagree. Included by torch_call.cc (one translation unit: build.py
// compiles that file alone).

#pragma once

#include <ATen/core/ivalue.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "plan.cc"
#include "xla/ffi/api/ffi.h"

namespace jb {

namespace ffi = xla::ffi;

bool scalar_type_of(ffi::DataType t, c10::ScalarType* out) {
  switch (t) {
    case ffi::DataType::PRED: *out = c10::ScalarType::Bool; return true;
    case ffi::DataType::S8: *out = c10::ScalarType::Char; return true;
    case ffi::DataType::S16: *out = c10::ScalarType::Short; return true;
    case ffi::DataType::S32: *out = c10::ScalarType::Int; return true;
    case ffi::DataType::S64: *out = c10::ScalarType::Long; return true;
    case ffi::DataType::U8: *out = c10::ScalarType::Byte; return true;
    case ffi::DataType::U16: *out = c10::ScalarType::UInt16; return true;
    case ffi::DataType::U32: *out = c10::ScalarType::UInt32; return true;
    case ffi::DataType::U64: *out = c10::ScalarType::UInt64; return true;
    case ffi::DataType::F16: *out = c10::ScalarType::Half; return true;
    case ffi::DataType::BF16: *out = c10::ScalarType::BFloat16; return true;
    case ffi::DataType::F32: *out = c10::ScalarType::Float; return true;
    case ffi::DataType::F64: *out = c10::ScalarType::Double; return true;
    case ffi::DataType::C64: *out = c10::ScalarType::ComplexFloat; return true;
    case ffi::DataType::C128: *out = c10::ScalarType::ComplexDouble; return true;
    default: return false;
  }
}

at::Tensor as_tensor(const ffi::AnyBuffer& b, c10::Device device, const Plan& plan, const char* what,
                     size_t k) {
  c10::ScalarType st;
  if (!scalar_type_of(b.element_type(), &st)) {
    throw std::invalid_argument(text("op ", plan.name, ": FFI ", what, " ", k, " has XLA element type ",
                                     static_cast<int>(b.element_type()), ", which torch has no equivalent for"));
  }
  auto dims = b.dimensions();
  std::vector<int64_t> sizes(dims.begin(), dims.end());
  auto options = at::TensorOptions().dtype(st).device(device);
  if (b.element_count() == 0) {
    return at::empty(sizes, options);  // XLA may hand a null pointer for an empty buffer
  }
  // target_device: the device is known, so torch need not ask the driver about the pointer
  return at::for_blob(b.untyped_data(), sizes).options(options).target_device(device).make_tensor();
}

std::string describe(const at::Tensor& t) {
  std::string s = "[";
  for (size_t i = 0; i < t.sizes().size(); ++i) s += text(i == 0 ? "" : ", ", t.sizes()[i]);
  return text(s, "] ", c10::toString(t.scalar_type()));
}

ffi::Error arity_error(const Plan& plan, const char* what, size_t n_args, size_t n_rets) {
  return ffi::Error::Internal(text("op ", plan.name, " (", what, "): got ", n_args, " argument and ", n_rets,
                                    " result buffer(s), the plan expects ", plan.n_args, " and ", plan.n_results,
                                    "; this is a bug in nvalchemi_jaxbridge (the plan and the ffi_call "
                                    "disagree), please report it"));
}

ffi::Error not_a_tensor(const Plan& plan, size_t j, const c10::IValue& v) {
  return ffi::Error::Internal(text("op ", plan.name, ": return ", j, " is a ", v.tagKind(),
                                    ", not a Tensor; fix the op's implementation to return Tensors as its "
                                    "schema declares"));
}

// The op's result `j` written into XLA's result buffer `want` (unless the op wrote it there itself).
ffi::Error write_result(const Plan& plan, size_t j, const at::Tensor& got, at::Tensor& want) {
  if (got.sizes() != want.sizes() || got.scalar_type() != want.scalar_type()) {
    return ffi::Error::InvalidArgument(
        text("op ", plan.name, ": return ", j, " is ", describe(got), " but JAX expected ", describe(want),
             " (from the op's fake implementation); its register_fake disagrees with its real implementation. "
             "Make the function registered with register_fake return the shapes and dtypes the op really "
             "returns"));
  }
  if (want.numel() != 0 && got.data_ptr() != want.data_ptr()) {
    want.copy_(got);  // the op allocated its result: one copy on the current stream
  }
  return ffi::Error::Success();
}

}  // namespace jb
