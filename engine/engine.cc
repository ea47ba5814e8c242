#include "engine/engine.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/loss_problem_check.h"
#include "core/status_macros.h"
#include "engine/message_bounds.h"

namespace lossd {
namespace {

// Bounded: a shape is the client's, of any rank (message_bounds.h).
std::string ShapeString(const std::vector<int64_t>& shape) { return ShapeText(shape); }

uint64_t NumElements(const std::vector<int64_t>& shape) {
  uint64_t n = 1;
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

// Checks rank and that every dimension is positive and the element count cannot overflow.
absl::Status CheckShape(const TensorDesc& t, const char* name, size_t rank) {
  if (t.shape.size() != rank) {
    return absl::InvalidArgumentError(absl::StrCat(name, ".shape must have ", rank,
                                                   " dimensions, got ", ShapeString(t.shape)));
  }
  uint64_t n = 1;
  for (int64_t d : t.shape) {
    if (d <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ".shape ", ShapeString(t.shape), " has a dimension <= 0"));
    }
    if (static_cast<uint64_t>(d) > (uint64_t{1} << 40) / n) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ".shape ", ShapeString(t.shape), " is too large"));
    }
    n *= static_cast<uint64_t>(d);
  }
  return absl::OkStatus();
}

absl::Status CheckFloatDType(const TensorDesc& t, const char* name) {
  if (!IsFloatDType(t.dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, ".dtype must be bf16, fp16 or fp32, got ", DTypeName(t.dtype)));
  }
  return absl::OkStatus();
}

// True when any element is Inf or NaN: an all-ones exponent. Works on the raw bits with no
// branch per element (a per-element float conversion took 40% of the server's CPU on large
// uploads), in blocks of a fixed element count: gcc's -O2 vectoriser takes only loops with a
// known trip count, so the block loop is vectorised where one loop over n is not (a 64 MiB
// bf16 X: 31 ms -> 4 ms on the 2-core development machine).
template <typename Bits>
bool AnyNonFinite(const uint8_t* data, uint64_t n, Bits exponent_mask) {
  constexpr uint64_t kBlock = 512 / sizeof(Bits);
  Bits hit = 0;
  uint64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    Bits block[kBlock];
    std::memcpy(block, data + i * sizeof(Bits), sizeof(block));  // unaligned parts
    for (uint64_t j = 0; j < kBlock; ++j) {
      hit |= static_cast<Bits>((block[j] & exponent_mask) == exponent_mask);
    }
    if (hit != 0) return true;
  }
  for (; i < n; ++i) {
    Bits b;
    std::memcpy(&b, data + i * sizeof(Bits), sizeof(b));
    hit |= static_cast<Bits>((b & exponent_mask) == exponent_mask);
  }
  return hit != 0;
}

// Element i of a float tensor (bf16, fp16, fp32) as fp32, read through memcpy: like the
// fast path, the slow one may see a part's data at any byte address (LoadAsFloat's typed
// load of a misaligned element is undefined behaviour).
float LoadFloatUnaligned(const uint8_t* data, DType dtype, uint64_t i) {
  if (dtype == DType::kF32) {
    float f;
    std::memcpy(&f, data + i * sizeof(f), sizeof(f));
    return f;
  }
  uint16_t h;
  std::memcpy(&h, data + i * sizeof(h), sizeof(h));
  return dtype == DType::kBF16 ? Bf16ToFloat(h) : F16ToFloat(h);
}

// Elements [0, n) of `data` are elements [first, first + n) of the tensor `name` (for the
// index in the message).
absl::Status CheckFinite(const uint8_t* data, DType dtype, uint64_t n, const char* name,
                         int64_t cols, uint64_t first = 0) {
  bool any = false;
  switch (dtype) {
    case DType::kBF16: any = AnyNonFinite<uint16_t>(data, n, 0x7f80u); break;
    case DType::kF16: any = AnyNonFinite<uint16_t>(data, n, 0x7c00u); break;
    case DType::kF32: any = AnyNonFinite<uint32_t>(data, n, 0x7f800000u); break;
    default: return absl::OkStatus();
  }
  if (!any) return absl::OkStatus();
  for (uint64_t i = 0; i < n; ++i) {  // the slow path only finds where
    const float f = LoadFloatUnaligned(data, dtype, i);
    if (!std::isfinite(f)) {
      const uint64_t at = first + i;
      std::string where = cols > 0 ? absl::StrCat("[", at / cols, ", ", at % cols, "]")
                                   : absl::StrCat("[", at, "]");
      return absl::InvalidArgumentError(absl::StrCat(
          name, " contains a non-finite value (", std::isnan(f) ? "nan" : "inf", ") at ",
          where, "; lossd refuses NaN and Inf inputs (--check_finite)"));
    }
  }
  return absl::OkStatus();
}

// Handles and instance ids are short (w-<instance>-<n>, 8 hex digits); one of any length
// would be echoed whole in the error that answers it, and a status message past gRPC's
// metadata limit reaches the client as another error.
constexpr size_t kMaxIdLength = 128;
absl::Status CheckIdLength(const std::string& id, absl::string_view field) {
  if (id.size() <= kMaxIdLength) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(field, " is ", id.size(),
                                                 " characters long, more than any issued (",
                                                 kMaxIdLength, ")"));
}

// An accumulator a failed micro-batch may have left half-updated is never served as whole.
absl::Status PartialSumError(const std::string& name) {
  return absl::FailedPreconditionError(absl::StrCat(
      "accumulator '", name, "' may hold a partial sum: a micro-batch failed while adding "
      "into it; drop it and redo the step"));
}

double Seconds(absl::Time since) { return absl::ToDoubleSeconds(absl::Now() - since); }

}  // namespace

absl::Status CheckFiniteElements(const uint8_t* tensor, DType dtype, uint64_t first, uint64_t n,
                                 const char* name, int64_t cols) {
  return CheckFinite(tensor + first * DTypeSize(dtype), dtype, n, name, cols, first);
}

const char* InputSlotName(InputSlot s) {
  switch (s) {
    case InputSlot::kX: return "x";
    case InputSlot::kW: return "w";
    case InputSlot::kBias: return "bias";
    case InputSlot::kTargets: return "targets";
    case InputSlot::kClassWeights: return "class_weights";
    case InputSlot::kGradOutput: return "grad_output";
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
    case OutputSlot::kCount: break;
  }
  return "unknown";
}

namespace {

// Idle buffers by exact size, most recently freed last. Only buffers of at least 1 MiB are
// kept: smaller ones are cheap for malloc, which keeps them itself below the mmap threshold.
class HostBufferPool {
 public:
  static HostBufferPool& Get() {
    static HostBufferPool* pool = new HostBufferPool();  // never destroyed: freed at exit
    return *pool;
  }

