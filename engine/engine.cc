// SPDX-License-Identifier: Apache-2.0
// The Engine's life (construction, drain), the names of its slots and its state listing. The
// rest of the class lives beside it, one file per seam: plan.cc (a request checked into a
// plan), run.cc (the compute on the executor), uploads.cc (weight uploads),
// accumulator_ops.cc (fetches and the accumulators' failure rules).
#include "engine/engine.h"

#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/time.h"

namespace lossd {

const char* InputSlotName(InputSlot s) {
  switch (s) {
    case InputSlot::kX: return "x";
    case InputSlot::kW: return "w";
    case InputSlot::kBias: return "bias";
    case InputSlot::kTargets: return "targets";
    case InputSlot::kClassWeights: return "class_weights";
    case InputSlot::kGradOutput: return "grad_output";
    case InputSlot::kDlogp: return "dlogp";
    case InputSlot::kDentropy: return "dentropy";
    case InputSlot::kAdvantages: return "advantages";
    case InputSlot::kOldLogp: return "old_logp";
    case InputSlot::kRefLogp: return "ref_logp";
    case InputSlot::kTeacherX: return "teacher_x";
    case InputSlot::kTeacherW: return "teacher_w";
    case InputSlot::kTeacherBias: return "teacher_bias";
    case InputSlot::kIsRatio: return "is_ratio";
    case InputSlot::kTeacherTopkIds: return "teacher_topk_ids";
    case InputSlot::kTeacherTopkLogp: return "teacher_topk_logp";
    case InputSlot::kCount: break;
  }
  return "unknown";
}

const char* OutputSlotName(OutputSlot s) {
  switch (s) {
    case OutputSlot::kLoss: return "loss";
    case OutputSlot::kZLoss: return "z_loss";
    case OutputSlot::kLse: return "lse";
    case OutputSlot::kPredictions: return "predictions";
    case OutputSlot::kDx: return "dx";
    case OutputSlot::kDw: return "dw";
    case OutputSlot::kDb: return "db";
    case OutputSlot::kLogp: return "logp";
    case OutputSlot::kEntropy: return "entropy";
    case OutputSlot::kCount: break;
  }
  return "unknown";
}

Engine::Engine(std::unique_ptr<Backend> backend, EngineOptions options)
    : backend_(std::move(backend)),
      options_(std::move(options)),
      budget_(options_.memory_budget_bytes, options_.max_queue),
      weights_(options_.weight_cache_bytes, options_.instance, options_.max_weight_handles),
      accumulators_(backend_.get(), options_.accumulator_bytes, options_.max_accumulators),
      tickets_(TicketStore::Options{options_.instance, options_.ticket_bytes,
                                    options_.max_tickets, options_.ticket_max_ms,
                                    options_.ticket_clock_ns}),
      executor_(options_.executor_threads) {
  const BackendInfo info = backend_->Info();
  backend_name_ = info.name;
  loss_kinds_ = info.loss_kinds;
  // Request and response buffers in the backend's pinned memory where it has any, so its
  // copies to and from the device are direct DMA.
  SetHostBufferMemory(backend_->host_memory());
  heads_ = std::make_unique<HeadStore>(
      backend_.get(), &executor_,
      HeadStore::Options{options_.instance, options_.head_bytes, options_.max_heads,
                         options_.max_v, options_.max_h, options_.head_step_timeout,
                         options_.head_connect_group});
}

// The heads' watchdog submits to the executor: it stops before the executor joins.
Engine::~Engine() { heads_->Shutdown(); }

void Engine::Drain() {
  draining_.store(true);
  budget_.Close();
}

std::vector<StateInfo> Engine::ListState(const std::string& caller) const {
  std::vector<StateInfo> all = weights_.List(caller);
  std::vector<StateInfo> accs = accumulators_.List(caller);
  all.insert(all.end(), std::make_move_iterator(accs.begin()),
             std::make_move_iterator(accs.end()));
  std::vector<StateInfo> heads = heads_->List(caller);
  all.insert(all.end(), std::make_move_iterator(heads.begin()),
             std::make_move_iterator(heads.end()));
  std::vector<StateInfo> tickets = tickets_.List(caller);
  all.insert(all.end(), std::make_move_iterator(tickets.begin()),
             std::make_move_iterator(tickets.end()));
  return all;
}

std::vector<std::string> Engine::DropIdleState(absl::Duration idle) {
  const int64_t before = NowNs() - absl::ToInt64Nanoseconds(idle);
  std::vector<std::string> dropped = weights_.DropIdle(before);
  std::vector<std::string> accs = accumulators_.DropIdle(before);
  dropped.insert(dropped.end(), accs.begin(), accs.end());
  std::vector<std::string> heads = heads_->DropIdle(before);
  dropped.insert(dropped.end(), heads.begin(), heads.end());
  return dropped;
}

}  // namespace lossd
