// SPDX-License-Identifier: Apache-2.0
#include "kernels/cuda/device_tuning.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/chunk_plan.h"

namespace lossd {
namespace cuda {
namespace {

// An H100 (SXM, PCIe or NVL: each reports "H100" in its name). The H200 and every other sm_90
// part keep the reference-exp path, measured at the floor on the H200.
bool IsH100(std::string_view name) { return name.find("H100") != std::string_view::npos; }

}  // namespace

DeviceTuning TuneForDevice(std::string_view device_name, int cc_major, int cc_minor,
                           RefExpChoice choice) {
  DeviceTuning t;
  t.default_chunk_rows = kMinDefaultChunkRows;
  const bool h100 = cc_major == 9 && cc_minor == 0 && IsH100(device_name);
  if (h100) {
    t.ref_exp = false;
    t.default_chunk_rows = kH100DefaultChunkRows;
    t.reason = "H100: the other path with 4096-row chunks (its CUTLASS logits GEMM is 1.17x "
               "cuBLASLt's here)";
  } else {
    t.reason = "reference-exp path with 2048-row chunks where the device has it";
  }
  if (choice == RefExpChoice::kOn) {
    t.ref_exp = true;
    t.reason = absl::StrCat("reference-exp path forced on; ", t.default_chunk_rows,
                            "-row chunks");
  } else if (choice == RefExpChoice::kOff) {
    t.ref_exp = false;
    t.reason = absl::StrCat("reference-exp path forced off; ", t.default_chunk_rows,
                            "-row chunks");
  }
  return t;
}

RefExpChoice RefExpChoiceFromEnv(const char* value) {
  if (value == nullptr) return RefExpChoice::kPerDevice;
  if (std::strcmp(value, "0") == 0) return RefExpChoice::kOff;
  if (std::strcmp(value, "1") == 0) return RefExpChoice::kOn;
  return RefExpChoice::kPerDevice;
}

}  // namespace cuda
}  // namespace lossd
