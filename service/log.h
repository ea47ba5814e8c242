// SPDX-License-Identifier: Apache-2.0
// lossd's log: one spdlog logger writing text or JSON lines to stderr, gRPC's own log lines
// routed into it, and one line per refused or failed call (WARNING, rate-limited per method,
// code and caller) plus an optional access line per call. Every value is escaped and every
// client-controlled one bounded: a line never grows with what a client sent, nor breaks in two.
#ifndef LOSSD_SERVICE_LOG_H_
#define LOSSD_SERVICE_LOG_H_

#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "spdlog/sinks/sink.h"

namespace lossd {

enum class LogFormat { kText, kJson };
enum class LogLevel { kInfo, kWarning, kError };

// "text" or "json"; else INVALID_ARGUMENT naming --log_format and the value.
absl::StatusOr<LogFormat> ParseLogFormat(absl::string_view s);

struct LogOptions {
  LogFormat format = LogFormat::kText;
  bool access_log = false;      // one INFO line per call: method, peer, code, latency, bytes
  int warnings_per_second = 5;  // per method, code and caller; the rest counted, then summarised
};

// Sets up the process's logger (stderr where `sink` is null; tests pass their own) and routes
// gRPC's log lines into it. Called again, it replaces the previous set-up.
void InitLogging(const LogOptions& options, std::shared_ptr<spdlog::sinks::sink> sink = nullptr);

// One value of a line: text, or a number, which a JSON line writes as a JSON number (so a
// log query can compare it) and a text line bare. Text stays text even where it looks like a
// number: a name a client chose ("123") must not change type from one line to the next.
class LogValue {
 public:
  LogValue(std::string text) : text_(std::move(text)) {}  // NOLINT: fields read as literals
  LogValue(const char* text) : text_(text) {}             // NOLINT
  LogValue(absl::string_view text) : text_(text) {}       // NOLINT
  template <typename T, typename = std::enable_if_t<std::is_integral_v<T>>>
  LogValue(T n) : text_(absl::StrCat(n)), number_(true) {}  // NOLINT
  LogValue(bool) = delete;  // say what it means: "true" / "false" as text
  // `x` with `decimals` digits after the point; NaN and infinities (no JSON number) as text.
  static LogValue Fixed(double x, int decimals);

  const std::string& text() const { return text_; }
  bool number() const { return number_; }

 private:
  std::string text_;
  bool number_ = false;
};

// Named values of one line, in order; the caller bounds what a client chose (LogClipped).
using LogFields = std::vector<std::pair<std::string, LogValue>>;

void Log(LogLevel level, absl::string_view message, const LogFields& fields = {});

// `s` escaped for the inside of a JSON string: quotes, backslashes, control characters and
// bytes past ASCII as \uXXXX (so invalid UTF-8 from a client still makes valid JSON).
std::string JsonEscape(absl::string_view s);

// `s` cut to `max_bytes` (saying how long it was): for client-controlled values.
std::string LogClipped(absl::string_view s, size_t max_bytes);

// The line's text after the time and level: "message key=value key=\"a b\"" or, for JSON,
// the members "\"msg\":\"message\",\"key\":\"value\"" (InitLogging's pattern wraps them).
std::string FormatLogBody(LogFormat format, absl::string_view message, const LogFields& fields);

// At most `per_second` admissions per key in each one-second window; what a full window
// refuses is counted and reported by the next admission of that key. The table holds at most
// `max_keys` keys besides the overflow keys: a key that finds it full (after the windows that
// are over and owe no report are let go) is counted under its `overflow` key instead, so
// memory stays bounded however many keys (callers) come.
class LogRateLimiter {
 public:
  static constexpr size_t kDefaultMaxKeys = 1024;
  explicit LogRateLimiter(int per_second, size_t max_keys = kDefaultMaxKeys)
      : per_second_(per_second), max_keys_(max_keys) {}
  // -1: refused (counted). Else admitted, and the number refused since the last admission.
  // `overflow`: the key to count under when the table is full (the same key if empty).
  int64_t Admit(const std::string& key, absl::Time now, const std::string& overflow = "");
  // The keys with refusals not yet reported, and their counts (sorted by key); zeroes them.
  std::vector<std::pair<std::string, int64_t>> TakeRefused();
  size_t keys();  // for tests: the table's size, overflow keys included

 private:
  struct Window {
    absl::Time start;
    int admitted = 0;
    int64_t refused = 0;
  };
  // Drops the windows that are over and owe no report (a fresh window is the same); at most
  // once a second, so that a full table of live windows costs each new key no scan.
  void SweepLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int per_second_;
  const size_t max_keys_;
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, Window> windows_ ABSL_GUARDED_BY(mu_);  // <= max_keys_
  // By overflow key: as many as the caller has (LogCall: one per method and code).
  absl::flat_hash_map<std::string, Window> overflow_ ABSL_GUARDED_BY(mu_);
  absl::Time last_sweep_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
};

// One finished RPC, as its client saw it.
struct CallRecord {
  absl::string_view method;
  absl::string_view request_id;  // service/request_id.h ("" in tests: no field)
  absl::string_view peer;    // ctx->peer()
  absl::string_view caller;  // who the refusal limit counts (RecordCall: principal, else host)
  absl::string_view code;  // "INVALID_ARGUMENT" (GrpcCodeName)
  absl::string_view message;
  absl::Duration latency;
  uint64_t bytes_in = 0;  // tensor bytes received and sent
  uint64_t bytes_out = 0;
};

// WARNING for a call that did not end OK (rate-limited per method, code and caller, so that
// one client's flood cannot hide another's refusal), and the access line when enabled.
void LogCall(const CallRecord& call);

// One WARNING per method, code and caller whose refused calls no later line reported
// ("suppressed" with the count): at stop, so that a burst at the end is not lost.
void LogSuppressedCalls();

}  // namespace lossd

#endif  // LOSSD_SERVICE_LOG_H_
