// SPDX-License-Identifier: Apache-2.0
// The benchmark's accuracy check at its own shapes: a float64 reference of the mean
// cross-entropy of bf16 X W^T (no bias, no options: the benchmark's problem) computed on the
// device with DGEMMs over row chunks, and the fused op's loss, dX and dW compared with it.
// Never computes in less than float64; never linked into the server.
#ifndef LOSSD_BENCH_KERNEL_REFERENCE_FP64_H_
#define LOSSD_BENCH_KERNEL_REFERENCE_FP64_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

namespace lossd {
namespace bench {

struct Fp64Errors {
  double ref_loss = 0;     // the float64 mean loss
  double loss_rel = 0;     // |loss - ref| / |ref|
  double dx_rel_norm = 0;  // ||dX - ref||_2 / ||ref||_2 over every element
  double dw_rel_norm = 0;  // the same for dW
};

// Device memory it takes for a while: 8 (BT H + 2 V H + C (V + H)) bytes with C = row_chunk.
// Returns false with *error set on any CUDA or cuBLAS failure.
bool CompareWithFp64(int64_t bt, int64_t h, int64_t v,
                     const void* x,           // (BT, H) bf16, device
                     const void* w,           // (V, H) bf16, device
                     const int32_t* targets,  // (BT) in [0, V), device
                     double loss,             // the fused op's mean loss
                     const void* dx,          // (BT, H) bf16, device
                     const float* dw,         // (V, H) fp32, device
                     int64_t row_chunk, Fp64Errors* errors, std::string* error);

}  // namespace bench
}  // namespace lossd

#endif  // LOSSD_BENCH_KERNEL_REFERENCE_FP64_H_
