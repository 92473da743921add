// XLA FFI handler that calls a torch op through torch's C++ dispatcher.
//
// One handler serves every op: the op, its static arguments and the places its
// tensors go are a *plan*, registered once from Python (jb_register_plan) and
// named by the call's `plan` attribute. Per call the handler copies the plan's
// argument stack, wraps XLA's buffers as torch tensors (at::from_blob, no copy),
// runs the op boxed with grad off (below autograd), and writes each returned tensor into its
// result buffer. A backward plan instead re-runs the op under autograd on the saved inputs
// and writes torch::autograd::grad's input gradients into the results. No Python runs on
// this side; a Python-implemented op (or backward formula) takes the GIL itself inside torch.
//
// Compiled by nvalchemi_jaxbridge/kernels/ffi/build.py; JB_WITH_CUDA adds the
// CUDA handler (torch enqueues on XLA's stream).

#include <Python.h>  // first, as Python asks; only to clear an error torch's autograd engine leaves set

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <ATen/core/ivalue.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

#include "xla/ffi/api/ffi.h"

#ifdef JB_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

namespace ffi = xla::ffi;

namespace {

// Where a tensor argument of the op comes from: FFI argument `index` or FFI result `index`
// (a mutated argument: XLA aliases it to its input, so the op writes into JAX's result).
// In a backward plan a mutated argument is FFI argument `index`, cloned before the op
// writes into it (`cloned`), and `leaf` is its place among the differentiated inputs (or -1).
struct Slot {
  size_t stack_pos;
  bool from_result;
  size_t index;
  bool cloned = false;
  int64_t leaf = -1;
};

struct Plan {
  std::string name;  // "ns::op" or "ns::op.overload", for messages
  c10::OperatorHandle op;
  std::vector<c10::IValue> stack;  // one entry per schema argument; tensor slots hold None
  std::vector<Slot> slots;
  size_t n_args = 0;     // FFI arguments the call must bring
  size_t n_results = 0;  // FFI results: returns, then mutated arguments
  size_t n_returns = 0;  // tensors the op returns
  // backward plans only: the FFI results are the gradients of the `n_leaves` differentiated
  // inputs; `outputs[j]` is the op result (returns, then mutated arguments in slot order)
  // whose cotangent is FFI argument n_args - outputs.size() + j.
  bool backward = false;
  size_t n_leaves = 0;
  std::vector<size_t> outputs;

