// The feature names ServerInfo announces: one per addition to lossd.v1 that an older server
// would not honour. Never reuse or rename a name; a client tests for one before it sends the
// field the feature adds (an older server refuses unknown fields, see wire_convert).
#ifndef LOSSD_ENGINE_FEATURES_H_
#define LOSSD_ENGINE_FEATURES_H_

#include <array>
#include <string_view>

namespace lossd {

// Sorted, one line each, with what a client may rely on when it is listed.
inline constexpr std::array<std::string_view, 6> kServerFeatures = {
    // Hosted heads: CreateHead, Step, ExportHead, GetHeadInfo, DropHead, ComputeHeader.head
    // and its fields, ComputeSummary.head_version / head_added, StateEntry STATE_HEAD.
    "hosted_head",
    // The List RPC: the caller's own weight handles and accumulators, sizes and last use.
    "list_state",
    // ComputeSummary.nonfinite names the gradients holding NaN or Inf after a Compute, and an
    // accumulator whose sum became non-finite refuses later Computes and fetches
    // (FAILED_PRECONDITION naming the micro-batch) until a reset fetch or a drop.
    "nonfinite_outputs",
    // Weight handles and accumulators belong to the credential that created them (bearer
    // token, or verified client certificate); others get PERMISSION_DENIED. Without auth,
    // state is anyone's.
    "owned_state",
    // The server refuses a request that carries a field it does not know (INVALID_ARGUMENT
    // naming the message and the field number) instead of ignoring it.
    "refuse_unknown_fields",
    // LossOptions.token_scaling (Liger's use_token_scaling) is honoured.
    "token_scaling",
};

}  // namespace lossd

#endif  // LOSSD_ENGINE_FEATURES_H_
