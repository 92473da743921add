// The torch autograd graphs a differentiated forward keeps for its backward (kernels/graph_table.py
// is the Python twin, and says why): at most `cap` graphs, the oldest evicted first, each named by
// a token (salt, serial) that travels to the backward as an int32 (2,) array.
//
// Each graph is also filed under where its token was written: the program run (XLA's RunId), the
// device and the token buffer's address. A backward of the same run that gets its token argument at
// that address finds the graph there, without reading the token back from the device (a stream
// synchronisation on a GPU); torch_call.cc then checks on the stream that the token there is the
// graph's (a copy of another token into that buffer would be the only way it is not). Entries leave
// with their graph (taken either way, or evicted), so there are never more than `cap`.
//
// A graph leaves the table (taken, evicted) under the lock but is destroyed outside it: freeing one
// may take the GIL (a Python autograd node), and a thread holding the GIL may wait for this lock.
// Included by plan.cc, in torch_call.cc's translation unit (build.py compiles that file alone).

#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/full.h>

#include <cstdint>
#include <functional>
#include <iterator>
#include <limits>
#include <list>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

namespace jb {

struct Graph {
  std::vector<at::Tensor> leaves;   // the differentiated inputs, in the plan's leaf order
  std::vector<at::Tensor> outputs;  // per cotangent: the op result, or undefined where no graph reaches it
  // Per plan slot, the address of the XLA buffer the forward read in place (0: it read a clone). The
  // graph may hold these buffers themselves, so it is valid only for a backward that gets the same ones.
  std::vector<uintptr_t> inputs;
};

// Where a forward wrote its token: the run of the program, the device and the token buffer.
struct TokenSite {
  int64_t run = 0;
  int32_t device = 0;
  uintptr_t address = 0;
  bool operator==(const TokenSite& o) const {
    return run == o.run && device == o.device && address == o.address;
  }
};

struct TokenSiteHash {
  size_t operator()(const TokenSite& s) const {
    size_t h = std::hash<int64_t>()(s.run);
    h = h * 1000003u ^ std::hash<int32_t>()(s.device);
    return h * 1000003u ^ std::hash<uintptr_t>()(s.address);
  }
};

class GraphTable {
 public:
  explicit GraphTable(size_t cap) : cap_(cap), salt_(static_cast<int32_t>(std::random_device{}() & 0x7fffffff)) {}

  int32_t salt() const { return salt_; }

  // Keep `g`, its token to be written at `site`; returns the token.
  std::pair<int32_t, int32_t> keep(Graph g, const TokenSite& site) {
    std::vector<Graph> evicted;  // destroyed after the lock is released
    int32_t serial;
    {
      std::lock_guard<std::mutex> lock(mu_);
      serial_ = serial_ % 0x7fffffff + 1;  // 1 .. 2^31 - 1
      serial = serial_;
      order_.push_back(Entry{serial, std::move(g), site});
      where_[serial] = std::prev(order_.end());
      auto old = at_site_.find(site);  // a graph whose token was overwritten here: only its token finds it now
      if (old != at_site_.end()) old->second = serial;
      else at_site_.emplace(site, serial);
      while (order_.size() > cap_) {
        evicted.push_back(std::move(order_.front().graph));
        forget(order_.front());
        order_.pop_front();
      }
    }
    return {salt_, serial};
  }

  // The graph of a token, removed from the table; nullopt when it is not (or no longer) here.
  std::optional<Graph> take(int32_t salt, int32_t serial) {
    std::lock_guard<std::mutex> lock(mu_);
    ++token_reads_;
    if (salt != salt_) return std::nullopt;
    auto it = where_.find(serial);
    if (it == where_.end()) return std::nullopt;
    return pop(it);
  }

  // The graph whose token was written at `site` (and its serial), removed; nullopt when none was.
  std::optional<std::pair<int32_t, Graph>> take_at(const TokenSite& site) {
    std::lock_guard<std::mutex> lock(mu_);
    auto s = at_site_.find(site);
    if (s == at_site_.end()) return std::nullopt;
    const int32_t serial = s->second;
    auto it = where_.find(serial);
    if (it == where_.end()) return std::nullopt;
    return std::make_pair(serial, std::move(*pop(it)));
  }

  size_t size() const {
    std::lock_guard<std::mutex> lock(mu_);
    return order_.size();
  }

  // A 0-d NaN of `dtype` on `device`, made once (one fill on the current stream) and kept: what a gradient
  // becomes where its graph was found by a site whose token is another's (torch_call.cc).
  at::Tensor nan_on(c10::Device device, c10::ScalarType dtype) {
    std::lock_guard<std::mutex> lock(mu_);
    at::Tensor& t = nans_[std::make_tuple(static_cast<int>(device.type()), static_cast<int>(device.index()),
                                          static_cast<int>(dtype))];
    if (!t.defined()) {
      t = at::full({}, std::numeric_limits<double>::quiet_NaN(), at::TensorOptions().dtype(dtype).device(device));
    }
    return t;
  }

  // How many backwards named their graph by the token's value (read back from the device).
  int64_t token_reads() const {
    std::lock_guard<std::mutex> lock(mu_);
    return token_reads_;
  }

 private:
  struct Entry {
    int32_t serial;
    Graph graph;
    TokenSite site;
  };
  using Iter = std::list<Entry>::iterator;

  // Under the lock: the entry's graph out, and the entry gone from every index.
  std::optional<Graph> pop(std::unordered_map<int32_t, Iter>::iterator it) {
    std::optional<Graph> g(std::move(it->second->graph));
    forget(*it->second);
    order_.erase(it->second);
    return g;
  }

  void forget(const Entry& e) {
    where_.erase(e.serial);
    auto s = at_site_.find(e.site);
    if (s != at_site_.end() && s->second == e.serial) at_site_.erase(s);
  }

  const size_t cap_;
  const int32_t salt_;  // tells this table's tokens from another table's or process's
  mutable std::mutex mu_;
  int32_t serial_ = 0;
  int64_t token_reads_ = 0;
  std::list<Entry> order_;  // oldest first
  std::unordered_map<int32_t, Iter> where_;
  std::unordered_map<TokenSite, int32_t, TokenSiteHash> at_site_;
  std::map<std::tuple<int, int, int>, at::Tensor> nans_;  // (device type, index, dtype) -> 0-d NaN
};

}  // namespace jb
