// The two calls of a differentiated op: the forward runs the op once under torch autograd, writes its
// results and keeps the graph in the plan's table (graphs.cc) under a token; the backward takes that graph
// (or re-runs the op on the backward's inputs where it is gone, or was kept for other input buffers) and
// writes the input gradients for the incoming cotangents. Included by torch_call.cc (one translation
// unit: build.py compiles that file alone).

#pragma once

#include <ATen/core/grad_mode.h>
#include <ATen/core/ivalue.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/ops/where.h>
#include <c10/core/AutogradState.h>
#include <torch/csrc/autograd/autograd.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "buffers.cc"

namespace jb {

// The op under autograd from the top of the dispatcher (its autograd kernel, a register_autograd
// formula or a composite's decomposition, records the graph) on the FFI arguments of a
// differentiated call's plan. The inputs are XLA's buffers, read in place (the graph may save them:
// `graph.inputs` records which, for the backward to check), except those the op mutates, which are
// cloned (never written into XLA's buffer); the differentiated ones are leaves. Fills `graph` and
// `results` (returns, then mutated arguments).
ffi::Error run_autograd(const Plan& plan, ffi::RemainingArgs args, c10::Device device, Graph& graph,
                        std::vector<at::Tensor>& results) {
  at::AutoGradMode grad_on(true);
  std::vector<c10::IValue> stack = plan.stack;
  graph.leaves.assign(plan.n_leaves, at::Tensor());
  graph.inputs.clear();
  std::vector<at::Tensor> mutated;
  for (const Slot& s : plan.slots) {
    auto a = args.get<ffi::AnyBuffer>(s.index);
    if (a.has_error()) return a.error();
    at::Tensor t = as_tensor(*a, device, plan, "argument", s.index);
    graph.inputs.push_back(s.cloned ? 0 : reinterpret_cast<uintptr_t>(a->untyped_data()));
    if (s.cloned) t = t.clone();
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
    return ffi::Error::Internal(text("op ", plan.name, " returned ", stack.size(),
                                      " value(s) under autograd, its schema declares ", plan.n_returns,
                                      "; fix the op's implementation to match its schema"));
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
  ffi::Error err = run_autograd(plan, args, device, graph, results);
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

// Whether a backward's input buffers are the ones its graph's forward read in place. The backward's inputs
// are the forward's residuals, the same values, and XLA writes no buffer that a pending call still reads:
// where the buffer is the forward's, it holds what the forward read, and the graph may read it. Other
// buffers (copies: another program's residuals, a scan's stacked ones) mean the graph may hold memory that
// is gone or reused; it must not be used then.
bool same_inputs(const Plan& plan, ffi::RemainingArgs args, const Graph& graph) {
  if (graph.inputs.size() != plan.slots.size()) return false;
  for (size_t i = 0; i < plan.slots.size(); ++i) {
    if (graph.inputs[i] == 0) continue;  // the forward read a clone
    auto a = args.get<ffi::AnyBuffer>(plan.slots[i].index);
    if (a.has_error() || reinterpret_cast<uintptr_t>(a->untyped_data()) != graph.inputs[i]) return false;
  }
  return true;
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
  if (kept && !same_inputs(plan, args, *kept)) kept.reset();  // dropped (reading no buffer); the op runs again
  Graph graph;
  if (kept) {
    graph = std::move(*kept);
  } else {
    std::vector<at::Tensor> results;
    ffi::Error err = run_autograd(plan, args, device, graph, results);
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
      return ffi::Error::InvalidArgument(
          text("op ", plan.name, ": the gradient of differentiated input ", l, " is ", describe(got),
               " but JAX expected ", describe(want), " (the input's shape and dtype); fix the op's backward "
               "formula (register_autograd) to return gradients shaped and typed like the inputs"));
    }
    write_gradient(table, mismatch, got, want);
  }
  return ffi::Error::Success();
}

}  // namespace jb