  uint8_t* Take(uint64_t bytes) {
    if (bytes >= kMinPooled) {
      HostMemory* memory = nullptr;
      {
        absl::MutexLock lock(&mu_);
        auto it = idle_.find(bytes);
        if (it != idle_.end() && !it->second.empty()) {
          uint8_t* p = it->second.back();
          it->second.pop_back();
          idle_bytes_ -= bytes;
          return p;
        }
        // Only what the pool can keep is pinned: pinning and unpinning cost more than a copy
        // saves when the buffer is used once (a 2 GiB gradient snapshot, say).
        if (bytes <= cap_) memory = memory_;
      }
      // Pinning is slow (the pages are faulted in and locked): outside the lock.
      if (memory != nullptr) {
        if (auto* p = static_cast<uint8_t*>(memory->Allocate(bytes)); p != nullptr) {
          absl::MutexLock lock(&mu_);
          owner_[p] = memory;
          return p;
        }
      }
    }
    return new uint8_t[bytes == 0 ? 1 : bytes];
  }

  void SetMemory(HostMemory* memory) {
    absl::MutexLock lock(&mu_);
    memory_ = memory;
  }

  void Give(uint8_t* p, uint64_t bytes) {
    if (bytes >= kMinPooled) {
      absl::MutexLock lock(&mu_);
      // Make room by dropping other sizes first: the sizes in use now are the likely next.
      for (auto it = idle_.begin(); idle_bytes_ + bytes > cap_ && it != idle_.end(); ++it) {
        if (it->first == bytes) continue;
        while (!it->second.empty() && idle_bytes_ + bytes > cap_) {
          ReleaseLocked(it->second.back());
          it->second.pop_back();
          idle_bytes_ -= it->first;
        }
      }
      if (idle_bytes_ + bytes <= cap_) {
        idle_[bytes].push_back(p);
        idle_bytes_ += bytes;
        return;
      }
      ReleaseLocked(p);
      return;
    }
    delete[] p;
  }

  void SetCap(uint64_t cap) {
    absl::MutexLock lock(&mu_);
    cap_ = cap;
    for (auto& [size, list] : idle_) {
      while (!list.empty() && idle_bytes_ > cap_) {
        ReleaseLocked(list.back());
        list.pop_back();
        idle_bytes_ -= size;
      }
    }
  }

  uint64_t idle_bytes() {
    absl::MutexLock lock(&mu_);
    return idle_bytes_;
  }

 private:
  // Back to wherever the buffer came from: its HostMemory, or the heap.
  void ReleaseLocked(uint8_t* p) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = owner_.find(p);
    if (it == owner_.end()) {
      delete[] p;
      return;
    }
    it->second->Free(p);
    owner_.erase(it);
  }

