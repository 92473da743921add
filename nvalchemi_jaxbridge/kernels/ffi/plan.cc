// A plan: one op, its static arguments and where its tensors come from, decoded from the text
// plans.py writes. Included by torch_call.cc (one translation unit: build.py compiles that file alone).

#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "graphs.cc"

namespace jb {

// Messages are joined from strings and std::to_string, never written through an iostream: on the
// H200 machine (jax's CUDA plugin loaded, torch 2.11) the first number this library wrote into an
// ostringstream crashed the process (SIGSEGV in the stream's number formatting), so the error a
// user's op causes ended the process instead of reaching JAX. Integers only: no locale, no facets.
inline void append(std::string& s, const std::string& v) { s += v; }
inline void append(std::string& s, const char* v) { s += v; }
template <class T, std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, char> && !std::is_same_v<T, bool>, int> = 0>
inline void append(std::string& s, T v) {
  s += std::to_string(v);
}

template <class... Parts>
std::string text(const Parts&... parts) {
  std::string s;
  (append(s, parts), ...);
  return s;
}

// Where a tensor argument of the op comes from: FFI argument `index` or FFI result `index`
// (a mutated argument: XLA aliases it to its input, so the op writes into JAX's result).
// In the plans of a differentiated call a mutated argument is FFI argument `index`, cloned
// before the op writes into it (`cloned`), and `leaf` is its place among the differentiated
// inputs (or -1).
struct Slot {
  size_t stack_pos;
  bool from_result;
  size_t index;
  bool cloned = false;
  int64_t leaf = -1;
};

// kCall: the op below autograd, results written into XLA's buffers. kKeep: a differentiated
// call's forward: the op under autograd, its results, then the token of the graph it keeps in
// `graphs`. kBackward: the gradients of the differentiated inputs from the graph `source` kept
// (or from a re-run of the op where it is gone).
enum class Mode { kCall, kKeep, kBackward };

struct Plan {
  std::string name;  // "ns::op" or "ns::op.overload", for messages
  c10::OperatorHandle op;
  std::vector<c10::IValue> stack;  // one entry per schema argument; tensor slots hold None
  std::vector<Slot> slots;
  size_t n_args = 0;     // FFI arguments the call must bring
  size_t n_results = 0;  // FFI results: returns, then mutated arguments (then the token: kKeep)
  size_t n_returns = 0;  // tensors the op returns
  Mode mode = Mode::kCall;
  // kKeep and kBackward: `n_leaves` differentiated inputs (a kBackward plan's results are their
  // gradients); `outputs[j]` is the op result (returns, then mutated arguments in slot order)
  // whose cotangent is FFI argument n_args - outputs.size() + j of the kBackward plan.
  size_t n_leaves = 0;
  std::vector<size_t> outputs;
  size_t n_mutated = 0;
  size_t keep_cap = 0;                  // kKeep: the most graphs kept
  std::unique_ptr<GraphTable> graphs;   // kKeep: the graphs kept (made at registration)
  int64_t source_id = -1;               // kBackward: the id of the kKeep plan whose graphs it takes
  const Plan* source = nullptr;         // kBackward: that plan (resolved at registration)

  Plan(std::string n, c10::OperatorHandle h) : name(std::move(n)), op(std::move(h)) {}
};

// ---------------------------------------------------------------- static-argument decoding
//
// A version line "jb1 <number of FFI arguments>", then one line per schema argument
// (see plans.py, which writes them):
//   N            None                     b0 / b1      bool
//   i<int>       int64 (decimal)          d<float>     double, C99 hex float (exact), inf, -inf, nan
//   s<hex>       str, UTF-8 bytes in hex  I<i,i,...>   int list (may be empty)
//   D<d,d,...>   double list              B<0,1,...>   bool list
//   a<k>         FFI argument k           r<k>         FFI result k (mutated argument)
//   m<k>         FFI argument k, cloned (a mutated argument in a differentiated call's plans)
// The two plans of a differentiated call add three lines after the schema's:
//   G<k,k,...>   the FFI arguments differentiated, in the order of their gradient results
//   O<r,r,...>   the op results that get a cotangent; the backward's last FFI arguments are the cotangents
//   K<cap>       the forward (kKeep): keep at most `cap` graphs
//   T<id>        the backward (kBackward): the graphs of plan `id`; its FFI argument just before
//                the cotangents is the token

[[noreturn]] void bad(const std::string& what, size_t line) {
  throw std::invalid_argument(text("plan entry ", line, ": ", what));
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
  auto tag_of = [&](size_t i) { return lines[i].empty() ? '\0' : lines[i][0]; };
  const size_t n = lines.size();
  if (n >= 3 && tag_of(n - 3) == 'G' && tag_of(n - 2) == 'O' && (tag_of(n - 1) == 'K' || tag_of(n - 1) == 'T')) {
    const size_t at = n - 3;
    for (const auto& x : split(lines[at].substr(1), ',')) leaves.push_back(parse_int(x, at));
    for (const auto& x : split(lines[at + 1].substr(1), ',')) {
      int64_t r = parse_int(x, at + 1);
      if (r < 0) bad("negative result index", at + 1);
      plan.outputs.push_back(static_cast<size_t>(r));
    }
    const int64_t v = parse_int(lines[at + 2].substr(1), at + 2);
    if (tag_of(n - 1) == 'K') {
      if (v < 0) bad("negative graph cap", at + 2);
      plan.mode = Mode::kKeep;
      plan.keep_cap = static_cast<size_t>(v);
    } else {
      plan.mode = Mode::kBackward;
      plan.source_id = v;
      if (plan.outputs.size() + 1 > plan.n_args) bad("the backward has no room for its token and cotangents", at + 1);
    }
    lines.resize(at);
    plan.n_leaves = leaves.size();
  }
  // the arguments a tensor slot may name: all of them, but a backward's token and cotangents
  const size_t n_inputs = plan.mode == Mode::kBackward ? plan.n_args - plan.outputs.size() - 1 : plan.n_args;
  if (lines.size() != schema.arguments().size()) {
    throw std::invalid_argument(text("the plan has ", lines.size(), " argument(s) but the schema of ", plan.name,
                                     " has ", schema.arguments().size()));
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
        const bool graph_plan = plan.mode != Mode::kCall;
        if (tag == 'r' && graph_plan) bad("a differentiated call's plan takes mutated arguments as 'm', not 'r'", i);
        if (tag == 'm' && !graph_plan) bad("'m' slots belong to a differentiated call's plans", i);
        plan.slots.push_back({i, tag == 'r', static_cast<size_t>(k), tag == 'm'});
        if (tag != 'r' && static_cast<size_t>(k) >= n_inputs) bad("argument slot past the plan's inputs", i);
        if (tag != 'a') ++n_mutated;
        plan.stack.emplace_back();
        break;
      }
      default:
        bad(std::string("unknown tag '") + tag + "'", i);
    }
  }
  plan.n_mutated = n_mutated;
  if (plan.mode != Mode::kCall) {
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
    plan.n_results = plan.mode == Mode::kKeep ? plan.n_returns + n_mutated + 1 : plan.n_leaves;
    return;
  }
  plan.n_results = plan.n_returns + n_mutated;
  for (const auto& s : plan.slots) {
    if (s.from_result && (s.index < plan.n_returns || s.index >= plan.n_results)) {
      bad("mutated-argument slot points at result " + std::to_string(s.index), s.stack_pos);
    }
  }
}

}  // namespace jb
