// SPDX-License-Identifier: Apache-2.0
#include "service/log.h"

#include <grpc/support/log.h>

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "engine/message_bounds.h"
#include "spdlog/logger.h"
#include "spdlog/pattern_formatter.h"
#include "spdlog/sinks/stdout_sinks.h"

namespace lossd {
namespace {

// A peer is "ipv4:1.2.3.4:5678" or "ipv6:[...]:port"; longer is not an address.
constexpr size_t kMaxPeerBytes = 128;

struct LogState {
  LogFormat format = LogFormat::kText;
  bool access_log = false;
  std::shared_ptr<spdlog::logger> logger;
  std::unique_ptr<LogRateLimiter> limiter;
};

absl::Mutex state_mu;
// Replaced whole by InitLogging; a line in flight keeps the one it started with.
std::shared_ptr<LogState>& State() ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_mu) {
  static auto* state = new std::shared_ptr<LogState>();
  return *state;
}

std::shared_ptr<LogState> CurrentState() {
  absl::MutexLock lock(&state_mu);
  if (State() == nullptr) {
    // Before InitLogging (tests of other libraries, early failures): text on stderr.
    auto s = std::make_shared<LogState>();
    s->logger = std::make_shared<spdlog::logger>(
        "lossd", std::make_shared<spdlog::sinks::stderr_sink_mt>());
    s->logger->set_formatter(std::make_unique<spdlog::pattern_formatter>(
        "%Y-%m-%dT%H:%M:%S.%fZ %v", spdlog::pattern_time_type::utc));
    s->limiter = std::make_unique<LogRateLimiter>(5);
    State() = s;
  }
  return State();
}

const char* LevelName(LogLevel level) {
  switch (level) {
    case LogLevel::kInfo:
      return "INFO";
    case LogLevel::kWarning:
      return "WARNING";
    case LogLevel::kError:
      return "ERROR";
  }
  return "INFO";
}

spdlog::level::level_enum SpdLevel(LogLevel level) {
  switch (level) {
    case LogLevel::kInfo:
      return spdlog::level::info;
    case LogLevel::kWarning:
      return spdlog::level::warn;
    case LogLevel::kError:
      return spdlog::level::err;
  }
  return spdlog::level::info;
}

// Text values go bare when they cannot be mistaken for two fields; else quoted and escaped.
std::string TextValue(absl::string_view v) {
  bool bare = !v.empty();
  for (char c : v) {
    const bool plain = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
                       (c >= '0' && c <= '9') || absl::string_view("._:/@,[]+-").find(c) !=
                                                     absl::string_view::npos;
    if (!plain) bare = false;
  }
  if (bare) return std::string(v);
  return absl::StrCat("\"", JsonEscape(v), "\"");
}

// gRPC's own lines (connection errors, its warnings) in the same stream and format.
void GrpcLogLine(gpr_log_func_args* args) {
  const LogLevel level = args->severity == GPR_LOG_SEVERITY_ERROR ? LogLevel::kError
                                                                  : LogLevel::kInfo;
  Log(level, LogClipped(args->message, kMaxStatusMessageBytes),
      {{"source", "grpc"}, {"file", absl::StrCat(args->file, ":", args->line)}});
}

}  // namespace

LogValue LogValue::Fixed(double x, int decimals) {
  LogValue v(absl::StrFormat("%.*f", decimals, x));
  v.number_ = std::isfinite(x);
  return v;
}

absl::StatusOr<LogFormat> ParseLogFormat(absl::string_view s) {
  if (s == "text") return LogFormat::kText;
  if (s == "json") return LogFormat::kJson;
  return absl::InvalidArgumentError(
      absl::StrCat("--log_format must be text or json, got '", ClippedText(s), "'"));
}

void InitLogging(const LogOptions& options, std::shared_ptr<spdlog::sinks::sink> sink) {
  auto s = std::make_shared<LogState>();
  s->format = options.format;
  s->access_log = options.access_log;
  if (sink == nullptr) sink = std::make_shared<spdlog::sinks::stderr_sink_mt>();
  s->logger = std::make_shared<spdlog::logger>("lossd", std::move(sink));
  // The level is written by FormatLogBody (WARNING, not spdlog's "warning").
  const char* pattern = options.format == LogFormat::kJson
                            ? "{\"time\":\"%Y-%m-%dT%H:%M:%S.%fZ\",%v}"
                            : "%Y-%m-%dT%H:%M:%S.%fZ %v";
  s->logger->set_formatter(
      std::make_unique<spdlog::pattern_formatter>(pattern, spdlog::pattern_time_type::utc));
  s->logger->flush_on(spdlog::level::trace);  // an operator tails it; a crash loses nothing
  s->limiter = std::make_unique<LogRateLimiter>(options.warnings_per_second);
  {
    absl::MutexLock lock(&state_mu);
    State() = std::move(s);
  }
  gpr_set_log_function(GrpcLogLine);
}

std::string JsonEscape(absl::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out.push_back('\\');
      out.push_back(static_cast<char>(c));
    } else if (c == '\n') {
      out += "\\n";
    } else if (c < 0x20 || c >= 0x7f) {
      out += absl::StrFormat("\\u%04x", c);
    } else {
      out.push_back(static_cast<char>(c));
    }
  }
  return out;
}

std::string LogClipped(absl::string_view s, size_t max_bytes) {
  if (s.size() <= max_bytes) return std::string(s);
  return absl::StrCat(s.substr(0, max_bytes), "... (", s.size(), " bytes)");
}