  Plan(std::string n, c10::OperatorHandle h) : name(std::move(n)), op(std::move(h)) {}
};

std::shared_mutex g_plans_mu;
std::unordered_map<int64_t, std::unique_ptr<Plan>> g_plans;
std::unordered_map<int64_t, std::string> g_plan_keys;  // id -> what it was registered for
thread_local std::string g_last_error;

const Plan* find_plan(int64_t id) {
  std::shared_lock<std::shared_mutex> lock(g_plans_mu);
  auto it = g_plans.find(id);
  return it == g_plans.end() ? nullptr : it->second.get();
}

// ---------------------------------------------------------------- static-argument decoding
//
// A version line "jb1 <number of FFI arguments>", then one line per schema argument
// (see plans.py, which writes them):
//   N            None                     b0 / b1      bool
//   i<int>       int64 (decimal)          d<float>     double, C99 hex float (exact), inf, -inf, nan
//   s<hex>       str, UTF-8 bytes in hex  I<i,i,...>   int list (may be empty)
//   D<d,d,...>   double list              B<0,1,...>   bool list
//   a<k>         FFI argument k           r<k>         FFI result k (mutated argument)
//   m<k>         FFI argument k, cloned (a mutated argument in a backward plan)
// A backward plan adds two lines after the schema's:
//   G<k,k,...>   the FFI arguments differentiated, in the order of their gradient results
//   O<r,r,...>   the op results that get a cotangent; the cotangents are the last FFI arguments

[[noreturn]] void bad(const std::string& what, size_t line) {
  std::ostringstream os;
  os << "plan entry " << line << ": " << what;
  throw std::invalid_argument(os.str());
}

int64_t parse_int(const std::string& s, size_t line) {
  if (s.empty()) bad("empty integer", line);
  errno = 0;
  char* end = nullptr;
  long long v = std::strtoll(s.c_str(), &end, 10);
  if (errno != 0 || end != s.c_str() + s.size()) bad("bad integer '" + s + "'", line);
  return static_cast<int64_t>(v);
}

double parse_double(const std::string& s, size_t line) {
  if (s.empty()) bad("empty float", line);
  char* end = nullptr;
  double v = std::strtod(s.c_str(), &end);  // reads C99 hex floats exactly
  if (end != s.c_str() + s.size()) bad("bad float '" + s + "'", line);
  return v;
}

bool parse_bool(const std::string& s, size_t line) {
  if (s == "0") return false;
  if (s == "1") return true;
  bad("bad bool '" + s + "'", line);
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  if (s.empty()) return out;
  size_t start = 0;
  while (true) {
    size_t end = s.find(sep, start);
    out.push_back(s.substr(start, end - start));
    if (end == std::string::npos) break;
    start = end + 1;
  }
  return out;
}

std::string unhex(const std::string& s, size_t line) {
  if (s.size() % 2) bad("odd-length hex string", line);
  std::string out;
  out.reserve(s.size() / 2);
  for (size_t i = 0; i < s.size(); i += 2) {
    char* end = nullptr;
    std::string byte = s.substr(i, 2);
    long v = std::strtol(byte.c_str(), &end, 16);
    if (end != byte.c_str() + 2) bad("bad hex byte '" + byte + "'", line);
    out.push_back(static_cast<char>(v));
  }
  return out;
}

void decode_plan(Plan& plan, const std::string& encoded) {
  const auto& schema = plan.op.schema();
  std::vector<std::string> lines = split(encoded, '\n');
  if (lines.empty() || lines[0].rfind("jb1 ", 0) != 0) {
    throw std::invalid_argument("the plan does not start with its version line 'jb1 <n_args>'");
  }
  plan.n_args = static_cast<size_t>(parse_int(lines[0].substr(4), 0));
  lines.erase(lines.begin());
  std::vector<int64_t> leaves;
  if (lines.size() >= 2 && !lines[lines.size() - 2].empty() && lines[lines.size() - 2][0] == 'G' &&
      !lines.back().empty() && lines.back()[0] == 'O') {
    plan.backward = true;
    const size_t at = lines.size() - 2;
    for (const auto& x : split(lines[at].substr(1), ',')) leaves.push_back(parse_int(x, at));
    for (const auto& x : split(lines[at + 1].substr(1), ',')) {
      int64_t r = parse_int(x, at + 1);
      if (r < 0) bad("negative result index", at + 1);
      plan.outputs.push_back(static_cast<size_t>(r));
    }
    if (plan.outputs.size() > plan.n_args) bad("more cotangents than FFI arguments", at + 1);
    lines.resize(at);
    plan.n_leaves = leaves.size();
  }
  if (lines.size() != schema.arguments().size()) {
    std::ostringstream os;
    os << "the plan has " << lines.size() << " argument(s) but the schema " << schema << " has "
       << schema.arguments().size();
    throw std::invalid_argument(os.str());
  }
  plan.n_returns = schema.returns().size();
  size_t n_mutated = 0;
  for (size_t i = 0; i < lines.size(); ++i) {
    const std::string& l = lines[i];
    if (l.empty()) bad("empty entry", i);
    const char tag = l[0];
    const std::string v = l.substr(1);
    switch (tag) {
      case 'N':
        plan.stack.emplace_back();
        break;
      case 'b':
        plan.stack.emplace_back(parse_bool(v, i));
        break;
      case 'i':
        plan.stack.emplace_back(parse_int(v, i));
        break;
      case 'd':
        plan.stack.emplace_back(parse_double(v, i));
        break;
      case 's':
        plan.stack.emplace_back(unhex(v, i));
        break;
      case 'I': {
        c10::List<int64_t> xs;
        for (const auto& x : split(v, ',')) xs.push_back(parse_int(x, i));
        plan.stack.emplace_back(std::move(xs));
        break;
      }
      case 'D': {
        c10::List<double> xs;
        for (const auto& x : split(v, ',')) xs.push_back(parse_double(x, i));
        plan.stack.emplace_back(std::move(xs));
        break;
      }
      case 'B': {
        c10::List<bool> xs;
        for (const auto& x : split(v, ',')) xs.push_back(parse_bool(x, i));
        plan.stack.emplace_back(std::move(xs));
        break;
      }
      case 'a':
      case 'm':
      case 'r': {
        int64_t k = parse_int(v, i);
        if (k < 0) bad("negative buffer index", i);
        if (tag == 'r' && plan.backward) bad("a backward plan takes mutated arguments as 'm', not 'r'", i);
        if (tag == 'm' && !plan.backward) bad("'m' slots belong to backward plans", i);
        plan.slots.push_back({i, tag == 'r', static_cast<size_t>(k), tag == 'm'});
        if (tag != 'r' && static_cast<size_t>(k) >= plan.n_args) bad("argument slot past n_args", i);
        if (tag != 'a') ++n_mutated;
        plan.stack.emplace_back();
        break;
      }
      default:
        bad(std::string("unknown tag '") + tag + "'", i);
    }
  }
  if (plan.backward) {
    for (size_t l = 0; l < leaves.size(); ++l) {
      bool found = false;
      for (auto& s : plan.slots) {
        if (static_cast<int64_t>(s.index) == leaves[l]) {
          if (s.leaf >= 0) bad("argument " + std::to_string(leaves[l]) + " differentiated twice", lines.size());
          s.leaf = static_cast<int64_t>(l);
          found = true;
        }
      }
      if (!found) bad("differentiated argument " + std::to_string(leaves[l]) + " is no tensor slot", lines.size());
    }
    for (size_t r : plan.outputs) {
      if (r >= plan.n_returns + n_mutated) bad("cotangent for result " + std::to_string(r) + " past the op's results", lines.size() + 1);
    }
    plan.n_results = plan.n_leaves;
    return;
  }
  plan.n_results = plan.n_returns + n_mutated;
  for (const auto& s : plan.slots) {
    if (s.from_result && (s.index < plan.n_returns || s.index >= plan.n_results)) {
      bad("mutated-argument slot points at result " + std::to_string(s.index), s.stack_pos);
    }
  }
}

// ---------------------------------------------------------------- buffers as tensors

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
    std::ostringstream os;
    os << "op " << plan.name << ": FFI " << what << " " << k << " has XLA element type "
       << static_cast<int>(b.element_type()) << ", which torch has no equivalent for";
    throw std::invalid_argument(os.str());
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
  std::ostringstream os;
  os << t.sizes() << " " << c10::toString(t.scalar_type());
  return os.str();
}

