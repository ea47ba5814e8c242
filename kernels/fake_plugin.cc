// A stand-in for liblossd_cuda.so in plugin_loader_test: exports the factory and, unless built
// with FAKE_PLUGIN_NO_ABI, an ABI version of FAKE_PLUGIN_ABI. Its factory never makes a
// backend: a loader that reaches it with the wrong ABI fails the test by its message.
#include <cstddef>
#include <cstdint>
#include <cstdio>

#include "kernels/plugin_loader.h"

#ifndef FAKE_PLUGIN_NO_ABI
extern "C" __attribute__((visibility("default"))) uint32_t LossdCudaAbiVersion() {
  return FAKE_PLUGIN_ABI;
}
#endif

extern "C" __attribute__((visibility("default"))) lossd::Backend* LossdCreateCudaBackend(
    const LossdCudaOptions*, char* err, size_t err_len) {
  std::snprintf(err, err_len, "the fake plugin's factory was called");
  return nullptr;
}
