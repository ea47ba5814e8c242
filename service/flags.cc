// SPDX-License-Identifier: Apache-2.0
#include "service/flags.h"

#include <cstdint>
#include <string>

#include "absl/flags/flag.h"
#include "absl/time/time.h"

ABSL_FLAG(std::string, address, "0.0.0.0", "Address the gRPC server listens on.");
ABSL_FLAG(int, port, 50051, "gRPC port (0 picks a free one and prints it).");
ABSL_FLAG(std::string, metrics_address, "0.0.0.0", "Address the /metrics endpoint listens on.");
ABSL_FLAG(int, metrics_port, 9464, "Prometheus /metrics port; 0 disables the endpoint.");
ABSL_FLAG(int, health_port, 0,
          "Plaintext port (on --address) that answers grpc.health.v1 alone, for probes that "
          "cannot speak TLS (Kubernetes' gRPC probes) when --tls_cert is set; 0 = none.");
ABSL_FLAG(std::string, backend, "auto", "auto (CUDA where a GPU is present, else CPU), cpu or cuda.");
ABSL_FLAG(std::string, cuda_plugin, "", "Path of liblossd_cuda.so; empty searches beside the binary.");
ABSL_FLAG(int, cuda_device, 0, "CUDA device index.");
ABSL_FLAG(int, threads, 0, "CPU backend threads; 0 = all cores.");
ABSL_FLAG(int, executor_threads, 1, "Requests computed at once (each backend call is parallel inside).");
ABSL_FLAG(uint64_t, memory_budget_bytes, 8ull << 30,
          "Admission budget: host buffers and backend workspace of requests in flight.");
ABSL_FLAG(uint64_t, device_memory_budget_bytes, 0,
          "CUDA backend: most device bytes it may hold; 0 = no limit of its own.");
ABSL_FLAG(uint64_t, cuda_chunk_budget_bytes, 0,
          "CUDA backend: device bytes per Compute for the logits chunk and the GEMM workspaces "
          "(fewer, larger chunks run closer to the GEMM floor); 0 = 512 MiB, or enough for 2048 "
          "rows of logits where V is wider (at most 2 GiB).");
ABSL_FLAG(bool, cuda_autotune, true,
          "CUDA backend: time cuBLASLt's candidate algorithms on the first Compute of each shape "
          "and keep the fastest; false = its first choice, identical in every process.");
ABSL_FLAG(uint64_t, weight_cache_bytes, 4ull << 30, "Budget of weights held by handle (LRU).");
ABSL_FLAG(uint64_t, accumulator_bytes, 8ull << 30, "Budget of gradient accumulators.");
ABSL_FLAG(uint32_t, max_accumulators, 64, "Most gradient accumulators held at once.");
ABSL_FLAG(uint64_t, head_bytes, 16ull << 30,
          "Budget of hosted heads (fp32 master, optimizer state, compute copy, gradient sum), "
          "in backend memory; a head that does not fit is refused, never evicted.");
ABSL_FLAG(uint32_t, max_heads, 64, "Most hosted heads held at once.");
ABSL_FLAG(absl::Duration, head_step_timeout, absl::Minutes(10),
          "Longest a hosted head's Step barrier waits for its last rank; then every waiting "
          "rank gets DEADLINE_EXCEEDED and the step's gradients are dropped (in line with "
          "torch.distributed's default collective timeout for NCCL).");
ABSL_FLAG(std::string, head_group_address, "",
          "Turns head groups on: the address this server's gloo TCP listener binds (an "
          "ephemeral port) and every other member must reach; empty: groups refused.");
ABSL_FLAG(absl::Duration, head_group_timeout, absl::ZeroDuration(),
          "How long forming a head group (and each of its collectives) waits for every member; "
          "0 = --head_step_timeout.");
ABSL_FLAG(std::string, head_group_token_file, "",
          "Bearer token (first line) this server presents to member 0's group rendezvous.");
ABSL_FLAG(std::string, head_group_tls_ca, "",
          "PEM roots verifying member 0's TLS certificate; empty: plaintext to member 0.");
ABSL_FLAG(std::string, head_group_tls_cert, "",
          "PEM client certificate (chain) this server presents to member 0 where member 0 "
          "asks for one (--tls_client_ca); with --head_group_tls_key and --head_group_tls_ca.");
ABSL_FLAG(std::string, head_group_tls_key, "", "PEM private key of --head_group_tls_cert.");
ABSL_FLAG(uint64_t, ticket_bytes, 4ull << 30,
          "Budget of two-phase log-prob tickets (a forward's X, targets and inline W kept for "
          "its backward); a forward that does not fit is refused (RESOURCE_EXHAUSTED).");
ABSL_FLAG(uint32_t, max_tickets, 256, "Most two-phase log-prob tickets held at once; 0 = none.");
ABSL_FLAG(int64_t, ticket_max_ms, 10 * 60 * 1000,
          "Longest a ticket is kept (a forward's keep_ms is cut to it); then it is freed.");