ffi::Error run_plan(const Plan& plan, ffi::RemainingArgs args, ffi::RemainingRets rets, c10::Device device) {
  if (args.size() != plan.n_args || rets.size() != plan.n_results) {
    std::ostringstream os;
    os << "op " << plan.name << " (FFI call): got " << args.size() << " argument and " << rets.size()
       << " result buffer(s), the plan expects " << plan.n_args << " and " << plan.n_results
       << "; this is a bug in nvalchemi_jaxbridge (the plan and the ffi_call disagree), please report it";
    return ffi::Error::Internal(os.str());
  }
  std::vector<at::Tensor> outs;
  outs.reserve(plan.n_results);
  for (size_t j = 0; j < plan.n_results; ++j) {
    auto r = rets.get<ffi::AnyBuffer>(j);
    if (r.has_error()) return r.error();
    outs.push_back(as_tensor(**r, device, plan, "result", j));
  }
  std::vector<c10::IValue> stack = plan.stack;
  for (const Slot& s : plan.slots) {
    if (s.from_result) {
      stack[s.stack_pos] = outs[s.index];
    } else {
      auto a = args.get<ffi::AnyBuffer>(s.index);
      if (a.has_error()) return a.error();
      stack[s.stack_pos] = as_tensor(*a, device, plan, "argument", s.index);
    }
  }
  {
    // Grad off, and dispatch below the autograd keys: what an autograd kernel itself does
    // when grad is off (custom_op's Python autograd wrapper included), without the hop
    // through it. An op whose only kernel sits at an Autograd key is not reached this way.
    at::NoGradGuard no_grad;
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    plan.op.callBoxed(stack);
  }
  if (stack.size() != plan.n_returns) {
    std::ostringstream os;
    os << "op " << plan.name << " returned " << stack.size() << " value(s), its schema declares "
       << plan.n_returns << "; fix the op's implementation to match its schema";
    return ffi::Error::Internal(os.str());
  }
  for (size_t j = 0; j < plan.n_returns; ++j) {
    if (!stack[j].isTensor()) {
      std::ostringstream os;
      os << "op " << plan.name << ": return " << j << " is a " << stack[j].tagKind()
         << ", not a Tensor; fix the op's implementation to return Tensors as its schema declares";
      return ffi::Error::Internal(os.str());
    }
    const at::Tensor& got = stack[j].toTensor();
    at::Tensor& want = outs[j];
    if (got.sizes() != want.sizes() || got.scalar_type() != want.scalar_type()) {
      std::ostringstream os;
      os << "op " << plan.name << ": return " << j << " is " << describe(got) << " but JAX expected "
         << describe(want) << " (from the op's fake implementation); its register_fake disagrees with "
         << "its real implementation. Make the function registered with register_fake return the "
         << "shapes and dtypes the op really returns";
      return ffi::Error::InvalidArgument(os.str());
    }
    if (want.numel() != 0 && got.data_ptr() != want.data_ptr()) {
      want.copy_(got);  // a functional op allocated its result: one copy on the current stream
    }
  }
  return ffi::Error::Success();
}

