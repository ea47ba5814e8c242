// SPDX-License-Identifier: Apache-2.0
// Conversions between the plugin ABI's plain C structs (kernels/plugin_abi.h) and lossd's C++
// ones (kernels/backend.h, core/loss_problem.h), used on both sides of dlopen. Field by
// field, nothing rounded; never allocates beyond a status message, never touches a buffer a
// struct points to.
#ifndef LOSSD_KERNELS_PLUGIN_ABI_CONVERT_H_
#define LOSSD_KERNELS_PLUGIN_ABI_CONVERT_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "core/loss_problem.h"
#include "kernels/backend.h"
#include "kernels/optimizer.h"
#include "kernels/plugin_abi.h"

namespace lossd {

// Room for a status message crossing the boundary. Longer messages are cut; every message
// lossd writes is far shorter (the longest name a tensor, a shape and a limit).
inline constexpr size_t kPluginStatusMessageBytes = 16384;

// Writes `s` into *out (code, and the message cut to fit) and returns its code.
int32_t WriteStatus(const absl::Status& s, LossdStatus* out);

// A LossdStatus over a buffer of its own, for one call to the other side.
class StatusBuffer {
 public:
  StatusBuffer();
  StatusBuffer(const StatusBuffer&) = delete;
  StatusBuffer& operator=(const StatusBuffer&) = delete;
  LossdStatus* get() { return &status_; }
  // The status a call returned `code` with (OK for 0), with the message it wrote.
  absl::Status ToStatus(int32_t code) const;

 private:
  char message_[kPluginStatusMessageBytes];
  LossdStatus status_;
};

LossdWorkspaceShape ToC(const WorkspaceShape& s);
WorkspaceShape FromC(const LossdWorkspaceShape& s);
LossdLossOptions ToC(const LossOptions& o);
LossOptions FromC(const LossdLossOptions& o);
// The row stream does not convert: each side puts its own adapter in `rows`.
LossdProblem ToC(const LossProblem& p, const LossdRowStream* rows);
LossProblem FromC(const LossdProblem& p, RowStream* rows);
LossdOutputs ToC(const LossOutputs& o);
LossOutputs FromC(const LossdOutputs& o);
LossdStats ToC(const LossStats& s);
LossStats FromC(const LossdStats& s);
LossdOptimizerParams ToC(const OptimizerParams& p);
OptimizerParams FromC(const LossdOptimizerParams& p);
LossdOptimizerTensors ToC(const OptimizerTensors& t);
OptimizerTensors FromC(const LossdOptimizerTensors& t);
// Strings longer than the C struct's arrays are cut.
LossdBackendInfo ToC(const BackendInfo& i);
BackendInfo FromC(const LossdBackendInfo& i);

}  // namespace lossd

#endif  // LOSSD_KERNELS_PLUGIN_ABI_CONVERT_H_