  static constexpr uint64_t kMinPooled = 1 << 20;
  absl::Mutex mu_;
  HostMemory* memory_ ABSL_GUARDED_BY(mu_) = nullptr;
  absl::flat_hash_map<uint8_t*, HostMemory*> owner_ ABSL_GUARDED_BY(mu_);  // pinned buffers
  uint64_t cap_ ABSL_GUARDED_BY(mu_) = 2ull << 30;
  uint64_t idle_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<uint64_t, std::vector<uint8_t*>> idle_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

void HostBufferDeleter::operator()(uint8_t* p) const { HostBufferPool::Get().Give(p, bytes); }

void BindOutput(OutputSlot slot, void* ptr, LossOutputs* out) {
  switch (slot) {
    case OutputSlot::kLoss: out->loss = static_cast<float*>(ptr); break;
    case OutputSlot::kZLoss: out->z_loss = static_cast<float*>(ptr); break;
    case OutputSlot::kLse: out->lse = static_cast<float*>(ptr); break;
    case OutputSlot::kPredictions: out->predictions = static_cast<int64_t*>(ptr); break;
    case OutputSlot::kDx: out->dx = ptr; break;
    case OutputSlot::kDw: out->dw = ptr; break;
    case OutputSlot::kDb: out->db = ptr; break;
    case OutputSlot::kCount: break;
  }
}

HostBuffer NewHostBuffer(uint64_t bytes) {
  return HostBuffer(HostBufferPool::Get().Take(bytes), HostBufferDeleter{bytes});
}

void SetHostBufferPoolBytes(uint64_t bytes) { HostBufferPool::Get().SetCap(bytes); }

void SetHostBufferMemory(HostMemory* memory) { HostBufferPool::Get().SetMemory(memory); }

uint64_t HostBufferPoolIdleBytes() { return HostBufferPool::Get().idle_bytes(); }

PendingWeights::~PendingWeights() {
  if (engine != nullptr && reserved > 0) engine->weights_.Unreserve(reserved);
}

Engine::Engine(std::unique_ptr<Backend> backend, EngineOptions options)
    : backend_(std::move(backend)),
      options_(std::move(options)),
      budget_(options_.memory_budget_bytes, options_.max_queue),
      weights_(options_.weight_cache_bytes, options_.instance, options_.max_weight_handles),
      accumulators_(backend_.get(), options_.accumulator_bytes, options_.max_accumulators),
      executor_(options_.executor_threads) {
  // Request and response buffers in the backend's pinned memory where it has any, so its
  // copies to and from the device are direct DMA.
  SetHostBufferMemory(backend_->host_memory());
}

Engine::~Engine() = default;

void Engine::Drain() {
  draining_.store(true);
  budget_.Close();
}

absl::StatusOr<ComputePlan> Engine::Plan(const ComputeSpec& spec) {
  auto in = [&](InputSlot s) -> const TensorDesc& { return spec.inputs[static_cast<int>(s)]; };
  const TensorDesc& x = in(InputSlot::kX);
  const TensorDesc& w = in(InputSlot::kW);
  const TensorDesc& bias = in(InputSlot::kBias);
  const TensorDesc& targets = in(InputSlot::kTargets);
  const TensorDesc& cw = in(InputSlot::kClassWeights);
  const TensorDesc& go = in(InputSlot::kGradOutput);
  ComputePlan plan;

  if (!x.present) return absl::InvalidArgumentError("header.x is missing");
  LOSSD_RETURN_IF_ERROR(CheckShape(x, "x", 2));
  LOSSD_RETURN_IF_ERROR(CheckFloatDType(x, "x"));
  plan.bt = x.shape[0];
  plan.h = x.shape[1];
  plan.dtype = x.dtype;

  if (!spec.weight_handle.empty()) {
    LOSSD_RETURN_IF_ERROR(CheckIdLength(spec.weight_handle, "header.weight_handle"));
    if (w.present || bias.present) {
      return absl::InvalidArgumentError(absl::StrCat(
          "header names weight_handle '", spec.weight_handle,
          "' and also describes inline ", w.present ? "w" : "bias",
          "; send one or the other (a handle carries its own bias)"));
    }
    auto entry = weights_.Get(spec.weight_handle);
    if (!entry.ok()) return entry.status();
    LOSSD_RETURN_IF_ERROR(CheckOwner((*entry)->owner, spec.owner,
                                     absl::StrCat("weight handle '", spec.weight_handle, "'")));
    plan.weights = *entry;
    plan.weight_handle = spec.weight_handle;
    plan.v = plan.weights->v;
    plan.has_bias = plan.weights->bias != nullptr;
    if (plan.weights->h != plan.h) {
      return absl::InvalidArgumentError(absl::StrCat(
          "x.shape ", ShapeString(x.shape), " has H=", plan.h, " but the weights of handle '",
          spec.weight_handle, "' have H=", plan.weights->h));
    }
    if (plan.weights->dtype != plan.dtype) {
      return absl::InvalidArgumentError(absl::StrCat(
          "x.dtype ", DTypeName(plan.dtype), " differs from the dtype of handle '",
          spec.weight_handle, "' (", DTypeName(plan.weights->dtype), ")"));
    }
  } else {
    if (!w.present) {
      return absl::InvalidArgumentError("header has neither w nor weight_handle");
    }
    LOSSD_RETURN_IF_ERROR(CheckShape(w, "w", 2));
    LOSSD_RETURN_IF_ERROR(CheckFloatDType(w, "w"));
    if (w.shape[1] != plan.h) {
      return absl::InvalidArgumentError(absl::StrCat(
          "w.shape ", ShapeString(w.shape), " must be (V, H) with H = x.shape[1] = ", plan.h));
    }
    if (w.dtype != plan.dtype) {
      return absl::InvalidArgumentError(absl::StrCat("w.dtype ", DTypeName(w.dtype),
                                                     " differs from x.dtype ",
                                                     DTypeName(plan.dtype)));
    }
    plan.v = w.shape[0];
    if (bias.present) {
      LOSSD_RETURN_IF_ERROR(CheckShape(bias, "bias", 1));
      if (bias.shape[0] != plan.v) {
        return absl::InvalidArgumentError(absl::StrCat(
            "bias.shape ", ShapeString(bias.shape), " must be (V) = [", plan.v, "]"));
      }
      if (bias.dtype != plan.dtype) {
        return absl::InvalidArgumentError(absl::StrCat("bias.dtype ", DTypeName(bias.dtype),
                                                       " differs from x.dtype ",
                                                       DTypeName(plan.dtype)));
      }
      plan.has_bias = true;
    }
  }

  if (plan.bt > options_.max_bt || plan.h > options_.max_h || plan.v > options_.max_v) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shape (BT=", plan.bt, ", H=", plan.h, ", V=", plan.v, ") exceeds the limits (BT <= ",
        options_.max_bt, ", H <= ", options_.max_h, ", V <= ", options_.max_v,
        "; --max_bt, --max_h, --max_v)"));
  }

  if (!targets.present) return absl::InvalidArgumentError("header.targets is missing");
  LOSSD_RETURN_IF_ERROR(CheckShape(targets, "targets", 1));
  if (targets.shape[0] != plan.bt) {
    return absl::InvalidArgumentError(absl::StrCat("targets.shape ", ShapeString(targets.shape),
                                                   " must be (BT) = [", plan.bt, "]"));
  }
  if (targets.dtype != DType::kI32 && targets.dtype != DType::kI64) {
    return absl::InvalidArgumentError(absl::StrCat("targets.dtype must be int32 or int64, got ",
                                                   DTypeName(targets.dtype)));
  }
  plan.target_dtype = targets.dtype;

  if (cw.present) {
    LOSSD_RETURN_IF_ERROR(CheckShape(cw, "class_weights", 1));
    if (cw.shape[0] != plan.v) {
      return absl::InvalidArgumentError(absl::StrCat(
          "class_weights.shape ", ShapeString(cw.shape), " must be (V) = [", plan.v, "]"));
    }
    if (cw.dtype != DType::kF32) {
      return absl::InvalidArgumentError(
          absl::StrCat("class_weights.dtype must be fp32, got ", DTypeName(cw.dtype)));
    }
  }

  const LossOptions& o = spec.options;
  // The option rules are the one validation's (core/loss_problem_check.h), checked here so
  // that a request is refused before its tensors arrive; the grad_output tensor between them
  // keeps the order in which a request's first error is reported.
  LOSSD_RETURN_IF_ERROR(CheckReduction(o, go.present));
  if (go.present) {
    LOSSD_RETURN_IF_ERROR(CheckShape(go, "grad_output", 1));
    if (go.shape[0] != plan.bt) {
      return absl::InvalidArgumentError(absl::StrCat(
          "grad_output.shape ", ShapeString(go.shape), " must be (BT) = [", plan.bt, "]"));
    }
    if (go.dtype != DType::kF32) {
      return absl::InvalidArgumentError(
          absl::StrCat("grad_output.dtype must be fp32, got ", DTypeName(go.dtype)));
    }
  }
  LOSSD_RETURN_IF_ERROR(CheckOptionRanges(o));
  if (o.reduction == Reduction::kNone && o.grad_scale != 1.0f) {
    // A rule of the request, not of the problem: both backends scale per row by grad_output
    // there, so a grad_scale would be ignored (and the client would not know).
    return absl::InvalidArgumentError(absl::StrCat(
        "options.grad_scale ", o.grad_scale, " applies to reduction mean and sum; with "
        "reduction none scale grad_output (one value per row) instead"));
  }
  LOSSD_RETURN_IF_ERROR(CheckChunkRows(o));
  // More than kMaxRequestedChunks chunks <=> chunk_rows < ceil(BT / kMaxRequestedChunks),
  // which cannot overflow whatever chunk_rows is.
  const int64_t least = (plan.bt + kMaxRequestedChunks - 1) / kMaxRequestedChunks;
  if (o.chunk_rows > 0 && o.chunk_rows < least) {
    // Each chunk is a few GEMMs and kernel launches, and a running compute cannot be
    // cancelled: a million one-row chunks would hold the device for most of a minute.
    return absl::InvalidArgumentError(absl::StrCat(
        "options.chunk_rows ", o.chunk_rows, " splits BT=", plan.bt, " rows into ",
        (plan.bt + o.chunk_rows - 1) / o.chunk_rows, " chunks; at most ", kMaxRequestedChunks,
        " are served (chunk_rows >= ", least, " here, or 0 to let the server choose)"));
  }
  plan.options = o;
  plan.wanted = spec.wanted;
  plan.grad_dtype = spec.grad_fp32 ? DType::kF32 : plan.dtype;

  if (spec.accumulator.empty() && !spec.accumulator_instance.empty()) {
    return absl::InvalidArgumentError(
        "header.accumulator_instance is set but header.accumulator is not: the instance is "
        "checked for a named accumulator only");
  }
  if (!spec.accumulator.empty()) {
    LOSSD_RETURN_IF_ERROR(ValidateAccumulatorName(spec.accumulator, "header.accumulator"));
    LOSSD_RETURN_IF_ERROR(CheckAccumulatorInstance(spec.accumulator_instance, spec.accumulator,
                                                   "header.accumulator_instance"));
    // Refused now rather than after every byte of X and W has arrived.
    LOSSD_RETURN_IF_ERROR(
        accumulators_.Check(spec.accumulator, plan.v, plan.h, plan.has_bias, spec.owner));
    plan.accumulator = spec.accumulator;
    plan.owner = spec.owner;
  }

  // Byte counts of the inline inputs.
  const uint64_t es = DTypeSize(plan.dtype);
  auto& ib = plan.input_bytes;
  ib[static_cast<int>(InputSlot::kX)] = static_cast<uint64_t>(plan.bt) * plan.h * es;
  if (!plan.weights) {
    ib[static_cast<int>(InputSlot::kW)] = static_cast<uint64_t>(plan.v) * plan.h * es;
    if (plan.has_bias) ib[static_cast<int>(InputSlot::kBias)] = plan.v * es;
  }
  ib[static_cast<int>(InputSlot::kTargets)] = plan.bt * DTypeSize(plan.target_dtype);
  if (cw.present) ib[static_cast<int>(InputSlot::kClassWeights)] = plan.v * 4;
  if (go.present) ib[static_cast<int>(InputSlot::kGradOutput)] = plan.bt * 4;

  // Outputs, in the order they are sent.
  const bool none = o.reduction == Reduction::kNone;
  const uint64_t gs = DTypeSize(plan.grad_dtype);
  auto add = [&](OutputSlot slot, DType dt, std::vector<int64_t> shape) {
    uint64_t bytes = NumElements(shape) * DTypeSize(dt);
    plan.outputs.push_back(OutputDesc{slot, dt, std::move(shape), bytes});
  };
  if (none) add(OutputSlot::kLoss, DType::kF32, {plan.bt});
  if (none && plan.wanted.z_loss) add(OutputSlot::kZLoss, DType::kF32, {plan.bt});
  if (plan.wanted.lse) add(OutputSlot::kLse, DType::kF32, {plan.bt});
  if (plan.wanted.predictions) add(OutputSlot::kPredictions, DType::kI64, {plan.bt});
  if (plan.wanted.dx) add(OutputSlot::kDx, plan.grad_dtype, {plan.bt, plan.h});
  if (plan.accumulator.empty()) {
    if (plan.wanted.dw) add(OutputSlot::kDw, plan.grad_dtype, {plan.v, plan.h});
    if (plan.wanted.db && plan.has_bias) add(OutputSlot::kDb, plan.grad_dtype, {plan.v});
  }
  (void)gs;

  uint64_t host = 0;
  for (uint64_t b : ib) host += b;
  for (const OutputDesc& d : plan.outputs) host += d.bytes;
  plan.host_bytes = host;
  if (host > options_.max_request_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "request of (BT=", plan.bt, ", H=", plan.h, ", V=", plan.v, ") moves ", host,
        " bytes of tensors, more than --max_request_bytes=", options_.max_request_bytes));
  }

  // The backend's worst case for this shape, with a stand-in problem (no data yet).
  LossProblem p;
  p.bt = plan.bt;
  p.h = plan.h;
  p.v = plan.v;
  p.dtype = plan.dtype;
  p.w_memory = plan.weights ? Memory::kBackend : Memory::kHost;
  p.target_dtype = plan.target_dtype;
  p.options = plan.options;
  static uint8_t marker;  // non-null stand-ins: "this input/output is present"
  p.x = &marker;
  p.w = &marker;
  p.targets = &marker;
  p.bias = plan.has_bias ? &marker : nullptr;
  // Every input and output the request has, so the backend counts all of its device copies
  // (a device budget refuses the request here, not after its tensors have arrived).
  const float* fmarker = reinterpret_cast<const float*>(&marker);
  p.class_weights = cw.present ? fmarker : nullptr;
  p.grad_output = go.present ? fmarker : nullptr;
  LossOutputs out;
  out.grad_dtype = plan.grad_dtype;
  out.loss = reinterpret_cast<float*>(&marker);
  if (plan.wanted.dx) out.dx = &marker;
  if (!plan.accumulator.empty()) {
    out.dw_accum = reinterpret_cast<float*>(&marker);
    if (plan.has_bias) out.db_accum = reinterpret_cast<float*>(&marker);
    out.accum_memory = Memory::kBackend;
  } else {
    if (plan.wanted.dw) out.dw = &marker;
    if (plan.wanted.db && plan.has_bias) out.db = &marker;
  }
  plan.workspace_bytes = backend_->WorkspaceBytes(p, out);
  return plan;
}