// The backward: the op re-run under autograd on the saved inputs, and the gradients of the
// differentiated inputs for the incoming cotangents, as the callback path's backward computes them.
ffi::Error run_backward(const Plan& plan, ffi::RemainingArgs args, ffi::RemainingRets rets, c10::Device device) {
  if (args.size() != plan.n_args || rets.size() != plan.n_results) {
    std::ostringstream os;
    os << "op " << plan.name << " (FFI backward call): got " << args.size() << " argument and " << rets.size()
       << " result buffer(s), the plan expects " << plan.n_args << " and " << plan.n_results
       << "; this is a bug in nvalchemi_jaxbridge (the plan and the ffi_call disagree), please report it";
    return ffi::Error::Internal(os.str());
  }
  // Grad on and dispatch from the top, so the op's autograd kernel (a register_autograd
  // formula, a composite's decomposition) records the graph.
  at::AutoGradMode grad_on(true);
  std::vector<c10::IValue> stack = plan.stack;
  std::vector<at::Tensor> leaves(plan.n_leaves);
  std::vector<at::Tensor> mutated;
  for (const Slot& s : plan.slots) {
    auto a = args.get<ffi::AnyBuffer>(s.index);
    if (a.has_error()) return a.error();
    at::Tensor t = as_tensor(*a, device, plan, "argument", s.index);
    if (s.cloned) t = t.clone();  // the op writes into it; never into XLA's buffer
    if (s.leaf >= 0) {
      t.requires_grad_(true);
      leaves[s.leaf] = t;
      if (s.cloned) t = t.clone();  // in-place writes into a leaf are not allowed
    }
    if (s.cloned) mutated.push_back(t);
    stack[s.stack_pos] = t;
  }
  plan.op.callBoxed(stack);
  if (stack.size() != plan.n_returns) {
    std::ostringstream os;
    os << "op " << plan.name << " returned " << stack.size() << " value(s) in its backward's re-run, its "
       << "schema declares " << plan.n_returns << "; fix the op's implementation to match its schema";
    return ffi::Error::Internal(os.str());
  }
  const size_t first_ct = plan.n_args - plan.outputs.size();
  std::vector<at::Tensor> outs, cts;
  for (size_t j = 0; j < plan.outputs.size(); ++j) {
    const size_t r = plan.outputs[j];
    at::Tensor res;
    if (r < plan.n_returns) {
      if (!stack[r].isTensor()) {
        std::ostringstream os;
        os << "op " << plan.name << ": return " << r << " is a " << stack[r].tagKind()
           << ", not a Tensor; fix the op's implementation to return Tensors as its schema declares";
        return ffi::Error::Internal(os.str());
      }
      res = stack[r].toTensor();
    } else {
      res = mutated.at(r - plan.n_returns);
    }
    if (!res.requires_grad()) continue;  // no graph to this result: its cotangent adds nothing
    auto c = args.get<ffi::AnyBuffer>(first_ct + j);
    if (c.has_error()) return c.error();
    outs.push_back(res);
    cts.push_back(as_tensor(*c, device, plan, "argument", first_ct + j));
  }
  std::vector<at::Tensor> grads(plan.n_leaves);
  if (!outs.empty() && plan.n_leaves > 0) {
    grads = torch::autograd::grad(outs, leaves, cts, /*retain_graph=*/false, /*create_graph=*/false,
                                  /*allow_unused=*/true);
  }
  for (size_t l = 0; l < plan.n_leaves; ++l) {
    auto b = rets.get<ffi::AnyBuffer>(l);
    if (b.has_error()) return b.error();
    at::Tensor want = as_tensor(**b, device, plan, "result", l);
    if (want.numel() == 0) continue;
    const at::Tensor& got = grads[l];
    if (!got.defined()) {
      want.zero_();  // the input does not reach the differentiated results
      continue;
    }
    if (got.sizes() != want.sizes() || got.scalar_type() != want.scalar_type()) {
      std::ostringstream os;
      os << "op " << plan.name << ": the gradient of differentiated input " << l << " is " << describe(got)
         << " but JAX expected " << describe(want) << " (the input's shape and dtype); fix the op's "
         << "backward formula (register_autograd) to return gradients shaped and typed like the inputs";
      return ffi::Error::InvalidArgument(os.str());
    }
    want.copy_(got);
  }
  return ffi::Error::Success();
}

