// SPDX-License-Identifier: Apache-2.0
// Times the fused linear + cross-entropy (forward + backward, bf16, all tensors on the GPU)
// against the 3-GEMM cuBLAS floor at the same shapes in the same process: median of CUDA-event
// timings after warm-up, on random data. Also reports the chunk workspace (peak extra device
// memory), TFLOP/s = 6 BT H V / t, checks that two runs give bit-identical dX and dW, and
// compares the loss, dX and dW with a float64 reference at the same shape.
//
// The pieces: kernel_flags (the flags), timing (CUDA-event rounds, energy), problem (the
// device buffers), floor (the 3-GEMM floor and the chunked GEMMs), ce_timing (the CE kernels
// alone), fused_run (one shape: every budget and schedule), output_checks (determinism and
// the float64 check), extra_runs (--bt_sweep, --host_io) and report (the tables). Exit codes:
// 0; 1 on a failed call; 2 on a bad flag; 3 when a run was not deterministic; 4 when the
// outputs missed the float64 accuracy bar.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "bench/kernel/extra_runs.h"
#include "bench/kernel/fused_run.h"
#include "bench/kernel/gpu_energy.h"
#include "bench/kernel/kernel_flags.h"
#include "bench/kernel/report.h"
#include "bench/kernel/row.h"
#include "bench/kernel/timing.h"
#include "kernels/cuda/device_tuning.h"
#include "kernels/cuda/fused_loss.h"