void Engine::Run(std::shared_ptr<const ComputePlan> plan, std::shared_ptr<InputBuffers> inputs,
                 std::function<void(ComputeOutcome)> done, absl::Time deadline,
                 bool inputs_checked_finite, OverlapIo overlap,
                 std::function<bool()> cancelled) {
  const absl::Time submitted = absl::Now();
  executor_.Submit([this, plan, inputs, done = std::move(done), submitted, deadline,
                    inputs_checked_finite, overlap = std::move(overlap),
                    cancelled = std::move(cancelled)]() {
    const double queued = Seconds(submitted);
    auto not_started = [&](absl::Status why) {
      ComputeOutcome o;
      o.status = std::move(why);
      o.queue_seconds = queued;
      done(std::move(o));
    };
    if (absl::Now() > deadline) {
      return not_started(absl::DeadlineExceededError(absl::StrCat(
          "the deadline passed after ", queued, " s in the compute queue; not started")));
    }
    if (cancelled && cancelled()) {
      return not_started(absl::CancelledError(absl::StrCat(
          "the call was cancelled after ", queued, " s in the compute queue; not started")));
    }
    ComputeOutcome outcome = RunNow(*plan, *inputs, inputs_checked_finite, overlap);
    outcome.queue_seconds = queued;
    done(std::move(outcome));
  });
}

std::string Engine::MarkPartial(Accumulator& acc, uint64_t resets_at_add) {
  absl::MutexLock lock(&acc.mu);
  if (acc.resets != resets_at_add) {
    // A reset fetch has taken the sum with the micro-batch in it since: the sum there is
    // now is a new one, which it is not part of.
    return absl::StrCat("; its micro-batch had been added into accumulator '", acc.name,
                        "', whose sum a reset fetch has taken since");
  }
  acc.poisoned = true;
  return absl::StrCat("; its micro-batch had already been added into accumulator '", acc.name,
                      "', which now refuses further use until it is dropped (the sum cannot "
                      "be trusted: redo the step)");
}

std::vector<HostBuffer> Engine::NewOutputs(const ComputePlan& plan) {
  std::vector<HostBuffer> outputs;
  outputs.reserve(plan.outputs.size());
  for (const OutputDesc& d : plan.outputs) outputs.push_back(NewHostBuffer(d.bytes));
  return outputs;
}

