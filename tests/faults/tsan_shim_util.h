// SPDX-License-Identifier: Apache-2.0
// What the ThreadSanitizer shims (tsan_absl_shim.cc, tsan_grpc_shim.cc) share: TSan's
// annotation entry points and the lookup of the real function a shim stands in front of.
// Only for --config=tsan builds; never part of a production binary.
#ifndef LOSSD_TESTS_FAULTS_TSAN_SHIM_UTIL_H_
#define LOSSD_TESTS_FAULTS_TSAN_SHIM_UTIL_H_

#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>

extern "C" void __tsan_acquire(void* addr);
extern "C" void __tsan_release(void* addr);
extern "C" void __tsan_ignore_thread_begin();
extern "C" void __tsan_ignore_thread_end();

namespace lossd_tsan {

// The real `symbol` in the next object after the shim (the system library it wraps). A
// library version that lacks it would leave the shim silently wrong: abort, naming `shim`.
template <typename F>
F RealSymbol(const char* shim, const char* symbol) {
  void* p = dlsym(RTLD_NEXT, symbol);
  if (p == nullptr) {
    std::fprintf(stderr, "%s: %s not found: %s\n", shim, symbol, dlerror());
    std::abort();
  }
  return reinterpret_cast<F>(p);
}

}  // namespace lossd_tsan

#endif  // LOSSD_TESTS_FAULTS_TSAN_SHIM_UTIL_H_