ffi::Error run(const Plan& plan, ffi::RemainingArgs args, ffi::RemainingRets rets, c10::Device device) {
  return plan.backward ? run_backward(plan, args, rets, device) : run_plan(plan, args, rets, device);
}

// torch's Python autograd engine, when a Python backward formula raises, also sets the error
// as the thread's pending Python exception before rethrowing it as C++. The handler turns the
// exception into an FFI error, so the pending one is cleared (JAX would otherwise raise with an
// exception already set: a SystemError).
void clear_pending_python_error() {
  if (!Py_IsInitialized()) return;
  PyGILState_STATE st = PyGILState_Ensure();
  if (PyErr_Occurred() != nullptr) PyErr_Clear();
  PyGILState_Release(st);
}

ffi::Error guarded_call(int64_t plan_id, ffi::RemainingArgs args, ffi::RemainingRets rets, c10::Device device,
                        void* stream) {
  const Plan* plan = find_plan(plan_id);
  if (plan == nullptr) {
    return ffi::Error::Internal(
        "nvalchemi_jaxbridge FFI call: plan " + std::to_string(plan_id) +
        " is not registered in this process (a compiled program reused from another process?); call "
        "the TorchOpKernel again in this process so it registers its plan, or use call_path=\"callback\"");
  }
  std::string msg;
  try {
#ifdef JB_WITH_CUDA
    if (device.is_cuda()) {  // torch enqueues on XLA's stream (and device) for the whole call
      c10::cuda::CUDAStreamGuard guard(
          c10::cuda::getStreamFromExternal(static_cast<cudaStream_t>(stream), device.index()));
      return run(*plan, args, rets, device);
    }
#else
    (void)stream;
#endif
    return run(*plan, args, rets, device);
  } catch (const c10::Error& e) {
    msg = e.what_without_backtrace();
  } catch (const std::exception& e) {
    msg = e.what();  // includes torch's python_error / pybind11's error_already_set
  } catch (...) {
    msg = "unknown C++ exception";
  }
  if (plan->backward) clear_pending_python_error();
  return ffi::Error(ffi::ErrorCode::kInternal,
                    "torch op " + plan->name + " failed inside its FFI " +
                        (plan->backward ? "backward call (torch autograd re-running the op and its backward "
                                          "formula on the saved inputs): "
                                        : "call: ") +
                        msg);
}

