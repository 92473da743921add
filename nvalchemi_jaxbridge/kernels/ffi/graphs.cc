// The torch autograd graphs a differentiated forward keeps for its backward (kernels/graph_table.py
// is the Python twin, and says why): at most `cap` graphs, the oldest evicted first, each named by
// a token (salt, serial) that travels to the backward as an int32 (2,) array.
//
// A graph leaves the table (taken, evicted) under the lock but is destroyed outside it: freeing one
// may take the GIL (a Python autograd node), and a thread holding the GIL may wait for this lock.
// Included by plan.cc, in torch_call.cc's translation unit (build.py compiles that file alone).

#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <iterator>
#include <list>
#include <mutex>
#include <optional>
#include <random>
#include <unordered_map>
#include <utility>
#include <vector>

namespace jb {

struct Graph {
  std::vector<at::Tensor> leaves;   // the differentiated inputs (clones), in the plan's leaf order
  std::vector<at::Tensor> outputs;  // per cotangent: the op result, or undefined where no graph reaches it
};

class GraphTable {
 public:
  explicit GraphTable(size_t cap) : cap_(cap), salt_(static_cast<int32_t>(std::random_device{}() & 0x7fffffff)) {}

  // Keep `g`; returns its token.
  std::pair<int32_t, int32_t> keep(Graph g) {
    std::vector<Graph> evicted;  // destroyed after the lock is released
    int32_t serial;
    {
      std::lock_guard<std::mutex> lock(mu_);
      serial_ = serial_ % 0x7fffffff + 1;  // 1 .. 2^31 - 1
      serial = serial_;
      order_.emplace_back(serial, std::move(g));
      where_[serial] = std::prev(order_.end());
      while (order_.size() > cap_) {
        evicted.push_back(std::move(order_.front().second));
        where_.erase(order_.front().first);
        order_.pop_front();
      }
    }
    return {salt_, serial};
  }

  // The graph of a token, removed from the table; nullopt when it is not (or no longer) here.
  std::optional<Graph> take(int32_t salt, int32_t serial) {
    if (salt != salt_) return std::nullopt;
    std::lock_guard<std::mutex> lock(mu_);
    auto it = where_.find(serial);
    if (it == where_.end()) return std::nullopt;
    std::optional<Graph> g(std::move(it->second->second));
    order_.erase(it->second);
    where_.erase(it);
    return g;
  }

  size_t size() const {
    std::lock_guard<std::mutex> lock(mu_);
    return order_.size();
  }

 private:
  const size_t cap_;
  const int32_t salt_;  // tells this table's tokens from another table's or process's
  mutable std::mutex mu_;
  int32_t serial_ = 0;
  std::list<std::pair<int32_t, Graph>> order_;  // oldest first
  std::unordered_map<int32_t, std::list<std::pair<int32_t, Graph>>::iterator> where_;
};

}  // namespace jb
