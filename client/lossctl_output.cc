// SPDX-License-Identifier: Apache-2.0
#include "client/lossctl_output.h"

#include <cmath>
#include <cstdio>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace lossd {
namespace client {
namespace {

std::string ObjectText(const JsonFields& fields) {
  std::string out = "{";
  for (size_t i = 0; i < fields.size(); ++i) {
    absl::StrAppend(&out, i ? ", " : "", JsonString(fields[i].first), ": ",
                    JsonText(fields[i].second));
  }
  return out + "}";
}

void PrintLine(absl::string_view line) {
  std::fwrite(line.data(), 1, line.size(), stdout);
  std::fputc('\n', stdout);
  std::fflush(stdout);
}

}  // namespace

std::string JsonString(absl::string_view s) {
  std::string out = "\"";
  for (const char c : s) {
    const unsigned char u = static_cast<unsigned char>(c);
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (u < 0x20) {
          absl::StrAppend(&out, absl::StrFormat("\\u%04x", u));
        } else {
          out += c;  // UTF-8 passes through as it is
        }
    }
  }
  return out + "\"";
}

std::string JsonText(const JsonValue& value) {
  struct Visitor {
    std::string operator()(int64_t v) const { return absl::StrCat(v); }
    std::string operator()(uint64_t v) const { return absl::StrCat(v); }
    std::string operator()(double v) const {
      return std::isfinite(v) ? absl::StrFormat("%.17g", v) : "null";
    }
    std::string operator()(const std::string& v) const { return JsonString(v); }
    std::string operator()(bool v) const { return v ? "true" : "false"; }
    std::string operator()(const std::vector<std::string>& v) const {
      std::string out = "[";
      for (size_t i = 0; i < v.size(); ++i) absl::StrAppend(&out, i ? ", " : "", JsonString(v[i]));
      return out + "]";
    }
  };
  return std::visit(Visitor{}, value);
}

void CommandOutput::Field(absl::string_view key, JsonValue value, absl::string_view text) {
  if (!json_) {
    if (!text.empty()) PrintLine(text);
    return;
  }
  fields_.emplace_back(std::string(key), std::move(value));
}

void CommandOutput::Row(absl::string_view key, JsonFields row, absl::string_view text) {
  if (!json_) {
    PrintLine(text);
    return;
  }
  Rows(key).push_back(std::move(row));
}

void CommandOutput::Table(absl::string_view key) {
  if (json_) Rows(key);
}

std::vector<JsonFields>& CommandOutput::Rows(absl::string_view key) {
  for (auto& [name, rows] : rows_) {
    if (name == key) return rows;
  }
  return rows_.emplace_back(std::string(key), std::vector<JsonFields>()).second;
}

void CommandOutput::Progress(const JsonFields& fields, absl::string_view text) {
  if (!json_) {
    PrintLine(text);
    return;
  }
  PrintLine(absl::StrCat("{\"progress\": ", ObjectText(fields), "}"));
}

void CommandOutput::Finish(const absl::Status& status) {
  if (!json_) return;
  JsonFields head = {{"command", command_}, {"ok", status.ok()}};
  std::string out = ObjectText(head);
  out.pop_back();  // reopen the object for the fields and rows
  for (const auto& [key, value] : fields_) {
    absl::StrAppend(&out, ", ", JsonString(key), ": ", JsonText(value));
  }
  for (const auto& [key, rows] : rows_) {
    absl::StrAppend(&out, ", ", JsonString(key), ": [");
    for (size_t i = 0; i < rows.size(); ++i) absl::StrAppend(&out, i ? ", " : "", ObjectText(rows[i]));
    out += "]";
  }
  if (!status.ok()) {
    absl::StrAppend(&out, ", \"error\": ",
                    ObjectText({{"code", absl::StatusCodeToString(status.code())},
                                {"message", std::string(status.message())}}));
  }
  PrintLine(out + "}");
}

}  // namespace client
}  // namespace lossd
