// SPDX-License-Identifier: Apache-2.0
// ThreadSanitizer support for the system's gRPC (built without TSan): tells TSan about the one
// ordering gRPC guarantees to its users, that everything done before starting a batch of
// operations happens before that batch's completion is delivered (a callback reactor's
// OnReadDone / OnWriteDone / OnDone, or a tag returned by a completion queue). gRPC core makes
// that hand-off lock-free, inside libgrpc, where TSan cannot see it; without these edges TSan
// reports gRPC's own inline C++ code (CallOpSet, interceptors, the callback tags, compiled
// into our binaries) and every reactor member as racing with itself across threads.
// Two more orderings gRPC makes with atomics TSan cannot see: a slice's reference count (the
// last owner to drop a slice, on any thread, frees it after every owner's reads), and a
// server reactor's count of outstanding callbacks (OnDone runs after every other reaction),
// whose last decrement is often made inside libgrpc++.
// Interposes entry points of libgrpc and libgrpc++ (reached through -rdynamic, like the
// Abseil shim) and calls the real ones. Never adds an edge gRPC does not promise; never
// part of a production binary.
#include <dlfcn.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <utility>

#include "absl/status/status.h"
#include "grpc/grpc.h"
#include "grpc/slice.h"
#include "grpcpp/support/server_callback.h"
#include "tests/faults/tsan_shim_util.h"

namespace {

// The real function `name` in the next object (libgrpc.so, libgrpc++.so).
template <typename F>
F RealGrpc(const char* name) {
  return lossd_tsan::RealSymbol<F>("tsan_grpc_shim", name);
}

using FunctorRun = void (*)(grpc_completion_queue_functor*, int);

// gRPC C++'s callback tag (grpc::internal::CallbackWithSuccessTag) runs its completion through
// this function: the reactor's OnReadDone / OnWriteDone / OnDone start from there. Resolved
// by name (the binary exports its copy with -rdynamic; gRPC's libraries bind to the same).
FunctorRun CallbackTagRun() {
  static const FunctorRun run = reinterpret_cast<FunctorRun>(dlsym(
      RTLD_DEFAULT,
      "_ZN4grpc8internal22CallbackWithSuccessTag9StaticRunEP29grpc_completion_queue_functori"));
  return run;
}

// Runs in place of CallbackWithSuccessTag's own function: the completion first acquires what
// the thread that started the batch released on the tag, then runs as gRPC would.
void AcquireThenRun(grpc_completion_queue_functor* functor, int ok) {
  __tsan_acquire(functor);
  CallbackTagRun()(functor, ok);
}

// For a callback tag (its first member is the function gRPC calls on completion), routes
// the completion through AcquireThenRun. Any other tag (a completion-queue tag: a C++ object
// whose first word is its vtable) is left alone. The field belongs to gRPC, which reads it
// on its own threads where TSan sees nothing: our peek and write are not reported.
void RouteCallbackCompletion(void* tag) {
  const FunctorRun run = CallbackTagRun();
  if (tag == nullptr || run == nullptr) return;
  auto* functor = static_cast<grpc_completion_queue_functor*>(tag);
  __tsan_ignore_thread_begin();
  if (functor->functor_run == run) functor->functor_run = &AcquireThenRun;
  __tsan_ignore_thread_end();
}

}  // namespace

extern "C" {

grpc_call_error grpc_call_start_batch(grpc_call* call, const grpc_op* ops, size_t nops,
                                      void* tag, void* reserved) {
  static const auto real = RealGrpc<grpc_call_error (*)(grpc_call*, const grpc_op*, size_t,
                                                        void*, void*)>("grpc_call_start_batch");
  // Before the real call: the completion may run on another thread before it returns.
  RouteCallbackCompletion(tag);
  __tsan_release(tag);
  return real(call, ops, nops, tag, reserved);
}

grpc_event grpc_completion_queue_next(grpc_completion_queue* cq, gpr_timespec deadline,
                                      void* reserved) {
  static const auto real =
      RealGrpc<grpc_event (*)(grpc_completion_queue*, gpr_timespec, void*)>(
          "grpc_completion_queue_next");
  grpc_event ev = real(cq, deadline, reserved);
  if (ev.type == GRPC_OP_COMPLETE) __tsan_acquire(ev.tag);
  return ev;
}

grpc_event grpc_completion_queue_pluck(grpc_completion_queue* cq, void* tag,
                                       gpr_timespec deadline, void* reserved) {
  static const auto real =
      RealGrpc<grpc_event (*)(grpc_completion_queue*, void*, gpr_timespec, void*)>(
          "grpc_completion_queue_pluck");
  grpc_event ev = real(cq, tag, deadline, reserved);
  if (ev.type == GRPC_OP_COMPLETE) __tsan_acquire(ev.tag);
  return ev;
}

}  // extern "C"

// libgrpc's internal call (through its own PLT) that posts a finished operation's tag: the
// results gRPC's threads wrote for it (a received status, message or metadata) are visible to
// whoever takes the completion. Releasing on the tag here pairs with the acquires above.
struct grpc_cq_completion;
void grpc_cq_end_op(grpc_completion_queue* cq, void* tag, absl::Status error,
                    void (*done)(void* done_arg, grpc_cq_completion* storage), void* done_arg,
                    grpc_cq_completion* storage, bool internal) {
  using EndOp = void (*)(grpc_completion_queue*, void*, absl::Status,
                         void (*)(void*, grpc_cq_completion*), void*, grpc_cq_completion*, bool);
  static const auto real = RealGrpc<EndOp>(
      "_Z14grpc_cq_end_opP21grpc_completion_queuePvN4absl7debian36StatusEPFvS1_P18grpc_cq_"
      "completionES1_S6_b");
  __tsan_release(tag);
  real(cq, tag, std::move(error), done, done_arg, storage, internal);
}

extern "C" {

// A slice's reference count is an acquire-release counter: every owner's accesses happen
// before the free made by the last one. Static slices share a no-op count (address 1),
// which orders nothing and is skipped.
void grpc_slice_unref(grpc_slice s) {
  static const auto real = RealGrpc<void (*)(grpc_slice)>("grpc_slice_unref");
  if (reinterpret_cast<uintptr_t>(s.refcount) > 1) {
    __tsan_release(s.refcount);
    __tsan_acquire(s.refcount);
  }
  real(s);
}

}  // extern "C"

namespace grpc {
namespace internal {

// Called by the callback that drops a server call's last outstanding-callback reference;
// schedules OnDone. Every drop is an acquire-release decrement of callbacks_outstanding_,
// but the last one is often made in libgrpc++'s own (uninstrumented) copy of MaybeDone:
// acquiring on the counter here gives OnDone what every reaction released into it.
void ServerCallbackCall::ScheduleOnDone(bool inline_ondone) {
  static const auto real = RealGrpc<void (*)(ServerCallbackCall*, bool)>(
      "_ZN4grpc8internal18ServerCallbackCall14ScheduleOnDoneEb");
  __tsan_acquire(&callbacks_outstanding_);
  real(this, inline_ondone);
}

}  // namespace internal
}  // namespace grpc
