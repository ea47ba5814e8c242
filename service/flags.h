// SPDX-License-Identifier: Apache-2.0
// lossd's command-line flags (docs/operating.md#flags lists each): defined in flags.cc, read by
// main.cc. Apart from main so that the definitions, one line of help each, do not crowd out
// the start-up logic.
#ifndef LOSSD_SERVICE_FLAGS_H_
#define LOSSD_SERVICE_FLAGS_H_

#include <cstdint>
#include <string>

#include "absl/flags/declare.h"
#include "absl/time/time.h"

ABSL_DECLARE_FLAG(std::string, address);
ABSL_DECLARE_FLAG(int, port);
ABSL_DECLARE_FLAG(std::string, metrics_address);
ABSL_DECLARE_FLAG(int, metrics_port);
ABSL_DECLARE_FLAG(int, health_port);
ABSL_DECLARE_FLAG(std::string, backend);
ABSL_DECLARE_FLAG(std::string, cuda_plugin);
ABSL_DECLARE_FLAG(int, cuda_device);
ABSL_DECLARE_FLAG(int, threads);
ABSL_DECLARE_FLAG(int, executor_threads);
ABSL_DECLARE_FLAG(uint64_t, memory_budget_bytes);
ABSL_DECLARE_FLAG(uint64_t, device_memory_budget_bytes);
ABSL_DECLARE_FLAG(uint64_t, cuda_chunk_budget_bytes);
ABSL_DECLARE_FLAG(bool, cuda_autotune);
ABSL_DECLARE_FLAG(uint64_t, weight_cache_bytes);
ABSL_DECLARE_FLAG(uint64_t, accumulator_bytes);
ABSL_DECLARE_FLAG(uint32_t, max_accumulators);
ABSL_DECLARE_FLAG(uint64_t, head_bytes);
ABSL_DECLARE_FLAG(uint32_t, max_heads);
ABSL_DECLARE_FLAG(absl::Duration, head_step_timeout);
ABSL_DECLARE_FLAG(std::string, head_group_address);
ABSL_DECLARE_FLAG(absl::Duration, head_group_timeout);
ABSL_DECLARE_FLAG(std::string, head_group_token_file);
ABSL_DECLARE_FLAG(std::string, head_group_tls_ca);
ABSL_DECLARE_FLAG(std::string, head_group_tls_cert);
ABSL_DECLARE_FLAG(std::string, head_group_tls_key);
ABSL_DECLARE_FLAG(uint64_t, ticket_bytes);
ABSL_DECLARE_FLAG(uint32_t, max_tickets);
ABSL_DECLARE_FLAG(int64_t, ticket_max_ms);
ABSL_DECLARE_FLAG(std::string, head_export_dir);
ABSL_DECLARE_FLAG(uint32_t, max_queue);
ABSL_DECLARE_FLAG(uint32_t, max_in_flight);
ABSL_DECLARE_FLAG(uint32_t, max_in_flight_per_client);
ABSL_DECLARE_FLAG(uint64_t, max_parts_per_request);
ABSL_DECLARE_FLAG(uint32_t, max_weight_handles);
ABSL_DECLARE_FLAG(int64_t, max_bt);
ABSL_DECLARE_FLAG(int64_t, max_h);
ABSL_DECLARE_FLAG(int64_t, max_v);
ABSL_DECLARE_FLAG(uint64_t, max_request_bytes);
ABSL_DECLARE_FLAG(uint32_t, max_part_bytes);
ABSL_DECLARE_FLAG(uint32_t, response_part_bytes);
ABSL_DECLARE_FLAG(uint64_t, host_buffer_pool_bytes);
ABSL_DECLARE_FLAG(bool, check_finite);
ABSL_DECLARE_FLAG(bool, overlap_start_when_busy);
ABSL_DECLARE_FLAG(absl::Duration, stream_idle_timeout);
ABSL_DECLARE_FLAG(absl::Duration, overlap_stall);
ABSL_DECLARE_FLAG(std::string, tls_cert);
ABSL_DECLARE_FLAG(std::string, tls_key);
ABSL_DECLARE_FLAG(std::string, tls_client_ca);
ABSL_DECLARE_FLAG(std::string, auth_tokens_file);
ABSL_DECLARE_FLAG(bool, reflection);
ABSL_DECLARE_FLAG(absl::Duration, state_idle_ttl);
ABSL_DECLARE_FLAG(absl::Duration, shutdown_grace);
ABSL_DECLARE_FLAG(int, drain_seconds);
ABSL_DECLARE_FLAG(std::string, log_format);
ABSL_DECLARE_FLAG(absl::Duration, tls_failure_log_interval);
ABSL_DECLARE_FLAG(bool, access_log);

#endif  // LOSSD_SERVICE_FLAGS_H_
