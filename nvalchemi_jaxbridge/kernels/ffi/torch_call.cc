// XLA FFI handler that calls a torch op through torch's C++ dispatcher.
//
// One handler serves every op: the op, its static arguments and the places its
// tensors go are a *plan*, registered once from Python (jb_register_plan) and
// named by the call's `plan` attribute. Per call the handler copies the plan's
// argument stack, wraps XLA's buffers as torch tensors (at::from_blob, no copy),
// runs the op boxed with grad off (below autograd), and writes each returned tensor into its
// result buffer. A differentiated call has two plans instead (plan.h): its forward runs the op
// once under autograd, writes the results and keeps the graph in the plan's table (graphs.h)
// under a token, its last result; its backward takes that graph by token (or re-runs the op
// under autograd on the saved inputs where it is gone) and writes torch::autograd::grad's input
// gradients into the results. No Python runs on this side; a Python-implemented op (or backward
// formula) takes the GIL itself inside torch.
//
// Compiled by nvalchemi_jaxbridge/kernels/ffi/build.py, one translation unit with the files it
// includes (plan.cc, graphs.cc); JB_WITH_CUDA adds the CUDA handler (torch enqueues on XLA's stream).

#include <Python.h>  // first, as Python asks; only to clear an error torch's autograd engine leaves set

// torch's headers then include the few op headers each one uses instead of ATen/Functions.h (all of them),
// as in torch's own build: about 30 % less to parse, and parsing is most of the build. The machine code is
// the same (the object files compared equal at -O2, torch 2.14).
#define AT_PER_OPERATOR_HEADERS

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <ATen/core/ivalue.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/where.h>
#include <c10/core/AutogradState.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

#include "xla/ffi/api/ffi.h"

#include "plan.cc"  // with graphs.cc: one translation unit

#ifdef JB_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

namespace ffi = xla::ffi;

