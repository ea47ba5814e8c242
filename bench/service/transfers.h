// SPDX-License-Identifier: Apache-2.0
// The transfer half of the service benchmark: PutWeights of a shape's bf16 W and FetchGradients
// of its fp32 dW, on one connection and striped (raw client) and through LossClient, timed.
// Checks only that the striped paths carry the same bytes as the plain ones (a striped W
// computes the same loss bit for bit; striped ranges reassemble the whole fetch).
#ifndef LOSSD_BENCH_SERVICE_TRANSFERS_H_
#define LOSSD_BENCH_SERVICE_TRANSFERS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "bench/service/bench_common.h"
#include "client/lossd_client.h"

namespace lossd {
namespace bench {

// PutWeights and FetchGradients of the first shape's W and fp32 dW: on one connection and
// striped (raw client), and through LossClient on one connection.
std::vector<Transfer> RunTransfers(const Env& env, const Shape& s, const uint8_t* w,
                                   const std::string& handle, client::LossClient* lc, int runs);

}  // namespace bench
}  // namespace lossd

#endif  // LOSSD_BENCH_SERVICE_TRANSFERS_H_