ABSL_FLAG(std::string, head_export_dir, "",
          "Where every hosted head is exported on drain (SIGTERM/SIGINT, after the calls have "
          "finished), one file each, and imported from at start (each file deleted once "
          "imported), so a rolling restart keeps them; empty = heads end with the process.");
ABSL_FLAG(uint32_t, max_queue, 64, "Most requests waiting for memory; more get UNAVAILABLE.");
ABSL_FLAG(uint32_t, max_in_flight, 256, "Most RPCs at once; more get UNAVAILABLE.");
ABSL_FLAG(uint32_t, max_in_flight_per_client, 64,
          "Most RPCs at once from one client (its bearer token, else its address).");
ABSL_FLAG(uint64_t, max_parts_per_request, 1ull << 20, "Most tensor parts one stream may send.");
ABSL_FLAG(uint32_t, max_weight_handles, 1024, "Most weight handles held (LRU beyond it).");
ABSL_FLAG(int64_t, max_bt, 1 << 20, "Largest BT (rows) of one request.");
ABSL_FLAG(int64_t, max_h, 1 << 16, "Largest hidden size H.");
ABSL_FLAG(int64_t, max_v, 1 << 21, "Largest vocabulary V.");
ABSL_FLAG(uint64_t, max_request_bytes, 16ull << 30, "Most tensor bytes one Compute may move.");
ABSL_FLAG(uint32_t, max_part_bytes, 16u << 20, "Largest tensor part a client may send.");
ABSL_FLAG(uint32_t, response_part_bytes, 4u << 20,
          "Default size of response parts; left out, at most --max_part_bytes.");
ABSL_FLAG(uint64_t, host_buffer_pool_bytes, 2ull << 30,
          "Most bytes of freed request buffers kept for reuse (same shapes again skip the "
          "page faults of fresh memory); 0 turns the pool off.");
ABSL_FLAG(bool, check_finite, true, "Refuse NaN and Inf in X, W and bias (INVALID_ARGUMENT).");
ABSL_FLAG(bool, overlap_start_when_busy, false,
          "Overlapped Computes start before X is all in even while other computes are queued "
          "or running (default: only on an idle executor).");
ABSL_FLAG(absl::Duration, stream_idle_timeout, absl::Seconds(60),
          "A Compute or PutWeights stream on which lossd waits for the client (its header, "
          "its parts, a striped upload's other stripes) and nothing arrives for this long, or "
          "a Compute or FetchGradients whose client takes no response message for this long, "
          "is cancelled, giving back its memory and reservations; 0 turns it off.");
ABSL_FLAG(absl::Duration, overlap_stall, absl::Seconds(10),
          "Overlapped Computes: longest wait for the next rows of X while the compute holds "
          "the device; then DEADLINE_EXCEEDED.");
ABSL_FLAG(std::string, tls_cert, "", "PEM server certificate (chain); with --tls_key enables TLS.");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert.");
ABSL_FLAG(std::string, tls_client_ca, "",
          "PEM CA bundle; when set, clients must present a certificate it signed (mTLS).");
ABSL_FLAG(std::string, auth_tokens_file, "",
          "File of bearer tokens (one per line, # comments); when set every Loss RPC needs "
          "'authorization: Bearer <token>'. Health checks need none.");
ABSL_FLAG(bool, reflection, false,
          "Serve gRPC server reflection (grpc.reflection); with --auth_tokens_file it needs a "
          "token like the Loss service.");
ABSL_FLAG(absl::Duration, state_idle_ttl, absl::ZeroDuration(),
          "Drop weight handles and accumulators no call has named for this long, and log each "
          "(0 = never).");
ABSL_FLAG(absl::Duration, shutdown_grace, absl::Seconds(5),
          "On SIGTERM/SIGINT, how long lossd reports not ready (/readyz 503, gRPC health "
          "NOT_SERVING) while it still accepts and serves calls, so that load balancers drop "
          "it first; then the listener closes (a second signal cuts it short; 0 = none).");
ABSL_FLAG(int, drain_seconds, 30,
          "After --shutdown_grace, how long in-flight calls may finish before they are "
          "cancelled.");
ABSL_FLAG(std::string, log_format, "text",
          "Log lines on stderr: text, or json (one object per line). Each refused or failed "
          "call is a WARNING line (method, peer, code, message), at most 5 a second per "
          "method and code.");
ABSL_FLAG(absl::Duration, tls_failure_log_interval, absl::Seconds(10),
          "TLS handshakes that fail (a plaintext or HTTP client at the TLS port, a client "
          "certificate refused) are logged as one WARNING per interval, with the count of "
          "those not logged.");
ABSL_FLAG(bool, access_log, false,
          "Also log every call: method, peer, code, latency and tensor bytes in and out.");
