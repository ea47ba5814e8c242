// SPDX-License-Identifier: Apache-2.0
// Refuses a request message that carries fields this server does not know: proto3 parsing
// keeps them aside silently, so a client asking for a newer option would otherwise get the
// old behaviour without a word. Checks nested messages too; never looks at field values.
#ifndef LOSSD_WIRE_UNKNOWN_FIELDS_H_
#define LOSSD_WIRE_UNKNOWN_FIELDS_H_

#include <cstdint>

#include <google/protobuf/message.h>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace lossd {

// OK when neither `message` nor any message inside it has unknown fields; else
// INVALID_ARGUMENT "<where>.<path> (lossd.v1.<Type>) carries field number N, which this
// server does not know (...)". `where` names the message for the user, e.g. "ComputeHeader".
absl::Status RefuseUnknownFields(const google::protobuf::Message& message,
                                 absl::string_view where);

// The same refusal for a field number a hand-written parser skipped (Compute's stream
// frames); `where` names the message that carried it.
absl::Status UnknownFieldError(absl::string_view where, absl::string_view type,
                               uint64_t field_number);

}  // namespace lossd

#endif  // LOSSD_WIRE_UNKNOWN_FIELDS_H_
