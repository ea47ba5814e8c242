// SPDX-License-Identifier: Apache-2.0
// What a lossctl command prints on stdout: aligned "key value" lines for people, each printed
// as it comes, or with --json one JSON object when the command ends (progress as JSON lines
// before it), so a script reads results without parsing text. Strings are escaped; NaN and
// infinities become null. Errors still go to stderr, and into the JSON object as "error".
#ifndef LOSSD_CLIENT_LOSSCTL_OUTPUT_H_
#define LOSSD_CLIENT_LOSSCTL_OUTPUT_H_

#include <cstdint>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace lossd {
namespace client {

// One JSON value: a number, a string, a bool or a list of strings.
using JsonValue =
    std::variant<int64_t, uint64_t, double, std::string, bool, std::vector<std::string>>;
using JsonFields = std::vector<std::pair<std::string, JsonValue>>;

// `value` as JSON text.
std::string JsonText(const JsonValue& value);
// `s` as a quoted JSON string.
std::string JsonString(absl::string_view s);

class CommandOutput {
 public:
  CommandOutput(std::string command, bool json) : command_(std::move(command)), json_(json) {}

  bool json() const { return json_; }
  // Text: `text` as a line, now (none where `text` is empty: a value another field's line
  // already shows). JSON: `key` = `value` in the final object.
  void Field(absl::string_view key, JsonValue value, absl::string_view text);
  // A table row: text: `text` now; JSON: an object of `row` appended to the list `key`.
  void Row(absl::string_view key, JsonFields row, absl::string_view text);
  // JSON: the list `key` is in the object even when no row comes (an empty list, so a script
  // reads "nothing" the same way as "something"). Text: nothing.
  void Table(absl::string_view key);
  // Text: `text` now; JSON: {"progress": {fields}} as a line of its own, now.
  void Progress(const JsonFields& fields, absl::string_view text);
  // JSON: prints {"command": ..., "ok": ..., fields..., rows..., "error": {...}} as one line.
  // Text: nothing (the caller reports errors on stderr either way).
  void Finish(const absl::Status& status);

 private:
  // The list `key`, made (empty, after those made before it) on first use.
  std::vector<JsonFields>& Rows(absl::string_view key);

  std::string command_;
  bool json_;
  JsonFields fields_;
  std::vector<std::pair<std::string, std::vector<JsonFields>>> rows_;
};

}  // namespace client
}  // namespace lossd

#endif  // LOSSD_CLIENT_LOSSCTL_OUTPUT_H_