namespace {

using jb::Graph;
using jb::Mode;
using jb::Plan;
using jb::Slot;

// Plans live as long as the process and are never destroyed, not even at exit: a kept graph may
// hold Python autograd nodes, which must not be freed after the interpreter has finalised.
std::shared_mutex g_plans_mu;
auto* const g_plans = new std::unordered_map<int64_t, std::unique_ptr<Plan>>();
auto* const g_plan_keys = new std::unordered_map<int64_t, std::string>();  // id -> what it was registered for
thread_local std::string g_last_error;

const Plan* find_plan(int64_t id) {
  std::shared_lock<std::shared_mutex> lock(g_plans_mu);
  auto it = g_plans->find(id);
  return it == g_plans->end() ? nullptr : it->second.get();
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

ffi::Error arity_error(const Plan& plan, const char* what, size_t n_args, size_t n_rets) {
  std::ostringstream os;
  os << "op " << plan.name << " (" << what << "): got " << n_args << " argument and " << n_rets
     << " result buffer(s), the plan expects " << plan.n_args << " and " << plan.n_results
     << "; this is a bug in nvalchemi_jaxbridge (the plan and the ffi_call disagree), please report it";
  return ffi::Error::Internal(os.str());
}

ffi::Error not_a_tensor(const Plan& plan, size_t j, const c10::IValue& v) {
  std::ostringstream os;
  os << "op " << plan.name << ": return " << j << " is a " << v.tagKind()
     << ", not a Tensor; fix the op's implementation to return Tensors as its schema declares";
  return ffi::Error::Internal(os.str());
}

// The op's result `j` written into XLA's result buffer `want` (unless the op wrote it there itself).
ffi::Error write_result(const Plan& plan, size_t j, const at::Tensor& got, at::Tensor& want) {
  if (got.sizes() != want.sizes() || got.scalar_type() != want.scalar_type()) {
    std::ostringstream os;
    os << "op " << plan.name << ": return " << j << " is " << describe(got) << " but JAX expected "
       << describe(want) << " (from the op's fake implementation); its register_fake disagrees with "
       << "its real implementation. Make the function registered with register_fake return the "
       << "shapes and dtypes the op really returns";
    return ffi::Error::InvalidArgument(os.str());
  }
  if (want.numel() != 0 && got.data_ptr() != want.data_ptr()) {
    want.copy_(got);  // the op allocated its result: one copy on the current stream
  }
  return ffi::Error::Success();
}

ffi::Error run_plan(const Plan& plan, ffi::RemainingArgs args, ffi::RemainingRets rets, c10::Device device) {
  if (args.size() != plan.n_args || rets.size() != plan.n_results) {
    return arity_error(plan, "FFI call", args.size(), rets.size());
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
    if (!stack[j].isTensor()) return not_a_tensor(plan, j, stack[j]);
    ffi::Error err = write_result(plan, j, stack[j].toTensor(), outs[j]);
    if (err.failure()) return err;
  }
  return ffi::Error::Success();
}

// The op under autograd from the top of the dispatcher (its autograd kernel, a register_autograd
// formula or a composite's decomposition, records the graph) on the FFI arguments of a
// differentiated call's plan. The inputs are cloned where `keep` (the graph outlives XLA's
// buffers) and else only where the op mutates them (never into XLA's buffer); the differentiated
// ones are leaves. Fills `graph` and `results` (returns, then mutated arguments).
ffi::Error run_autograd(const Plan& plan, ffi::RemainingArgs args, c10::Device device, bool keep, Graph& graph,
                        std::vector<at::Tensor>& results) {
  at::AutoGradMode grad_on(true);
  std::vector<c10::IValue> stack = plan.stack;
  graph.leaves.assign(plan.n_leaves, at::Tensor());
  std::vector<at::Tensor> mutated;
  for (const Slot& s : plan.slots) {
    auto a = args.get<ffi::AnyBuffer>(s.index);
    if (a.has_error()) return a.error();
    at::Tensor t = as_tensor(*a, device, plan, "argument", s.index);
    if (keep || s.cloned) t = t.clone();
    if (s.leaf >= 0) {
      t.requires_grad_(true);
      graph.leaves[s.leaf] = t;
      if (s.cloned) t = t.clone();  // in-place writes into a leaf are not allowed
    }
    if (s.cloned) mutated.push_back(t);
    stack[s.stack_pos] = t;
  }
  plan.op.callBoxed(stack);
  if (stack.size() != plan.n_returns) {
    std::ostringstream os;
    os << "op " << plan.name << " returned " << stack.size() << " value(s) under autograd, its schema declares "
       << plan.n_returns << "; fix the op's implementation to match its schema";
    return ffi::Error::Internal(os.str());
  }
  results.clear();
  for (size_t j = 0; j < plan.n_returns; ++j) {
    if (!stack[j].isTensor()) return not_a_tensor(plan, j, stack[j]);
    results.push_back(stack[j].toTensor());
  }
  results.insert(results.end(), mutated.begin(), mutated.end());
  graph.outputs.clear();
  for (size_t r : plan.outputs) {
    const at::Tensor& res = results.at(r);
    graph.outputs.push_back(res.requires_grad() ? res : at::Tensor());  // no graph: its cotangent adds nothing
  }
  return ffi::Error::Success();
}

// Where a token buffer sits in this run: the graph table files graphs under it (graphs.cc).
jb::TokenSite site_of(int64_t run, c10::Device device, const ffi::AnyBuffer& token) {
  return jb::TokenSite{run, static_cast<int32_t>(device.index()), reinterpret_cast<uintptr_t>(token.untyped_data())};
}

// The token (salt, serial) as the one int64 its int32 (2,) buffer holds (the salt first: little-endian), so
// that writing it and checking it are one kernel each.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the graph token's int64 view assumes little-endian");
int64_t token_word(int32_t salt, int32_t serial) {
  return static_cast<int64_t>((static_cast<uint64_t>(static_cast<uint32_t>(serial)) << 32) |
                              static_cast<uint64_t>(static_cast<uint32_t>(salt)));
}

// The token buffer (int32 (2,)) viewed as its one int64 word, 0-d.
at::Tensor token_word_view(const at::Tensor& token) { return token.view(c10::ScalarType::Long).reshape({}); }

// The gradient `got` written into XLA's buffer `want`: NaN instead where `mismatch` (a 0-d device bool;
// undefined: no check) is true, i.e. the graph found by its token's site was not the token's. Never seen:
// it would take XLA copying one forward's token into the buffer of another's, and then the gradient must
// not pass for a right one. One kernel (the NaN is the table's, on the device already); `got` undefined:
// zeros (the input does not reach the differentiated results).
void write_gradient(jb::GraphTable& table, const at::Tensor& mismatch, const at::Tensor& got, at::Tensor& want) {
  const at::Tensor value = got.defined() ? got : want.zero_();
  if (!mismatch.defined()) {
    if (got.defined()) want.copy_(got);
    return;
  }
  at::where_out(want, mismatch, table.nan_on(want.device(), want.scalar_type()), value);
}

// A differentiated call's forward: the op once under autograd, its results (returns, then mutated
// arguments) into XLA's buffers, and the graph kept in the plan's table under the token written last.
ffi::Error run_keep(const Plan& plan, ffi::RemainingArgs args, ffi::RemainingRets rets, c10::Device device,
                    int64_t run) {
  if (args.size() != plan.n_args || rets.size() != plan.n_results) {
    return arity_error(plan, "FFI differentiated call", args.size(), rets.size());
  }
  Graph graph;
  std::vector<at::Tensor> results;
  ffi::Error err = run_autograd(plan, args, device, /*keep=*/true, graph, results);
  if (err.failure()) return err;
  at::NoGradGuard no_grad;
  for (size_t j = 0; j < results.size(); ++j) {
    auto b = rets.get<ffi::AnyBuffer>(j);
    if (b.has_error()) return b.error();
    at::Tensor want = as_tensor(**b, device, plan, "result", j);
    err = write_result(plan, j, results[j], want);
    if (err.failure()) return err;
  }
  auto b = rets.get<ffi::AnyBuffer>(plan.n_results - 1);
  if (b.has_error()) return b.error();
  at::Tensor want = as_tensor(**b, device, plan, "result", plan.n_results - 1);
  const auto token = plan.graphs->keep(std::move(graph), site_of(run, device, **b));
  token_word_view(want).fill_(token_word(token.first, token.second));  // a fill, not a copy from the host: no sync
  return ffi::Error::Success();
}

// torch's autograd engine on the calling thread (XLA's, on XLA's stream already) for as long as it lives,
// instead of handing a CUDA graph to its per-device worker thread and waiting: that hop cost 0.4 ms more
// per backward here than in plain torch on an H200 (benchmarks/RESULTS.md, "autograd on XLA's thread").
class SameThreadAutograd {
 public:
  SameThreadAutograd() : before_(c10::AutogradState::get_tls_state().get_multithreading_enabled()) {
    c10::AutogradState::get_tls_state().set_multithreading_enabled(false);
  }
  ~SameThreadAutograd() { c10::AutogradState::get_tls_state().set_multithreading_enabled(before_); }
  SameThreadAutograd(const SameThreadAutograd&) = delete;
  SameThreadAutograd& operator=(const SameThreadAutograd&) = delete;

 private:
  bool before_;
};

// The backward: the graph the forward kept under the token (or, gone, the op re-run under autograd on
// the saved inputs), and the gradients of the differentiated inputs for the incoming cotangents.
ffi::Error run_backward(const Plan& plan, ffi::RemainingArgs args, ffi::RemainingRets rets, c10::Device device,
                        int64_t run) {
  if (args.size() != plan.n_args || rets.size() != plan.n_results) {
    return arity_error(plan, "FFI backward call", args.size(), rets.size());
  }
  const size_t first_ct = plan.n_args - plan.outputs.size();
  auto tb = args.get<ffi::AnyBuffer>(first_ct - 1);
  if (tb.has_error()) return tb.error();
  at::Tensor token = as_tensor(*tb, device, plan, "argument", first_ct - 1);
  if (token.scalar_type() != c10::ScalarType::Int || token.numel() != 2) {
    return ffi::Error::Internal("op " + plan.name + " (FFI backward call): the graph token is " + describe(token) +
                                ", not an int32 (2,); this is a bug in nvalchemi_jaxbridge, please report it");
  }
  jb::GraphTable& table = *plan.source->graphs;
  std::optional<Graph> kept;
  at::Tensor mismatch;  // on a graph found by its token's site: whether the token there is another (0-d, on device)
  if (auto found = table.take_at(site_of(run, device, *tb))) {
    at::NoGradGuard no_grad;
    mismatch = token_word_view(token).ne(token_word(table.salt(), found->first));
    kept = std::move(found->second);
  } else {
    at::Tensor host = token.to(c10::kCPU);  // a GPU: one stream synchronisation
    kept = table.take(host.data_ptr<int32_t>()[0], host.data_ptr<int32_t>()[1]);
  }
  Graph graph;
  if (kept) {
    graph = std::move(*kept);
  } else {
    std::vector<at::Tensor> results;
    ffi::Error err = run_autograd(plan, args, device, /*keep=*/false, graph, results);
    if (err.failure()) return err;
  }
  std::vector<at::Tensor> outs, cts;
  for (size_t j = 0; j < plan.outputs.size(); ++j) {
    if (!graph.outputs[j].defined()) continue;
    auto c = args.get<ffi::AnyBuffer>(first_ct + j);
    if (c.has_error()) return c.error();
    outs.push_back(graph.outputs[j]);
    cts.push_back(as_tensor(*c, device, plan, "argument", first_ct + j));
  }
  std::vector<at::Tensor> grads(plan.n_leaves);
  if (!outs.empty() && plan.n_leaves > 0) {
    SameThreadAutograd here;
    grads = torch::autograd::grad(outs, graph.leaves, cts, /*retain_graph=*/false, /*create_graph=*/false,
                                  /*allow_unused=*/true);
  }
  graph = Graph();  // the graph goes now
  outs.clear();
  for (size_t l = 0; l < plan.n_leaves; ++l) {
    auto b = rets.get<ffi::AnyBuffer>(l);
    if (b.has_error()) return b.error();
    at::Tensor want = as_tensor(**b, device, plan, "result", l);
    if (want.numel() == 0) continue;
    const at::Tensor& got = grads[l];
    if (got.defined() && (got.sizes() != want.sizes() || got.scalar_type() != want.scalar_type())) {
      std::ostringstream os;
      os << "op " << plan.name << ": the gradient of differentiated input " << l << " is " << describe(got)
         << " but JAX expected " << describe(want) << " (the input's shape and dtype); fix the op's "
         << "backward formula (register_autograd) to return gradients shaped and typed like the inputs";
      return ffi::Error::InvalidArgument(os.str());
    }
    write_gradient(table, mismatch, got, want);
  }
  return ffi::Error::Success();
}

ffi::Error run(const Plan& plan, ffi::RemainingArgs args, ffi::RemainingRets rets, c10::Device device,
               int64_t run_id) {
  switch (plan.mode) {
    case Mode::kKeep: return run_keep(plan, args, rets, device, run_id);
    case Mode::kBackward: return run_backward(plan, args, rets, device, run_id);
    default: return run_plan(plan, args, rets, device);
  }
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
                        void* stream, int64_t run_id) {
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
      return run(*plan, args, rets, device, run_id);
    }
#else
    (void)stream;
#endif
    return run(*plan, args, rets, device, run_id);
  } catch (const c10::Error& e) {
    msg = e.what_without_backtrace();
  } catch (const std::exception& e) {
    msg = e.what();  // includes torch's python_error / pybind11's error_already_set
  } catch (...) {
    msg = "unknown C++ exception";
  }
  if (plan->mode != Mode::kCall) clear_pending_python_error();
  return ffi::Error(ffi::ErrorCode::kInternal,
                    "torch op " + plan->name + " failed inside its FFI " +
                        (plan->mode == Mode::kBackward
                             ? "backward call (torch autograd running the op's backward formula on its graph, "
                               "or re-running the op on the saved inputs): "
                             : plan->mode == Mode::kKeep ? "differentiated call (the op under torch autograd): "
                                                         : "call: ") +
                        msg);
}