ComputeOutcome Engine::RunNow(const ComputePlan& plan, InputBuffers& in, bool checked_finite,
                              const OverlapIo& overlap) {
  ComputeOutcome r;
  if (overlap.rows != nullptr &&
      (overlap.outputs == nullptr || overlap.outputs->size() != plan.outputs.size() ||
       (options_.check_finite && !checked_finite))) {
    r.status = absl::InternalError(
        "an overlapped compute needs its outputs made beforehand and X checked as it arrives");
    return r;
  }
  auto buf = [&](InputSlot s) { return in[static_cast<int>(s)].get(); };

  LossProblem p;
  p.bt = plan.bt;
  p.h = plan.h;
  p.v = plan.v;
  p.dtype = plan.dtype;
  p.x = buf(InputSlot::kX);
  if (plan.weights) {
    p.w = plan.weights->w->data();
    p.bias = plan.weights->bias ? plan.weights->bias->data() : nullptr;
    p.w_memory = Memory::kBackend;
  } else {
    p.w = buf(InputSlot::kW);
    p.bias = plan.has_bias ? buf(InputSlot::kBias) : nullptr;
  }
  p.targets = buf(InputSlot::kTargets);
  p.target_dtype = plan.target_dtype;
  p.class_weights = reinterpret_cast<const float*>(buf(InputSlot::kClassWeights));
  p.grad_output = reinterpret_cast<const float*>(buf(InputSlot::kGradOutput));
  p.options = plan.options;
  p.rows = overlap.rows.get();

  // The one validation of the problem (core/loss_problem_check.h), which every backend
  // assumes: the plan has checked all of it but the target range, which needs the bytes.
  r.status = ValidateLossInputs(p);
  if (!r.status.ok()) return r;
  // The other check that needs the bytes: finiteness.
  if (options_.check_finite && !checked_finite) {
    r.status = CheckFinite(buf(InputSlot::kX), plan.dtype,
                           static_cast<uint64_t>(plan.bt) * plan.h, "x", plan.h);
    if (!r.status.ok()) return r;
    if (!plan.weights) {
      r.status = CheckFinite(buf(InputSlot::kW), plan.dtype,
                             static_cast<uint64_t>(plan.v) * plan.h, "w", plan.h);
      if (!r.status.ok()) return r;
      if (plan.has_bias) {
        r.status = CheckFinite(buf(InputSlot::kBias), plan.dtype, plan.v, "bias", 0);
        if (!r.status.ok()) return r;
      }
    }
    if (buf(InputSlot::kClassWeights) != nullptr) {
      r.status = CheckFinite(buf(InputSlot::kClassWeights), DType::kF32, plan.v,
                             "class_weights", 0);
      if (!r.status.ok()) return r;
    }
    if (buf(InputSlot::kGradOutput) != nullptr) {
      r.status = CheckFinite(buf(InputSlot::kGradOutput), DType::kF32, plan.bt,
                             "grad_output", 0);
      if (!r.status.ok()) return r;
    }
  }
  // Class weights of any sign are accepted, as torch's cross_entropy accepts them: mean divides
  // by their sum over the non-ignored targets, whatever its sign (see the proto).

  LossOutputs out;
  out.grad_dtype = plan.grad_dtype;
  float loss_scalar = 0, z_scalar = 0, accuracy = 0;
  int64_t tokens = 0;
  const bool none = plan.options.reduction == Reduction::kNone;
  if (overlap.outputs == nullptr) r.outputs = NewOutputs(plan);
  std::vector<HostBuffer>& outputs = overlap.outputs != nullptr ? *overlap.outputs : r.outputs;
  for (size_t i = 0; i < plan.outputs.size(); ++i) {
    BindOutput(plan.outputs[i].slot, outputs[i].get(), &out);
  }
  if (!none) out.loss = &loss_scalar;
  if (!none && plan.wanted.z_loss) out.z_loss = &z_scalar;
  out.accuracy = &accuracy;  // cheap beside the loss: always computed
  out.tokens = &tokens;

  std::shared_ptr<Accumulator> acc;
  if (!plan.accumulator.empty()) {
    auto a = accumulators_.GetOrCreate(plan.accumulator, plan.v, plan.h, plan.has_bias,
                                       plan.owner);
    if (!a.ok()) {
      r.status = a.status();
      return r;
    }
    acc = *a;
    out.dw_accum = static_cast<float*>(acc->dw->data());
    out.db_accum = acc->db ? static_cast<float*>(acc->db->data()) : nullptr;
    out.accum_memory = Memory::kBackend;
  }
  // Where the results go, the rest of what a backend assumes (made here, so it holds).
  r.status = ValidateLossOutputs(p, out);
  if (!r.status.ok()) return r;

  // Finite inputs can still push the loss past fp32 (logits |x . w| > 3.4e38, or a huge
  // lse_square_scale): the request is refused rather than answered with inf or NaN.
  auto loss_is_finite = [&]() {
    const int64_t n = none ? plan.bt : 1;
    for (int64_t i = 0; i < n; ++i) {
      if (!std::isfinite(out.loss[i])) return false;
    }
    return true;
  };
  const std::string kOverflow = absl::StrCat(
      "the loss is not finite: the logits X W^T (+ b) or the z-loss (lse_square_scale=",
      plan.options.z_loss_scale, ") exceed fp32; scale them down");
  if (acc) {
    absl::MutexLock lock(&acc->mu);
    if (acc->poisoned) {
      r.status = PartialSumError(acc->name);
      return r;
    }
    r.status = NonFiniteSumStatus(*acc);
    if (!r.status.ok()) return r;
    r.status = backend_->Compute(p, out, &r.stats);
    if (r.status.ok() && !loss_is_finite()) {
      r.status = absl::InvalidArgumentError(absl::StrCat(
          kOverflow, " (accumulator '", acc->name, "' received non-finite values and must be "
          "dropped)"));
    }
    if (!r.status.ok()) {
      acc->poisoned = true;
      return r;
    }
    SetMicroBatches(*acc, acc->micro_batches + 1);
    acc->tokens += tokens;
    ++acc->generation;
    if ((r.stats.nonfinite & (kNonFiniteDw | kNonFiniteDb)) != 0) {
      MarkNonFinite(*acc, r.stats.nonfinite);
    }
    r.accumulated_micro_batches = acc->micro_batches;
    r.added_to = acc;
    r.added_resets = acc->resets;
  } else {
    r.status = backend_->Compute(p, out, &r.stats);
    if (!r.status.ok()) return r;
    if (!loss_is_finite()) {
      r.status = absl::InvalidArgumentError(kOverflow);
      return r;
    }
  }
  if (none) {
    // The summary carries the sum of the per-token values.
    double sum = 0, zsum = 0;
    const float* l = out.loss;
    for (int64_t i = 0; i < plan.bt; ++i) sum += l[i];
    if (out.z_loss != nullptr) {
      for (int64_t i = 0; i < plan.bt; ++i) zsum += out.z_loss[i];
    }
    r.loss = static_cast<float>(sum);
    r.z_loss = static_cast<float>(zsum);
  } else {
    r.loss = loss_scalar;
    r.z_loss = z_scalar;
  }
  r.accuracy = accuracy;
  r.tokens = tokens;
  return r;
}