namespace lossd {
namespace bench {
namespace {

// BTxHxV, as --shapes and --host_io write a shape. False when it does not parse.
bool ParseShape(absl::string_view s, int64_t* bt, int64_t* h, int64_t* v) {
  std::vector<std::string> parts = absl::StrSplit(s, 'x');
  return parts.size() == 3 && absl::SimpleAtoi(parts[0], bt) && absl::SimpleAtoi(parts[1], h) &&
         absl::SimpleAtoi(parts[2], v);
}

// --budgets_mib in bytes. 0, or 2 for a bad entry (said on stderr).
int ParseBudgets(std::vector<uint64_t>* out) {
  std::vector<uint64_t>& budgets = *out;
  for (absl::string_view b : absl::StrSplit(absl::GetFlag(FLAGS_budgets_mib), ',')) {
    uint64_t n = 0;
    // "4096r": chunks of 4096 rows (the default budget's plan with the rows asked for).
    const bool rows = absl::ConsumeSuffix(&b, "r");
    if (!absl::SimpleAtoi(b, &n) || (rows && (n == 0 || n >= kRowsBudget))) {
      std::fprintf(stderr, "bad --budgets_mib entry '%s'\n", std::string(b).c_str());
      return 2;
    }
    budgets.push_back(rows ? kRowsBudget | n : n << 20);
  }
  return 0;
}

// --schedules, each column-halves schedule followed by its --side_sms targets. 0, or 2.
int ParseSchedules(std::vector<Config>* out) {
  std::vector<Config>& schedules = *out;
  for (absl::string_view b : absl::StrSplit(absl::GetFlag(FLAGS_schedules), ',')) {
    int sc = 0;
    if (!absl::SimpleAtoi(b, &sc) || sc < 0 || sc > 2) {
      std::fprintf(stderr, "bad --schedules entry '%s'\n", std::string(b).c_str());
      return 2;
    }
    schedules.push_back({sc, 0});
    if (sc == 1 && !absl::GetFlag(FLAGS_side_sms).empty()) {
      for (absl::string_view t : absl::StrSplit(absl::GetFlag(FLAGS_side_sms), ',')) {
        int sms = 0;
        if (!absl::SimpleAtoi(t, &sms) || sms < 0) {
          std::fprintf(stderr, "bad --side_sms entry '%s'\n", std::string(t).c_str());
          return 2;
        }
        if (sms > 0) schedules.push_back({1, sms});
      }
    }
  }
  return 0;
}

// Whether --ref_exp was on the command line (main reads argv): absent, the device's default.
bool g_ref_exp_given = false;

// --algo_ranks and --autotune onto the fused op's engine. 0, or 2 for bad ranks.
int SetUpEngine(cuda::FusedLoss& engine) {
  std::vector<std::string> r = absl::StrSplit(absl::GetFlag(FLAGS_algo_ranks), ',');
  int ranks[3];
  if (r.size() != 3 || !absl::SimpleAtoi(r[0], &ranks[0]) ||
      !absl::SimpleAtoi(r[1], &ranks[1]) || !absl::SimpleAtoi(r[2], &ranks[2])) {
    std::fprintf(stderr, "bad --algo_ranks\n");
    return 2;
  }
  for (int i = 0; i < 3; ++i) {
    engine.set_algo_rank(static_cast<cuda::GemmRole>(i), ranks[i]);
  }
  engine.set_autotune(absl::GetFlag(FLAGS_autotune));
  // The device's default path and chunk rows, as the backend takes them, unless --ref_exp says.
  cudaDeviceProp prop;
  BENCH_CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  const cuda::RefExpChoice choice = !g_ref_exp_given           ? cuda::RefExpChoice::kPerDevice
                                    : absl::GetFlag(FLAGS_ref_exp) ? cuda::RefExpChoice::kOn
                                                                   : cuda::RefExpChoice::kOff;
  const cuda::DeviceTuning tuning = cuda::TuneForDevice(prop.name, prop.major, prop.minor, choice);
  std::fprintf(stderr, "device defaults: %s\n", tuning.reason.c_str());
  engine.set_ref_exp(tuning.ref_exp);
  SetDefaultChunkRows(tuning.default_chunk_rows);
  engine.set_ref_exp_sample(absl::GetFlag(FLAGS_ref_exp_sample));
  return 0;
}

// --host_io, when given. 0; 2 for a bad shape; 1 on a failure.
int MaybeRunHostIo() {
  if (absl::GetFlag(FLAGS_host_io).empty()) return 0;
  int64_t bt, h, v;
  if (!ParseShape(absl::GetFlag(FLAGS_host_io), &bt, &h, &v)) {
    std::fprintf(stderr, "bad --host_io shape\n");
    return 2;
  }
  if (RunHostIo(bt, h, v)) return 1;
  return 0;
}

int Main() {
  std::vector<uint64_t> budgets;
  if (int rc = ParseBudgets(&budgets); rc != 0) return rc;
  std::vector<Config> schedules;
  if (int rc = ParseSchedules(&schedules); rc != 0) return rc;
  std::unique_ptr<GpuEnergy> meter;
  if (absl::GetFlag(FLAGS_energy_seconds) > 0) {
    meter = GpuEnergy::Open(0);
    if (meter == nullptr) {
      std::fprintf(stderr, "--energy_seconds: NVML's energy counter is not available here\n");
      return 1;
    }
    g_meter = meter.get();
  }
  auto engine = cuda::FusedLoss::Create(0);
  // A second engine for the floor with cuBLASLt's first choices: its algorithm cache is never
  // tuned (the first engine's is, for the fused op and the tuned floor).
  auto floor_engine = cuda::FusedLoss::Create(0);
  if (!engine.ok() || !floor_engine.ok()) {
    std::fprintf(stderr, "%s\n",
                 (engine.ok() ? floor_engine.status() : engine.status()).ToString().c_str());
    return 1;
  }
  if (int rc = SetUpEngine(**engine); rc != 0) return rc;
  cudaDeviceProp prop;
  BENCH_CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::vector<Row> rows;
  for (absl::string_view s : absl::StrSplit(absl::GetFlag(FLAGS_shapes), ',', absl::SkipEmpty())) {
    int64_t bt, h, v;
    if (!ParseShape(s, &bt, &h, &v)) {
      std::fprintf(stderr, "bad shape '%s'\n", std::string(s).c_str());
      return 2;
    }
    Row row;
    if (RunShape(**engine, **floor_engine, bt, h, v, budgets, schedules, &row)) return 1;
    rows.push_back(row);
  }
  if (!absl::GetFlag(FLAGS_bt_sweep).empty()) {
    if (int rc = RunBtSweep(absl::GetFlag(FLAGS_bt_sweep)); rc != 0) return rc;
  }
  if (int rc = MaybeRunHostIo(); rc != 0) return rc;
  PrintTable(prop, rows, (*engine)->ref_exp());
  const bool accurate = PrintAccuracy(rows);
  for (const Row& r : rows) {
    if (!r.deterministic) return 3;
  }
  if (!accurate) return 4;
  return 0;
}

}  // namespace
}  // namespace bench
}  // namespace lossd

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const absl::string_view a = argv[i];
    for (absl::string_view f : {"--ref_exp", "--noref_exp", "-ref_exp", "-noref_exp"}) {
      if (a == f || absl::StartsWith(a, absl::StrCat(f, "="))) lossd::bench::g_ref_exp_given = true;
    }
  }
  absl::ParseCommandLine(argc, argv);
  return lossd::bench::Main();
}