// guarded_call, and a failure also written to stderr at once: when the program has collectives, the
// other devices wait for this one in a rendezvous, and XLA may end the process at its timeout before
// the returned error reaches Python, which would lose the op's message.
ffi::Error guarded(int64_t plan_id, ffi::RemainingArgs args, ffi::RemainingRets rets, c10::Device device,
                   void* stream, int64_t run_id) {
  ffi::Error err = guarded_call(plan_id, args, rets, device, stream, run_id);
  if (err.failure()) {
    std::fprintf(stderr,
                 "nvalchemi_jaxbridge: on device %s: %s\n(also raised as a JAX error; if other devices wait "
                 "for this one in a collective, XLA may stop the process before that error reaches Python)\n",
                 device.str().c_str(), err.message().c_str());
    std::fflush(stderr);
  }
  return err;
}

ffi::Error call_cpu(ffi::RunId run, ffi::RemainingArgs args, ffi::RemainingRets rets, int64_t plan) {
  return guarded(plan, args, rets, c10::Device(c10::kCPU), nullptr, run.run_id);
}

#ifdef JB_WITH_CUDA
ffi::Error call_cuda(cudaStream_t stream, int32_t ordinal, ffi::RunId run, ffi::RemainingArgs args,
                     ffi::RemainingRets rets, int64_t plan) {
  return guarded(plan, args, rets, c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(ordinal)), stream,
                 run.run_id);
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
                              ffi::Ffi::Bind().Ctx<ffi::RunId>().RemainingArgs().RemainingRets().Attr<int64_t>(
                                  "plan"));

