// SPDX-License-Identifier: Apache-2.0
#include "core/status_macros.h"
#include "wire/unknown_fields.h"

#include <string>
#include <vector>

#include <google/protobuf/descriptor.h>
#include <google/protobuf/unknown_field_set.h>

#include "absl/strings/str_cat.h"

namespace lossd {
namespace {

using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;

// Depth-first; `path` is the field path below the top message, for the message. The schema
// bounds the depth (no recursive message types in lossd.v1).
absl::Status Check(const Message& m, const std::string& path) {
  const Reflection* r = m.GetReflection();
  const google::protobuf::UnknownFieldSet& unknown = r->GetUnknownFields(m);
  if (!unknown.empty()) {
    return UnknownFieldError(path, m.GetDescriptor()->full_name(), unknown.field(0).number());
  }
  std::vector<const FieldDescriptor*> fields;
  r->ListFields(m, &fields);
  for (const FieldDescriptor* f : fields) {
    if (f->cpp_type() != FieldDescriptor::CPPTYPE_MESSAGE) continue;
    const std::string sub = absl::StrCat(path, ".", f->name());
    if (f->is_repeated()) {
      for (int i = 0; i < r->FieldSize(m, f); ++i) {
        LOSSD_RETURN_IF_ERROR(
            Check(r->GetRepeatedMessage(m, f, i), absl::StrCat(sub, "[", i, "]")));
      }
    } else {
      LOSSD_RETURN_IF_ERROR(Check(r->GetMessage(m, f), sub));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status UnknownFieldError(absl::string_view where, absl::string_view type,
                               uint64_t field_number) {
  return absl::InvalidArgumentError(absl::StrCat(
      where, " (", type, ") carries field number ", field_number,
      ", which this server does not know: it predates the option the client asked for "
      "(see ServerInfo.features and version)"));
}

absl::Status RefuseUnknownFields(const Message& message, absl::string_view where) {
  return Check(message, std::string(where));
}

}  // namespace lossd