absl::StatusOr<std::unique_ptr<PendingWeights>> Engine::BeginPutWeights(
    const TensorDesc& w, const TensorDesc& bias, const std::string& owner) {
  if (draining_.load()) return absl::UnavailableError("server is draining");
  if (!w.present) return absl::InvalidArgumentError("weights header.w is missing");
  LOSSD_RETURN_IF_ERROR(CheckShape(w, "w", 2));
  LOSSD_RETURN_IF_ERROR(CheckFloatDType(w, "w"));
  if (w.shape[0] > options_.max_v || w.shape[1] > options_.max_h) {
    return absl::InvalidArgumentError(absl::StrCat(
        "w.shape ", ShapeString(w.shape), " exceeds the limits (V <= ", options_.max_v,
        ", H <= ", options_.max_h, ")"));
  }
  if (bias.present) {
    LOSSD_RETURN_IF_ERROR(CheckShape(bias, "bias", 1));
    if (bias.shape[0] != w.shape[0]) {
      return absl::InvalidArgumentError(absl::StrCat(
          "bias.shape ", ShapeString(bias.shape), " must be (V) = [", w.shape[0], "]"));
    }
    if (bias.dtype != w.dtype) {
      return absl::InvalidArgumentError(absl::StrCat(
          "bias.dtype ", DTypeName(bias.dtype), " differs from w.dtype ", DTypeName(w.dtype)));
    }
  }
  auto p = std::make_unique<PendingWeights>();
  auto e = std::make_shared<WeightEntry>();
  e->owner = owner;
  e->dtype = w.dtype;
  e->v = w.shape[0];
  e->h = w.shape[1];
  const uint64_t wb = static_cast<uint64_t>(e->v) * e->h * DTypeSize(w.dtype);
  const uint64_t bb = bias.present ? e->v * DTypeSize(w.dtype) : 0;
  LOSSD_RETURN_IF_ERROR(weights_.Reserve(wb + bb));
  p->engine = this;
  p->reserved = wb + bb;
  auto wbuf = backend_->Allocate(wb);
  if (!wbuf.ok()) return wbuf.status();
  e->w = std::move(*wbuf);
  if (bias.present) {
    auto bbuf = backend_->Allocate(bb);
    if (!bbuf.ok()) return bbuf.status();
    e->bias = std::move(*bbuf);
  }
  p->entry = std::move(e);
  return p;
}

absl::Status Engine::CopyWeightPart(const WeightEntry& e, bool bias, uint64_t offset,
                                    const void* data, uint64_t bytes) {
  BackendBuffer* dst = bias ? e.bias.get() : e.w.get();
  const char* name = bias ? "bias" : "w";
  if (dst == nullptr) {
    return absl::InvalidArgumentError("a bias part arrived but the weights header has no bias");
  }
  const uint64_t es = DTypeSize(e.dtype);
  if (offset % es != 0 || bytes % es != 0) {
    // Whole elements only: the finiteness check reads each part as elements.
    return absl::InvalidArgumentError(absl::StrCat(
        "a part of ", name, " at offset ", offset, " with ", bytes, " bytes does not hold whole ",
        DTypeName(e.dtype), " elements (offset and size must be multiples of ", es, ")"));
  }
  if (offset > dst->size() || bytes > dst->size() - offset) {
    return absl::InvalidArgumentError(absl::StrCat(
        "part of ", name, " at offset ", offset, " with ", bytes, " bytes runs past its ",
        dst->size(), " bytes (shape x dtype)"));
  }
  if (options_.check_finite) {
    absl::Status s =
        CheckFinite(static_cast<const uint8_t*>(data), e.dtype, bytes / es, name, 0);
    if (!s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          s.message(), " (relative to the part at byte offset ", offset, ")"));
    }
  }
  return backend_->CopyToBackend(*dst, offset, data, bytes);
}

absl::Status Engine::WriteWeights(PendingWeights& p, bool bias, uint64_t offset,
                                  const void* data, uint64_t bytes) {
  uint64_t& got = p.received[bias ? 1 : 0];
  if (offset != got) {
    return absl::InvalidArgumentError(absl::StrCat(
        "part of ", bias ? "bias" : "w", " at offset ", offset, " but ", got,
        " bytes were received so far: parts must arrive in order without gaps or overlaps"));
  }
  LOSSD_RETURN_IF_ERROR(CopyWeightPart(*p.entry, bias, offset, data, bytes));
  got += bytes;
  return absl::OkStatus();
}

absl::StatusOr<std::string> Engine::CommitWeights(std::unique_ptr<PendingWeights> p) {
  const WeightEntry& e = *p->entry;
  if (p->received[0] != e.w->size() || (e.bias && p->received[1] != e.bias->size())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "weights stream closed early: w has ", p->received[0], " of ", e.w->size(), " bytes",
        e.bias ? absl::StrCat(", bias ", p->received[1], " of ", e.bias->size()) : ""));
  }
  p->reserved = 0;  // the cache takes the reservation over
  return weights_.Insert(std::move(p->entry));
}

absl::Status Engine::DropWeights(const std::string& handle, const std::string& caller) {
  LOSSD_RETURN_IF_ERROR(CheckIdLength(handle, "handle"));
  return weights_.Drop(handle, caller);
}

namespace {

// The fetch's range of `acc` with (0, 0) resolved to all of it, or why it is not one.
absl::StatusOr<std::pair<uint64_t, uint64_t>> FetchRangeOf(const Accumulator& acc,
                                                           const std::string& name, bool reset,
                                                           uint64_t begin, uint64_t end) {
  const uint64_t v = static_cast<uint64_t>(acc.v);  // dW | db in fp32
  const uint64_t total = v * static_cast<uint64_t>(acc.h) * 4 + (acc.has_bias ? v * 4 : 0);
  if (begin == 0 && end == 0) end = total;
  if (begin >= end || end > total) {
    return absl::InvalidArgumentError(absl::StrCat(
        "range [", begin, ", ", end, ") is not a non-empty byte range of accumulator '", name,
        "', whose dW | db holds ", total, " bytes"));
  }
  if (reset && (begin != 0 || end != total)) {
    return absl::InvalidArgumentError(
        "reset applies to whole fetches only; drop the accumulator after the last range");
  }
  return std::make_pair(begin, end);
}

}  // namespace

absl::Status Engine::CheckAccumulatorInstance(const std::string& expected,
                                              const std::string& name,
                                              absl::string_view field) const {
  if (expected.empty() || expected == options_.instance) return absl::OkStatus();
  LOSSD_RETURN_IF_ERROR(CheckIdLength(expected, field));
  return absl::FailedPreconditionError(absl::StrCat(
      field, " '", expected, "' is not this server (instance '", options_.instance,
      "'): accumulator '", ClippedText(name), "' began on another server instance (another "
      "replica, or "
      "this server before a restart, which lost its accumulators), and nothing of it is here. "
      "Keep a trainer's calls on one replica; after a restart drop the accumulator and start "
      "its sum again"));
}

absl::StatusOr<std::pair<uint64_t, uint64_t>> Engine::CheckFetch(const std::string& name,
                                                                 bool reset, uint64_t begin,
                                                                 uint64_t end,
                                                                 const std::string& caller) {
  LOSSD_RETURN_IF_ERROR(ValidateAccumulatorName(name, "accumulator"));
  auto a = accumulators_.Get(name);
  if (!a.ok()) return a.status();
  LOSSD_RETURN_IF_ERROR(
      CheckOwner((*a)->owner, caller, absl::StrCat("accumulator '", name, "'")));
  return FetchRangeOf(**a, name, reset, begin, end);
}

