// SPDX-License-Identifier: Apache-2.0
// The GPU's energy counter (NVML's total energy since the driver loaded, in millijoules), for
// benchmarks that ask what a piece of work costs in joules rather than in milliseconds: at the
// board's power cap the two are tied (time = energy / cap), so work that overlaps in time
// still adds in energy. NVML is the driver's own library; it is opened at run time, so the
// benchmark neither links it nor needs its headers, and runs (without energy) where it is
// missing.
#ifndef LOSSD_BENCH_KERNEL_GPU_ENERGY_H_
#define LOSSD_BENCH_KERNEL_GPU_ENERGY_H_

#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <cstdint>
#include <memory>

namespace lossd {
namespace bench {

class GpuEnergy {
 public:
  // The counter of CUDA device `device`, or null when NVML or the counter is unavailable.
  static std::unique_ptr<GpuEnergy> Open(int device) {
    void* lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) return nullptr;
    auto e = std::unique_ptr<GpuEnergy>(new GpuEnergy(lib));
    using InitFn = int (*)();
    using ByBusFn = int (*)(const char*, void**);
    auto init = reinterpret_cast<InitFn>(dlsym(lib, "nvmlInit_v2"));
    auto by_bus = reinterpret_cast<ByBusFn>(dlsym(lib, "nvmlDeviceGetHandleByPciBusId_v2"));
    e->energy_ = reinterpret_cast<EnergyFn>(dlsym(lib, "nvmlDeviceGetTotalEnergyConsumption"));
    char bus[32] = {0};
    // NVML numbers devices its own way; the PCI bus id names the same board for both.
    if (init == nullptr || by_bus == nullptr || e->energy_ == nullptr || init() != 0 ||
        cudaDeviceGetPCIBusId(bus, sizeof(bus), device) != cudaSuccess ||
        by_bus(bus, &e->handle_) != 0) {
      return nullptr;
    }
    unsigned long long mj = 0;
    if (e->energy_(e->handle_, &mj) != 0) return nullptr;  // the board has no counter
    return e;
  }
  ~GpuEnergy() { dlclose(lib_); }
  GpuEnergy(const GpuEnergy&) = delete;
  GpuEnergy& operator=(const GpuEnergy&) = delete;

  // Millijoules since the driver loaded; false when the read fails.
  bool Read(uint64_t* mj) const {
    unsigned long long v = 0;
    if (energy_(handle_, &v) != 0) return false;
    *mj = v;
    return true;
  }

 private:
  using EnergyFn = int (*)(void*, unsigned long long*);
  explicit GpuEnergy(void* lib) : lib_(lib) {}
  void* lib_;
  void* handle_ = nullptr;
  EnergyFn energy_ = nullptr;
};

}  // namespace bench
}  // namespace lossd

#endif  // LOSSD_BENCH_KERNEL_GPU_ENERGY_H_
