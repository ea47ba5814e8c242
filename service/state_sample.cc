// SPDX-License-Identifier: Apache-2.0
#include "service/state_sample.h"

#include "engine/host_buffer.h"
#include "kernels/backend.h"

namespace lossd {

StateSample SampleState(Engine& engine) {
  StateSample s;
  const BackendInfo b = engine.backend_info();
  s.memory_in_use_bytes = static_cast<double>(engine.budget().in_use());
  s.memory_budget_bytes = static_cast<double>(engine.budget().budget());
  if (b.name == "cuda") {
    s.gpu_memory_used_bytes = static_cast<double>(b.memory_used_bytes);
    s.gpu_memory_total_bytes = static_cast<double>(b.memory_total_bytes);
    s.gpu_memory_peak_bytes = static_cast<double>(b.memory_peak_bytes);
    s.gpu_memory_held_bytes = static_cast<double>(b.memory_held_bytes);
    s.gpu_memory_budget_bytes = static_cast<double>(b.memory_budget_bytes);
  }
  s.weight_cache_bytes = static_cast<double>(engine.weights().bytes());
  s.weight_cache_budget_bytes = static_cast<double>(engine.weights().budget());
  s.weight_cache_entries = static_cast<double>(engine.weights().count());
  s.weight_cache_hits = static_cast<double>(engine.weights().hits());
  s.weight_cache_misses = static_cast<double>(engine.weights().misses());
  s.weight_cache_evictions = static_cast<double>(engine.weights().evictions());
  s.accumulators = static_cast<double>(engine.accumulators().count());
  s.accumulator_bytes = static_cast<double>(engine.accumulators().bytes());
  s.heads = static_cast<double>(engine.heads().count());
  s.head_bytes = static_cast<double>(engine.heads().bytes());
  s.head_budget_bytes = static_cast<double>(engine.options().head_bytes);
  s.tickets = static_cast<double>(engine.tickets().count());
  s.ticket_bytes = static_cast<double>(engine.tickets().bytes());
  s.ticket_budget_bytes = static_cast<double>(engine.options().ticket_bytes);
  s.max_tickets = static_cast<double>(engine.options().max_tickets);
  s.tickets_expired = static_cast<double>(engine.tickets().expired());
  s.queued_requests = static_cast<double>(engine.budget().waiting());
  s.host_buffer_pool_bytes = static_cast<double>(HostBufferPoolIdleBytes());
  s.healthy = b.healthy ? 1 : 0;
  return s;
}

}  // namespace lossd