namespace {

// A reset fetch's zeroing of the sum and its counts. A failed zero leaves a sum nobody can
// trust: the accumulator is marked poisoned.
absl::Status ZeroSum(Backend& backend, Accumulator& acc) ABSL_EXCLUSIVE_LOCKS_REQUIRED(acc.mu) {
  absl::Status s = backend.Zero(*acc.dw);
  if (s.ok() && acc.db) s = backend.Zero(*acc.db);
  if (!s.ok()) {
    acc.poisoned = true;
    return s;
  }
  SetMicroBatches(acc, 0);
  acc.tokens = 0;
  ++acc.resets;
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<GradientsSnapshot> Engine::FetchGradients(const std::string& name, bool reset,
                                                         uint64_t begin, uint64_t end,
                                                         const std::string& caller) {
  LOSSD_RETURN_IF_ERROR(ValidateAccumulatorName(name, "accumulator"));
  auto a = accumulators_.Get(name);
  if (!a.ok()) return a.status();
  Accumulator& acc = **a;
  LOSSD_RETURN_IF_ERROR(CheckOwner(acc.owner, caller, absl::StrCat("accumulator '", name, "'")));
  acc.last_used_ns.store(NowNs());
  auto range = FetchRangeOf(acc, name, reset, begin, end);
  if (!range.ok()) return range.status();
  std::tie(begin, end) = *range;
  GradientsSnapshot g;
  g.v = acc.v;
  g.h = acc.h;
  g.has_bias = acc.has_bias;
  absl::MutexLock lock(&acc.mu);
  if (acc.poisoned) {
    return PartialSumError(name);
  }
  if (absl::Status nf = NonFiniteSumStatus(acc); !nf.ok()) {
    if (!reset) return nf;
    // A reset fetch of an overflowed sum is how a trainer skips the step: nothing to return,
    // but the accumulator starts over.
    LOSSD_RETURN_IF_ERROR(ZeroSum(*backend_, acc));
    ++acc.generation;
    acc.nonfinite_by.clear();
    return absl::FailedPreconditionError(absl::StrCat(
        nf.message(), "; this reset fetch returned nothing and zeroed it: the next Compute "
        "into it begins a new sum"));
  }
  g.micro_batches = acc.micro_batches;
  g.tokens = acc.tokens;
  ++acc.generation;  // a reset being undone must not hide that this fetch saw the sum
  g.begin = begin;
  g.end = end;
  g.data = NewHostBuffer(end - begin);
  const uint64_t dw_bytes = g.dw_bytes();
  if (begin < dw_bytes) {
    const uint64_t n = std::min(end, dw_bytes) - begin;
    LOSSD_RETURN_IF_ERROR(backend_->CopyFromBackend(*acc.dw, begin, g.data.get(), n));
  }
  if (end > dw_bytes) {
    const uint64_t from = std::max(begin, dw_bytes);
    LOSSD_RETURN_IF_ERROR(backend_->CopyFromBackend(*acc.db, from - dw_bytes,
                                                    g.data.get() + (from - begin), end - from));
  }
  if (reset) {
    LOSSD_RETURN_IF_ERROR(ZeroSum(*backend_, acc));
    g.reset_of = *a;
    g.generation_after_reset = acc.generation;
  }
  return g;
}

std::string Engine::UndoReset(const GradientsSnapshot& g, const uint8_t* data) {
  if (g.reset_of == nullptr) return "";
  Accumulator& acc = *g.reset_of;
  auto now = accumulators_.Get(acc.name);
  if (!now.ok() || now->get() != &acc) {
    return absl::StrCat("; accumulator '", acc.name, "', which it reset, has been dropped since");
  }
  absl::MutexLock lock(&acc.mu);
  if (acc.poisoned) return "";
  if (acc.generation != g.generation_after_reset) {
    acc.poisoned = true;
    return absl::StrCat("; its reset could not be undone (a Compute has added to accumulator '",
                        acc.name, "' or a fetch has read it since), so the accumulator now "
                        "refuses further use until it is dropped");
  }
  absl::Status s = backend_->CopyToBackend(*acc.dw, 0, data, g.dw_bytes());
  if (s.ok() && acc.db) s = backend_->CopyToBackend(*acc.db, 0, data + g.dw_bytes(), g.db_bytes());
  if (!s.ok()) {
    acc.poisoned = true;
    return absl::StrCat("; undoing its reset failed (", s.message(), "), so accumulator '",
                        acc.name, "' now refuses further use until it is dropped");
  }
  SetMicroBatches(acc, g.micro_batches);
  acc.tokens = g.tokens;
  return absl::StrCat("; its reset was undone: accumulator '", acc.name, "' holds its ",
                      g.micro_batches, " micro-batches again");
}

namespace {

// Length-prefixed, so no owner and id pair reads as another.
std::string UploadKey(const std::string& owner, const std::string& upload_id) {
  return absl::StrCat(owner.size(), ":", owner, upload_id);
}

}  // namespace

absl::StatusOr<std::shared_ptr<StripedUpload>> Engine::JoinStripedUpload(
    const std::string& owner, const std::string& upload_id, uint32_t stripes,
    const TensorDesc& w, const TensorDesc& bias, uint64_t begin, uint64_t end,
    bool carries_bias, const std::string& principal) {
  if (upload_id.size() > 128) {
    return absl::InvalidArgumentError("header.upload_id is longer than 128 characters");
  }
  if (stripes < 1 || stripes > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("header.stripes must be in [1, 64], got ", stripes));
  }
  std::shared_ptr<StripedUpload> u;
  {
    const std::string key = UploadKey(owner, upload_id);
    absl::MutexLock lock(&uploads_mu_);
    auto it = uploads_.find(key);
    if (it != uploads_.end()) {
      u = it->second;
    } else if (ended_.Find(key) != nullptr) {
      return absl::AbortedError(absl::StrCat(
          "striped upload '", upload_id,
          "' has already ended (completed or aborted); send it again under a new upload_id"));
    } else {
      auto pending = BeginPutWeights(w, bias, principal);
      if (!pending.ok()) return pending.status();
      u = std::make_shared<StripedUpload>();
      u->id_ = upload_id;
      u->key_ = key;
      u->stripes_ = stripes;
      u->w_ = w;
      u->bias_ = bias;
      absl::MutexLock ulock(&u->mu_);
      u->pending_ = std::move(*pending);
      uploads_[key] = u;
    }
  }
  absl::MutexLock lock(&u->mu_);
  if (u->done_) {
    return absl::AbortedError(absl::StrCat("striped upload '", upload_id, "' has already ended"));
  }
  // Every stripe's header must repeat the first one's: the byte counts of the upload are the
  // first stripe's (validated when it began), never a later header's.
  auto spec = [](const TensorDesc& t) {
    return t.present ? absl::StrCat(DTypeName(t.dtype), ShapeText(t.shape))
                     : std::string("absent");
  };
  auto disagree = [&](absl::string_view field, absl::string_view got, absl::string_view first) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a stripe of upload '", upload_id, "' disagrees with its first stripe: ", field, " is ",
        got, ", the first stripe's is ", first));
  };
  if (u->stripes_ != stripes) {
    return disagree("header.stripes", absl::StrCat(stripes), absl::StrCat(u->stripes_));
  }
  if (u->w_.dtype != w.dtype || u->w_.shape != w.shape) {
    return disagree("header.w", spec(w), spec(u->w_));
  }
  if (u->bias_.present != bias.present ||
      (bias.present && (u->bias_.dtype != bias.dtype || u->bias_.shape != bias.shape))) {
    return disagree("header.bias", spec(bias), spec(u->bias_));
  }
  const uint64_t w_bytes = u->pending_->entry->w->size();
  const uint64_t es = DTypeSize(w.dtype);
  if (begin % es != 0 || end % es != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "stripe range [", begin, ", ", end, ") must hold whole ", DTypeName(w.dtype),
        " elements (multiples of ", es, " bytes)"));
  }
  if (begin >= end || end > w_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "stripe range [", begin, ", ", end, ") is not a non-empty range of w's ", w_bytes,
        " bytes"));
  }
  for (const auto& r : u->ranges_) {
    if (begin < r.second && r.first < end) {
      return absl::InvalidArgumentError(absl::StrCat(
          "stripe range [", begin, ", ", end, ") overlaps the range [", r.first, ", ",
          r.second, ") of another stripe of upload '", upload_id, "'"));
    }
  }
  if (u->joined_ >= u->stripes_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "upload '", upload_id, "' already has its ", u->stripes_, " stripes"));
  }
  // The ranges are disjoint (above), so they cover w exactly once the stripes still to come
  // can fill what is left, at least one element each: refused as soon as they cannot,
  // naming the ranges, rather than found out at the end (or never, by stripes that wait).
  uint64_t covered = end - begin;
  for (const auto& r : u->ranges_) covered += r.second - r.first;
  const uint64_t still_to_join = u->stripes_ - u->joined_ - 1;
  const uint64_t left = w_bytes - covered;
  if (still_to_join == 0 ? left != 0 : left < still_to_join * es) {
    std::vector<std::string> ranges;
    for (const auto& r : u->ranges_) ranges.push_back(absl::StrCat("[", r.first, ", ", r.second, ")"));
    ranges.push_back(absl::StrCat("[", begin, ", ", end, ")"));
    return absl::InvalidArgumentError(absl::StrCat(
        "the ranges of upload '", upload_id, "' cannot cover w's ", w_bytes, " bytes with its ",
        u->stripes_, " stripes: ", absl::StrJoin(ranges, ", "), " cover ", covered, " bytes, ",
        still_to_join, " stripe(s) still to join"));
  }
  if (carries_bias) {
    if (u->bias_claimed_) {
      return absl::InvalidArgumentError("two stripes of one upload both send the bias");
    }
    u->bias_claimed_ = true;
  }
  u->ranges_.emplace_back(begin, end);
  ++u->joined_;
  return u;
}

