// SPDX-License-Identifier: Apache-2.0
// What the two plugin tests share (kernels/plugin_loader_test through the fake CPU plugin,
// kernels/cuda/plugin_compute_test through the CUDA one), so that the same Compute runs through
// the plugin and through the backend called directly: the option case that sets every option
// at once, a workspace shape, a problem's W placed in each backend's own memory, and the checks
// that the two agree. Test-only; never linked into the server; never loads a plugin itself.
#ifndef LOSSD_TESTING_PLUGIN_CASES_H_
#define LOSSD_TESTING_PLUGIN_CASES_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/dtype.h"
#include "core/loss_problem.h"
#include "kernels/backend.h"
#include "testing/test_util.h"

namespace lossd {

// Every option on at once: label smoothing, z-loss, softcap, bias, class weights, ignored
// rows, chunks of `chunk_rows`, and grad_output where the reduction is none.
OptionCase CombinedOptions(Reduction reduction, int64_t chunk_rows, bool grad_f32 = false);

// The shape of a problem (bt, h, v) in `dtype` with a bias, asking for dX and for dW and db
// as `dw`, in chunks of `chunk_rows` (0: the backend's choice).
WorkspaceShape BiasedShape(int64_t bt, int64_t h, int64_t v, DType dtype, GradOut dw,
                           int64_t chunk_rows = 0);

// Copies p's W, then its bias, into one new buffer of `backend` (*buffer, which must outlive
// the Compute) and returns p pointing at them there, w_memory kBackend.
absl::StatusOr<LossProblem> WithWeightsInBackend(Backend& backend, const LossProblem& p,
                                                 std::unique_ptr<BackendBuffer>* buffer);

// One problem for the backend called directly and for the plugin: p as it is, or, when
// `resident`, with W and the bias in each one's own memory (the buffers held here).
struct ProblemForBoth {
  LossProblem direct, plugin;
  std::unique_ptr<BackendBuffer> direct_w, plugin_w;
};
absl::Status PlaceForBoth(Backend& direct, Backend& plugin, const LossProblem& p, bool resident,
                          ProblemForBoth* both);

// The statistics both Computes report alike (EXPECTs, each message prefixed with `where`):
// the peak extra bytes, the chunk rows and the non-finite bits.
void ExpectSameStats(const LossStats& got, const LossStats& want, const std::string& where);

// p's rows of X refused after three with INVALID_ARGUMENT while the Compute runs: the plugin's
// Compute must end with the same status as the direct one, code and message (ASSERTs the
// direct one is INVALID_ARGUMENT; call under ASSERT_NO_FATAL_FAILURE to stop the test there).
void ExpectRowsRefusalCrossesBack(Backend& direct, Backend& plugin, const LossProblem& p);

}  // namespace lossd

#endif  // LOSSD_TESTING_PLUGIN_CASES_H_
