// SPDX-License-Identifier: Apache-2.0
// A server instance's identity, written into every weight handle ("w-<instance>-<n>") and
// accumulator reply: 8 lowercase hex digits, drawn at start. Only parses and makes ids; never
// decides what a request may do with one.
#ifndef LOSSD_ENGINE_INSTANCE_ID_H_
#define LOSSD_ENGINE_INSTANCE_ID_H_

#include <string>

#include "absl/strings/string_view.h"

namespace lossd {

// A fresh random id, as IsInstanceId accepts.
std::string NewInstanceId();

// Whether `s` has the form NewInstanceId makes: exactly 8 lowercase hex digits.
bool IsInstanceId(absl::string_view s);

// The instance part of a handle written as "w-<instance>-<n>" (n a decimal >= 1 without
// leading zeros, as the weight cache writes it) when that instance part IsInstanceId; else
// empty: the handle is not one any lossd issued.
absl::string_view HandleInstance(absl::string_view handle);

}  // namespace lossd

#endif  // LOSSD_ENGINE_INSTANCE_ID_H_