absl::Status Engine::WriteStripe(StripedUpload& u, bool bias, uint64_t offset,
                                 const void* data, uint64_t bytes) {
  // A sibling stripe may abort the upload (and free its pending state) while this one copies:
  // the copy holds its own reference to the buffers, and the count is kept only if the
  // upload is still alive afterwards.
  std::shared_ptr<WeightEntry> entry;
  {
    absl::MutexLock lock(&u.mu_);
    if (u.done_) return absl::AbortedError(absl::StrCat("striped upload '", u.id_, "' was aborted"));
    entry = u.pending_->entry;
  }
  // Stripes write disjoint ranges of the same buffer, so no lock is held for the copy.
  LOSSD_RETURN_IF_ERROR(CopyWeightPart(*entry, bias, offset, data, bytes));
  absl::MutexLock lock(&u.mu_);
  if (u.done_) return absl::AbortedError(absl::StrCat("striped upload '", u.id_, "' was aborted"));
  if (bias) {
    u.pending_->received[1] += bytes;
  } else {
    u.w_received_ += bytes;
  }
  return absl::OkStatus();
}

void Engine::FinishStripe(const std::shared_ptr<StripedUpload>& u, StripedUpload::Waiter done) {
  std::vector<StripedUpload::Waiter> waiters;
  absl::StatusOr<std::string> result =
      absl::AbortedError(absl::StrCat("striped upload '", u->id_, "' was aborted"));
  bool completes = false;
  {
    absl::MutexLock lock(&u->mu_);
    if (u->done_) {
      waiters.push_back(std::move(done));  // aborted meanwhile
    } else {
      u->waiters_.push_back(std::move(done));
      if (++u->finished_ < u->stripes_) return;  // the last stripe completes the upload
      u->done_ = true;
      completes = true;
      u->pending_->received[0] = u->w_received_;
      result = CommitWeights(std::move(u->pending_));
      waiters.swap(u->waiters_);
    }
  }
  if (completes) {
    absl::MutexLock lock(&uploads_mu_);
    uploads_.erase(u->key_);
    ended_.Remember(u->key_, true);
  }
  for (auto& w : waiters) w(result);
}

void Engine::FailStripedUpload(const std::string& owner, const std::string& upload_id,
                               const absl::Status& why) {
  std::shared_ptr<StripedUpload> u;
  {
    absl::MutexLock lock(&uploads_mu_);
    auto it = uploads_.find(UploadKey(owner, upload_id));
    if (it == uploads_.end()) return;
    u = it->second;
  }
  FailStripedUpload(u, why);
}

void Engine::FailStripedUpload(const std::shared_ptr<StripedUpload>& u, const absl::Status& why) {
  std::vector<StripedUpload::Waiter> waiters;
  {
    absl::MutexLock lock(&u->mu_);
    if (u->done_) return;
    u->done_ = true;
    u->pending_.reset();  // frees the memory and the cache reservation
    waiters.swap(u->waiters_);
  }
  {
    absl::MutexLock lock(&uploads_mu_);
    uploads_.erase(u->key_);
    ended_.Remember(u->key_, true);
  }
  const absl::Status aborted = absl::AbortedError(absl::StrCat(
      "striped upload '", u->id_, "' was aborted because a stripe failed: ", why.message()));
  for (auto& w : waiters) w(aborted);
}


absl::Status Engine::DropAccumulator(const std::string& name, const std::string& caller) {
  LOSSD_RETURN_IF_ERROR(ValidateAccumulatorName(name, "accumulator"));
  return accumulators_.Drop(name, caller);
}

std::vector<StateInfo> Engine::ListState(const std::string& caller) const {
  std::vector<StateInfo> all = weights_.List(caller);
  std::vector<StateInfo> accs = accumulators_.List(caller);
  all.insert(all.end(), std::make_move_iterator(accs.begin()),
             std::make_move_iterator(accs.end()));
  return all;
}

std::vector<std::string> Engine::DropIdleState(absl::Duration idle) {
  const int64_t before = NowNs() - absl::ToInt64Nanoseconds(idle);
  std::vector<std::string> dropped = weights_.DropIdle(before);
  std::vector<std::string> accs = accumulators_.DropIdle(before);
  dropped.insert(dropped.end(), accs.begin(), accs.end());
  return dropped;
}

}  // namespace lossd
