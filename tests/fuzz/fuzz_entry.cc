// SPDX-License-Identifier: Apache-2.0
// The libFuzzer entry of one lossd fuzz target, chosen at compile time with
// -DLOSSD_FUZZ_ENTRY=lossd::fuzz::<Name>OneInput (see build_and_run.sh).
#include <cstddef>
#include <cstdint>

#include "tests/fuzz/fuzz_env.h"

#ifndef LOSSD_FUZZ_ENTRY
#error "define LOSSD_FUZZ_ENTRY to the target's OneInput function"
#endif

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  lossd::fuzz::Env();  // the engine and the preloaded weights, before the first input
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  LOSSD_FUZZ_ENTRY(data, size);
  return 0;
}
