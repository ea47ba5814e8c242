// SPDX-License-Identifier: Apache-2.0
// Per-GPU defaults of the CUDA backend: which cross-entropy path a device takes by default and
// how many rows its default chunk holds. Host code only (a device's name and compute
// capability in, a choice out), so it is tested without a GPU.
//
// Why per GPU: on an H200 the reference-exp path (its CUTLASS logits GEMM with the row
// statistics in the epilogue) runs at the tuned cuBLAS floor with 2048-row chunks, but on an
// H100 at its 700 W cap the same GEMM takes 1.17-1.18x a cuBLASLt GEMM of its size, and the
// other path with 4096-row chunks measured fastest (bench/RESULTS.md, "The H100 round":
// 1.056x / 1.121x / 1.048x the tuned floor against 1.137x / 1.140x / 1.121x).
#ifndef LOSSD_KERNELS_CUDA_DEVICE_TUNING_H_
#define LOSSD_KERNELS_CUDA_DEVICE_TUNING_H_

#include <cstdint>
#include <string>
#include <string_view>

namespace lossd {
namespace cuda {

// Whether bf16 cross-entropy problems take the reference-exp path: the device's default, or
// forced on or off (an operator's LOSSD_CUDA_REF_EXP=1 / =0, a test or a benchmark).
enum class RefExpChoice { kPerDevice, kOn, kOff };

struct DeviceTuning {
  bool ref_exp = true;             // the reference-exp path where the plugin has it
  int64_t default_chunk_rows = 0;  // rows a default chunk budget holds (kMinDefaultChunkRows)
  std::string reason;              // one line for the logs and BackendInfo
};

// The defaults for a device of this name and compute capability, with `choice` applied.
DeviceTuning TuneForDevice(std::string_view device_name, int cc_major, int cc_minor,
                           RefExpChoice choice);

// LOSSD_CUDA_REF_EXP's value (nullptr when unset): "0" off, "1" on, anything else (or unset)
// the device's default.
RefExpChoice RefExpChoiceFromEnv(const char* value);

}  // namespace cuda
}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_DEVICE_TUNING_H_