std::string FormatLogBody(LogFormat format, absl::string_view message, const LogFields& fields) {
  // Callers pass the level as the first field "level" (Log does).
  std::string out;
  if (format == LogFormat::kJson) {
    for (const auto& [k, v] : fields) {
      if (v.number()) {
        absl::StrAppend(&out, "\"", k, "\":", v.text(), ",");
      } else {
        absl::StrAppend(&out, "\"", k, "\":\"", JsonEscape(v.text()), "\",");
      }
    }
    absl::StrAppend(&out, "\"msg\":\"", JsonEscape(message), "\"");
    return out;
  }
  size_t first = 0;
  if (!fields.empty() && fields[0].first == "level") {
    absl::StrAppend(&out, fields[0].second.text(), " ");
    first = 1;
  }
  absl::StrAppend(&out, "lossd: ", JsonEscape(message));
  for (size_t i = first; i < fields.size(); ++i) {
    absl::StrAppend(&out, " ", fields[i].first, "=", TextValue(fields[i].second.text()));
  }
  return out;
}

void Log(LogLevel level, absl::string_view message, const LogFields& fields) {
  std::shared_ptr<LogState> s = CurrentState();
  LogFields all;
  all.reserve(fields.size() + 1);
  all.emplace_back("level", LevelName(level));
  all.insert(all.end(), fields.begin(), fields.end());
  s->logger->log(SpdLevel(level), "{}", FormatLogBody(s->format, message, all));
}

int64_t LogRateLimiter::Admit(const std::string& key, absl::Time now,
                              const std::string& overflow) {
  absl::MutexLock lock(&mu_);
  auto it = windows_.find(key);
  if (it == windows_.end() && windows_.size() >= max_keys_) SweepLocked(now);
  Window* w = nullptr;
  if (it != windows_.end()) {
    w = &it->second;
  } else if (windows_.size() < max_keys_) {
    w = &windows_[key];
  } else {
    w = &overflow_[overflow.empty() ? key : overflow];
  }
  if (now - w->start >= absl::Seconds(1)) {
    w->start = now;
    w->admitted = 0;
  }
  if (w->admitted >= per_second_) {
    ++w->refused;
    return -1;
  }
  ++w->admitted;
  const int64_t refused = w->refused;
  w->refused = 0;
  return refused;
}

void LogRateLimiter::SweepLocked(absl::Time now) {
  if (now - last_sweep_ < absl::Seconds(1)) return;
  last_sweep_ = now;
  for (auto it = windows_.begin(); it != windows_.end();) {
    const Window& w = it->second;
    if (w.refused == 0 && now - w.start >= absl::Seconds(1)) {
      windows_.erase(it++);
    } else {
      ++it;
    }
  }
}

std::vector<std::pair<std::string, int64_t>> LogRateLimiter::TakeRefused() {
  std::vector<std::pair<std::string, int64_t>> out;
  absl::MutexLock lock(&mu_);
  for (auto* table : {&windows_, &overflow_}) {
    for (auto& [key, w] : *table) {
      if (w.refused == 0) continue;
      out.emplace_back(key, w.refused);
      w.refused = 0;
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

size_t LogRateLimiter::keys() {
  absl::MutexLock lock(&mu_);
  return windows_.size() + overflow_.size();
}

void LogSuppressedCalls() {
  std::shared_ptr<LogState> s = CurrentState();
  for (const auto& [key, n] : s->limiter->TakeRefused()) {
    // LogCall's keys: "method code caller"; neither method nor code has a space.
    const std::vector<std::string> parts = absl::StrSplit(key, absl::MaxSplits(' ', 2));
    Log(LogLevel::kWarning, "calls failed, lines suppressed",
        {{"method", parts[0]},
         {"code", parts.size() > 1 ? parts[1] : ""},
         {"caller", parts.size() > 2 ? parts[2] : ""},
         {"suppressed", n}});
  }
}

void LogCall(const CallRecord& call) {
  std::shared_ptr<LogState> s = CurrentState();
  const std::string peer = LogClipped(call.peer, kMaxPeerBytes);
  if (call.code != "OK") {
    // One line per (method, code, caller) and window: a client retrying a refused call in a
    // loop must not fill the disk, nor hide another client's refusal, yet the operator
    // learns how many were left out. Callers past the limiter's table share one window per
    // method and code ("*").
    const std::string method_code = absl::StrCat(call.method, " ", call.code, " ");
    const int64_t suppressed = s->limiter->Admit(
        absl::StrCat(method_code, LogClipped(call.caller, kMaxPeerBytes)), absl::Now(),
        absl::StrCat(method_code, "*"));
    if (suppressed >= 0) {
      LogFields f = {{"method", std::string(call.method)},
                     {"peer", peer},
                     {"code", std::string(call.code)},
                     {"message", LogClipped(call.message, kMaxStatusMessageBytes)}};
      if (!call.request_id.empty()) f.emplace_back("request_id", std::string(call.request_id));
      if (suppressed > 0) f.emplace_back("suppressed", suppressed);
      Log(LogLevel::kWarning, "call failed", f);
    }
  }
  if (s->access_log) {
    LogFields f = {{"method", std::string(call.method)},
                   {"peer", peer},
                   {"code", std::string(call.code)},
                   {"latency_ms", LogValue::Fixed(absl::ToDoubleMilliseconds(call.latency), 3)},
                   {"bytes_in", call.bytes_in},
                   {"bytes_out", call.bytes_out}};
    if (!call.request_id.empty()) f.emplace_back("request_id", std::string(call.request_id));
    Log(LogLevel::kInfo, "call", f);
  }
}

}  // namespace lossd
