// SPDX-License-Identifier: Apache-2.0
// The last N keys remembered, each with a value, the oldest forgotten first: what a
// long-running server keeps of things that ended (weight handles, striped upload ids) without
// growing for ever. Not thread-safe: its owner's lock guards it.
#ifndef LOSSD_ENGINE_RECENT_KEYS_H_
#define LOSSD_ENGINE_RECENT_KEYS_H_

#include <cstddef>
#include <deque>
#include <string>
#include <utility>

#include "absl/container/flat_hash_map.h"

namespace lossd {

template <typename V>
class RecentKeys {
 public:
  explicit RecentKeys(size_t capacity) : capacity_(capacity) {}

  // Remembers `key` with `value`. A key already remembered takes the new value and keeps its
  // place in the order; past the capacity the oldest key is forgotten.
  void Remember(const std::string& key, V value) {
    if (!values_.insert_or_assign(key, std::move(value)).second) return;
    order_.push_back(key);
    if (order_.size() > capacity_) {
      values_.erase(order_.front());
      order_.pop_front();
    }
  }

  // The value remembered for `key`, or null.
  const V* Find(const std::string& key) const {
    auto it = values_.find(key);
    return it == values_.end() ? nullptr : &it->second;
  }

 private:
  const size_t capacity_;
  absl::flat_hash_map<std::string, V> values_;
  std::deque<std::string> order_;  // oldest first
};

}  // namespace lossd

#endif  // LOSSD_ENGINE_RECENT_KEYS_H_