// guarded_call, and a failure also written to stderr at once: when the program has collectives, the
// other devices wait for this one in a rendezvous, and XLA may end the process at its timeout before
// the returned error reaches Python, which would lose the op's message.
ffi::Error guarded(int64_t plan_id, ffi::RemainingArgs args, ffi::RemainingRets rets, c10::Device device,
                   void* stream) {
  ffi::Error err = guarded_call(plan_id, args, rets, device, stream);
  if (err.failure()) {
    std::fprintf(stderr,
                 "nvalchemi_jaxbridge: on device %s: %s\n(also raised as a JAX error; if other devices wait "
                 "for this one in a collective, XLA may stop the process before that error reaches Python)\n",
                 device.str().c_str(), err.message().c_str());
    std::fflush(stderr);
  }
  return err;
}

ffi::Error call_cpu(ffi::RemainingArgs args, ffi::RemainingRets rets, int64_t plan) {
  return guarded(plan, args, rets, c10::Device(c10::kCPU), nullptr);
}

#ifdef JB_WITH_CUDA
ffi::Error call_cuda(cudaStream_t stream, int32_t ordinal, ffi::RemainingArgs args, ffi::RemainingRets rets,
                     int64_t plan) {
  return guarded(plan, args, rets, c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(ordinal)), stream);
}
#endif

uint64_t fnv1a(const std::string& s, uint64_t h = 1469598103934665603ULL) {
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ULL;
  }
  return h;
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jb_torch_call_cpu, call_cpu,
                              ffi::Ffi::Bind().RemainingArgs().RemainingRets().Attr<int64_t>("plan"));

#ifdef JB_WITH_CUDA
XLA_FFI_DEFINE_HANDLER_SYMBOL(jb_torch_call_cuda, call_cuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("plan"));
#endif

extern "C" {

// 1 when this library has the CUDA handler.
int jb_has_cuda() {
#ifdef JB_WITH_CUDA
  return 1;
#else
  return 0;
#endif
}

// The message of the last failed jb_register_plan on this thread.
const char* jb_last_error() { return g_last_error.c_str(); }

// Resolve `op` (`ns::name`) / `overload` ("" for the default) once and decode its static
// arguments. Returns the plan id (a hash of what was registered, so a program that names it
// means the same call in every process), or -1 with the reason in jb_last_error().
int64_t jb_register_plan(const char* op, const char* overload, const char* encoded) {
  try {
    const std::string key = std::string(op) + '\0' + overload + '\0' + encoded;
    const int64_t id = static_cast<int64_t>(fnv1a(key) >> 2);  // non-negative, -1 stays free
    {
      std::shared_lock<std::shared_mutex> lock(g_plans_mu);
      auto it = g_plan_keys.find(id);
      if (it != g_plan_keys.end()) {
        if (it->second == key) return id;
        g_last_error = "plan id collision between two different plans; use call_path=\"callback\" for op " +
                       std::string(op);
        return -1;
      }
    }
    auto handle = c10::Dispatcher::singleton().findSchemaOrThrow(op, overload);
    std::string name = std::string(op) + (overload[0] ? std::string(".") + overload : std::string());
    auto plan = std::make_unique<Plan>(name, handle);
    decode_plan(*plan, encoded);
    std::unique_lock<std::shared_mutex> lock(g_plans_mu);
    if (g_plan_keys.count(id) == 0) {
      g_plans.emplace(id, std::move(plan));
      g_plan_keys.emplace(id, key);
    }
    return id;
  } catch (const c10::Error& e) {
    g_last_error = e.what_without_backtrace();
  } catch (const std::exception& e) {
    g_last_error = e.what();
  } catch (...) {
    g_last_error = "unknown C++ exception";
  }
  return -1;
}

}  // extern "C"