#ifdef JB_WITH_CUDA
XLA_FFI_DEFINE_HANDLER_SYMBOL(jb_torch_call_cuda, call_cuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Ctx<ffi::RunId>()
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

// How many graphs the differentiated-forward plan `id` keeps now (0 for any other plan).
int64_t jb_kept_graphs(int64_t id) {
  const Plan* plan = find_plan(id);
  return plan != nullptr && plan->graphs ? static_cast<int64_t>(plan->graphs->size()) : 0;
}

// How many backwards of the differentiated-forward plan `id` read their token back from the device
// (the others found their graph by where the token was written; 0 for any other plan).
int64_t jb_token_reads(int64_t id) {
  const Plan* plan = find_plan(id);
  return plan != nullptr && plan->graphs ? plan->graphs->token_reads() : 0;
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
      auto it = g_plan_keys->find(id);
      if (it != g_plan_keys->end()) {
        if (it->second == key) return id;
        g_last_error = "plan id collision between two different plans; use call_path=\"callback\" for op " +
                       std::string(op);
        return -1;
      }
    }
    auto handle = c10::Dispatcher::singleton().findSchemaOrThrow(op, overload);
    std::string name = std::string(op) + (overload[0] ? std::string(".") + overload : std::string());
    auto plan = std::make_unique<Plan>(name, handle);
    jb::decode_plan(*plan, encoded);
    if (plan->mode == Mode::kKeep) plan->graphs = std::make_unique<jb::GraphTable>(plan->keep_cap);
    if (plan->mode == Mode::kBackward) {
      plan->source = find_plan(plan->source_id);
      if (plan->source == nullptr || plan->source->mode != Mode::kKeep) {
        g_last_error = "the backward plan names plan " + std::to_string(plan->source_id) +
                       ", which is no registered differentiated forward (register the forward first)";
        return -1;
      }
    }
    std::unique_lock<std::shared_mutex> lock(g_plans_mu);
    if (g_plan_keys->count(id) == 0) {
      g_plans->emplace(id, std::move(plan));
      g_plan_keys->emplace(id, key);
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
