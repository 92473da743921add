// XLA FFI handler that calls a torch op through torch's C++ dispatcher.
//
// One handler serves every op: the op, its static arguments and the places its
// tensors go are a *plan*, registered once from Python (jb_register_plan) and
// named by the call's `plan` attribute. Per call the handler copies the plan's
// argument stack, wraps XLA's buffers as torch tensors (at::from_blob, no copy),
// runs the op boxed with grad off (below autograd), and writes each returned tensor into its
// result buffer. A differentiated call has two plans instead (plan.cc): its forward runs the op
// once under autograd, writes the results and keeps the graph in the plan's table (graphs.cc)
// under a token, its last result; its backward takes that graph by token (or re-runs the op
// under autograd on the saved inputs where it is gone) and writes torch::autograd::grad's input
// gradients into the results (autograd_calls.cc). No Python runs on this side; a Python-implemented
// op (or backward formula) takes the GIL itself inside torch.
//
// Compiled by nvalchemi_jaxbridge/kernels/ffi/build.py, one translation unit with the files it
// includes (autograd_calls.cc, buffers.cc, plan.cc, graphs.cc); JB_WITH_CUDA adds the CUDA handler
// (torch enqueues on XLA's stream). This file: the plan registry, the plain call, the error guard and
// the handler symbols and C entry points.

#include <Python.h>  // first, as Python asks; only to clear an error torch's autograd engine leaves set

// torch's headers then include the few op headers each one uses instead of ATen/Functions.h (all of them),
// as in torch's own build: about 30 % less to parse, and parsing is most of the build. The machine code is
// the same (the object files compared equal at -O2, torch 2.14).
#define AT_PER_OPERATOR_HEADERS

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <ATen/core/ivalue.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <c10/util/Exception.h>

#include <cxxabi.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "xla/ffi/api/ffi.h"

#include "autograd_calls.cc"  // with buffers.cc, plan.cc and graphs.cc: one translation unit

#ifdef JB_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

namespace ffi = xla::ffi;

namespace {

using jb::arity_error;
using jb::as_tensor;
using jb::Mode;
using jb::not_a_tensor;
using jb::Plan;
using jb::run_backward;
using jb::run_keep;
using jb::Slot;
using jb::text;
using jb::write_result;

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
    return ffi::Error::Internal(text("op ", plan.name, " returned ", stack.size(),
                                      " value(s), its schema declares ", plan.n_returns,
                                      "; fix the op's implementation to match its schema"));
  }
  for (size_t j = 0; j < plan.n_returns; ++j) {
    if (!stack[j].isTensor()) return not_a_tensor(plan, j, stack[j]);
    ffi::Error err = write_result(plan, j, stack[j].toTensor(), outs[j]);
    if (err.failure()) return err;
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

// Whether the Python interpreter is shutting down. A thread that asks for the GIL then is ended by
// Python with a forced unwind, which std::terminate()s the process ("terminate called without an
// active exception", SIGABRT) where it meets XLA's noexcept frames; the handler refuses to start the
// op (a Python op body or backward formula takes the GIL inside torch) and takes no GIL itself.
bool python_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

// torch's Python autograd engine, when a Python backward formula raises, also sets the error
// as the thread's pending Python exception before rethrowing it as C++. The handler turns the
// exception into an FFI error, so the pending one is cleared (JAX would otherwise raise with an
// exception already set: a SystemError).
void clear_pending_python_error() {
  if (!Py_IsInitialized() || python_finalizing()) return;
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
  if (python_finalizing()) {
    return ffi::Error::Internal("torch op " + plan->name + ": not run, the Python interpreter is shutting down "
                                "(a program still ran when the script ended); wait for its results "
                                "(jax.block_until_ready) before the script ends");
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
  } catch (const abi::__forced_unwind&) {
    throw;  // a thread being ended (pthread_exit, cancellation) must unwind; swallowing it aborts
  } catch (const c10::Error& e) {
    msg = e.what_without_backtrace();
  } catch (const std::exception& e) {
    msg = e.what();  // includes torch's python_error / pybind11's error_already_set
  } catch (...) {
    msg = "unknown C++ exception";
  }
  if (plan->mode != Mode::kCall) clear_pending_python_error();
  const char* fix =
      plan->mode == Mode::kCall
          ? ""
          : " (jax.grad reached this op: where torch names an op with no backward formula, register one with "
            "torch.library.register_autograd for that op, or use the op's forces output instead of jax.grad of "
            "its energy)";
  return ffi::Error(ffi::ErrorCode::kInternal,
                    "torch op " + plan->name + " failed inside its FFI " +
                        (plan->mode == Mode::kBackward
                             ? "backward call (torch autograd running the op's backward formula on its graph, "
                               "or re-running the op on the saved inputs): "
                             : plan->mode == Mode::kKeep ? "differentiated call (the op under torch autograd): "
                                                         : "call: ") +
                        msg + fix);
}

// guarded_call, and a failure also written to stderr at once: when the program has collectives, the
// other devices wait for this one in a rendezvous, and XLA may end the process at its timeout before
// the returned error reaches Python, which would lose the op's message.
// No C++ exception leaves the handler (XLA's frames are noexcept: one would std::terminate the process);
// whatever escapes guarded_call (an allocation failing while the message is written) is an error status.
ffi::Error guarded(int64_t plan_id, ffi::RemainingArgs args, ffi::RemainingRets rets, c10::Device device,
                   void* stream, int64_t run_id) {
  try {
    ffi::Error err = guarded_call(plan_id, args, rets, device, stream, run_id);
    if (err.failure()) {
      std::fprintf(stderr,
                   "nvalchemi_jaxbridge: on device %s: %s\n(also raised as a JAX error; if other devices wait "
                   "for this one in a collective, XLA may stop the process before that error reaches Python)\n",
                   device.str().c_str(), err.message().c_str());
      std::fflush(stderr);
    }
    return err;
  } catch (const abi::__forced_unwind&) {
    throw;
  } catch (...) {
    return ffi::Error(ffi::ErrorCode::kInternal, "nvalchemi_jaxbridge FFI call: a C++ exception while reporting "
                                                 "a failed torch op call (out of memory?)");
  }
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
  try {
    const Plan* plan = find_plan(id);
    return plan != nullptr && plan->graphs ? static_cast<int64_t>(plan->graphs->size()) : 0;
  } catch (...) {
    return -1;
  }
}

// How many backwards of the differentiated-forward plan `id` read their token back from the device
// (the others found their graph by where the token was written; 0 for any other plan).
int64_t jb_token_reads(int64_t id) {
  try {
    const Plan* plan = find_plan(id);
    return plan != nullptr && plan->graphs ? plan->graphs->token_reads() : 0;
  } catch (...) {
    return -1;
  }
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
