// SPDX-License-Identifier: Apache-2.0
// What lossctl builds from its flags: the client and its connection options, a Compute
// request from .npy files or random data, the weights alone (put-weights), and where outputs
// are written. Reads the flags lossctl.cc defines (declared below); talks to no server.
#ifndef LOSSD_CLIENT_LOSSCTL_INPUTS_H_
#define LOSSD_CLIENT_LOSSCTL_INPUTS_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/host_tensor.h"
#include "client/lossctl_output.h"
#include "client/lossd_client.h"

ABSL_DECLARE_FLAG(std::string, accumulator);
ABSL_DECLARE_FLAG(std::string, auth_token);
ABSL_DECLARE_FLAG(std::string, auth_token_file);
ABSL_DECLARE_FLAG(std::string, bias);
ABSL_DECLARE_FLAG(int64_t, calls);
ABSL_DECLARE_FLAG(int64_t, bt);
ABSL_DECLARE_FLAG(int64_t, chunk_rows);
ABSL_DECLARE_FLAG(std::string, class_weights);
ABSL_DECLARE_FLAG(int32_t, concurrency);
ABSL_DECLARE_FLAG(int32_t, connections);
ABSL_DECLARE_FLAG(double, deadline_seconds);
ABSL_DECLARE_FLAG(std::string, dtype);
ABSL_DECLARE_FLAG(std::string, grad_dtype);
ABSL_DECLARE_FLAG(std::string, grad_output);
ABSL_DECLARE_FLAG(double, grad_scale);
ABSL_DECLARE_FLAG(int64_t, h);
ABSL_DECLARE_FLAG(std::string, head);
ABSL_DECLARE_FLAG(uint64_t, head_version);
ABSL_DECLARE_FLAG(double, ignore_fraction);
ABSL_DECLARE_FLAG(int64_t, ignore_index);
ABSL_DECLARE_FLAG(double, label_smoothing);
ABSL_DECLARE_FLAG(double, lse_square_scale);
ABSL_DECLARE_FLAG(std::string, metadata);
ABSL_DECLARE_FLAG(uint64_t, micro_batch);
ABSL_DECLARE_FLAG(bool, overlap);
ABSL_DECLARE_FLAG(std::string, out_dir);
ABSL_DECLARE_FLAG(int64_t, part_bytes);
ABSL_DECLARE_FLAG(uint32_t, rank);
ABSL_DECLARE_FLAG(std::string, reduction);
ABSL_DECLARE_FLAG(int64_t, range_bytes);
ABSL_DECLARE_FLAG(int64_t, response_part_bytes);
ABSL_DECLARE_FLAG(uint64_t, seed);
ABSL_DECLARE_FLAG(double, softcap);
ABSL_DECLARE_FLAG(int32_t, stripes);
ABSL_DECLARE_FLAG(int64_t, teacher_h);
ABSL_DECLARE_FLAG(std::string, target);
ABSL_DECLARE_FLAG(std::string, target_dtype);
ABSL_DECLARE_FLAG(std::string, targets);
ABSL_DECLARE_FLAG(bool, tls);
ABSL_DECLARE_FLAG(std::string, tls_ca);
ABSL_DECLARE_FLAG(std::string, tls_cert);
ABSL_DECLARE_FLAG(std::string, tls_key);
ABSL_DECLARE_FLAG(std::string, tls_server_name);
ABSL_DECLARE_FLAG(bool, token_scaling);
ABSL_DECLARE_FLAG(int64_t, v);
ABSL_DECLARE_FLAG(std::string, w);
ABSL_DECLARE_FLAG(bool, wait_for_ready);
ABSL_DECLARE_FLAG(int64_t, warmup);
ABSL_DECLARE_FLAG(std::string, want);
ABSL_DECLARE_FLAG(std::string, weight_handle);
ABSL_DECLARE_FLAG(bool, with_bias);
ABSL_DECLARE_FLAG(std::string, x);

namespace lossd {
namespace client {

// INVALID_ARGUMENT naming the flag and its value for a number outside its range, of the flags
// lossctl reads itself (shapes, fractions, counts, bytes, the deadline); the loss and optimizer
// options go to the server, which checks them and names the field.
absl::Status CheckFlagRanges();
// compute --head: INVALID_ARGUMENT when a weight, bias or accumulator flag is given too.
absl::Status CheckHeadComputeFlags();
// A float dtype's name (bf16, fp16, fp32, ...) as the flag `flag` gives it.
absl::StatusOr<DType> ParseFloatDType(const char* flag, const std::string& s);

// The ClientOptions of --target and the connection, TLS and token flags.
absl::StatusOr<ClientOptions> ClientOptionsFromFlags();
// A client for --target with the connection, TLS and token flags.
absl::StatusOr<std::unique_ptr<LossClient>> ClientFromFlags();
// The Compute the flags describe: inputs from .npy files (--x --w --targets ...) or random
// (--bt --h --v ...), or a hosted head (--head ...), its options and wanted outputs; *v_out
// is V.
absl::StatusOr<ComputeRequest> RequestFromFlags(int64_t* v_out);
// The loss options, grad dtype and wanted outputs (--reduction ... --grad_scale, --grad_dtype,
// --want) into r.
absl::Status LossOptionsFromFlags(ComputeRequest* r);
// W and the bias from --w/--bias, or random from --v --h --dtype --with_bias.
absl::Status LoadWeights(std::optional<HostTensor>* w, std::optional<HostTensor>* bias);

// Random data and .npy inputs, shared with lossctl_kinds: uniform in (-scale, scale) as
// `dtype`; a float tensor converted to `dtype` (a move when it already is); an optional .npy
// ("" = none).
HostTensor RandomFloat(DType dtype, std::vector<int64_t> shape, float scale, uint64_t seed);
absl::StatusOr<HostTensor> CastFloat(HostTensor t, DType dtype, const std::string& name);
absl::StatusOr<std::optional<HostTensor>> ReadOptional(const std::string& path);

// Bytes in binary units, as the server's log writes them: "23.54 GiB", "2.00 MiB",
// "1.50 KiB", "80 B" (the largest unit the value reaches).
std::string BinarySize(double bytes);
// A rate in GiB/s.
double GibPerSecond(double bytes, double seconds);
// `t` as <dir>/<name>.npy, listed in `out` (text: a "wrote" line; JSON: the list "wrote"), so
// that with --json stdout stays one JSON object.
absl::Status WriteOutput(const std::string& dir, const std::string& name, const HostTensor& t,
                         CommandOutput& out);
absl::Status MakeDir(const std::string& dir);

}  // namespace client
}  // namespace lossd

#endif  // LOSSD_CLIENT_LOSSCTL_INPUTS_H_
