#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Builds lossd with Bazel and assembles a portable bundle for a GPU host that lacks the build
# dependencies: dist/lossd-bundle/ (binaries, liblossd_cuda.so, run_gpu.sh, the torch
# baselines, and lib/ with every shared library they need except glibc, libstdc++/libgcc and
# CUDA's own) plus dist/lossd-bundle.tar.gz. Binaries are linked with
# -Wl,-rpath,$ORIGIN/lib -Wl,--disable-new-dtags so lib/ serves indirect dependencies too.
#
# Usage: tools/bundle/make_bundle.sh [--output_base=DIR]   (DIR: Bazel's --output_base)
set -euo pipefail

cd "$(dirname "$0")/../.."
ROOT=$(pwd)
STARTUP=()
for arg in "$@"; do
  case "$arg" in
    --output_base=*) STARTUP+=("$arg") ;;
    *) echo "unknown argument: $arg" >&2; exit 2 ;;
  esac
done
BAZEL=(bazel "${STARTUP[@]}")

# Targets that exist in this checkout (the server and client may not yet).
WANT=(
  //service:lossd
  //client:lossctl
  //kernels/cuda:liblossd_cuda.so
  //bench/kernel:bench_kernel
  //bench/kernel:optimizer_bench
  //bench/kernel:kinds_bench
  # Present only where tools/setup_cutlass.sh has installed CUTLASS's headers (sm_90a; its
  # first build takes about 6 minutes on 2 cores).
  //bench/kernel:cutlass_logits_bench
  //bench/kernel:cutlass_fused_bench
  //kernels/cuda:ce_kernels_test
  //kernels/cuda:nonfinite_test
  //kernels/cuda:cuda_backend_test
  //kernels/cuda:cuda_backend_api_test
  //kernels/cuda:cuda_backend_stream_test
  //kernels/cuda:sticky_error_test
  //kernels/cuda:plugin_exposer_test
  //kernels/cuda:plugin_compute_test
  //kernels/cuda:optimizer_test
  //kernels/cuda:row_loss_test
  //kernels/cuda:row_loss_paths_test
  //kernels/cuda:policy_sequence_test
  //kernels/cuda:ref_exp_test
  //kernels/cuda:nccl_comm_test
  //tests:two_phase_gpu_test
  //tests:head_group_nccl_gpu_test
  //bench/service:net_ceiling
  //bench/service:service_bench
)
TARGETS=()
for t in "${WANT[@]}"; do
  if "${BAZEL[@]}" query "$t" >/dev/null 2>&1; then TARGETS+=("$t"); else echo "skipping $t (absent)"; fi
done
[ ${#TARGETS[@]} -gt 0 ] || { echo "nothing to build" >&2; exit 1; }

# --dynamic_mode=off: in-repo libraries are linked statically, so test binaries do not depend
# on Bazel's _solib folders.
FLAGS=(--dynamic_mode=off "--linkopt=-Wl,-rpath,\$ORIGIN/lib" --linkopt=-Wl,--disable-new-dtags)
# With CUTLASS's headers installed the plugin (and every test and benchmark over FusedLoss)
# carries the reference-exp path's sm_90a GEMM (kernels/cuda/sm90); without them, the bundle
# has the other paths only. LOSSD_SM90=0 leaves it out either way.
if [[ "${LOSSD_SM90:-1}" != 0 ]] && "${BAZEL[@]}" query //kernels/cuda/sm90:ref_exp_gemm >/dev/null 2>&1; then
  FLAGS+=(--define=lossd_sm90=1)
  echo "make_bundle: with the reference-exp path (--define=lossd_sm90=1)"
fi
"${BAZEL[@]}" build "${FLAGS[@]}" "${TARGETS[@]}"
BIN=$("${BAZEL[@]}" info "${FLAGS[@]}" bazel-bin)

OUT="$ROOT/dist/lossd-bundle"
rm -rf "$OUT" "$ROOT/dist/lossd-bundle.tar.gz"
mkdir -p "$OUT/lib"
FILES=()
for t in "${TARGETS[@]}"; do
  rel=${t#//}
  f="$BIN/${rel/://}"
  cp -f "$f" "$OUT/"
  chmod u+w "$OUT/$(basename "$f")"
  strip --strip-debug "$OUT/$(basename "$f")"
  FILES+=("$f")
done
cp -f bench/kernel/torch_baseline.py bench/kernel/kinds_torch_baseline.py \
  bench/kernel/torch_timing.py bench/kernel/run_gpu.sh \
  bench/service/run_service_bench.sh \
  tools/bundle/gpu_e2e_check.sh tools/bundle/compare_outputs.py \
  tests/bare_metal/per_gpu_gpu_test.sh tests/bare_metal/junit.sh deploy/bare-metal/lossd-gpus.sh "$OUT/"

# Libraries every file needs, except the ones the GPU host has (glibc, the C++ runtime, CUDA).
skip() {
  case "$(basename "$1")" in
    linux-vdso*|ld-linux*|libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|libutil.so*) return 0 ;;
    libresolv.so*|libanl.so*|libnsl.so*|libstdc++.so*|libgcc_s.so*) return 0 ;;
    libcuda.so*|libcudart*|libcublas*|libnvidia*|libnvrtc*|libnvJitLink*) return 0 ;;
  esac
  case "$1" in /usr/local/cuda*) return 0 ;; esac
  return 1
}
for f in "${FILES[@]}"; do
  ldd "$f" | awk '/=> \// {print $3}' | while read -r lib; do
    if ! skip "$lib" && [ ! -e "$OUT/lib/$(basename "$lib")" ]; then
      cp -L "$lib" "$OUT/lib/"
      chmod u+w "$OUT/lib/$(basename "$lib")"
      strip --strip-debug "$OUT/lib/$(basename "$lib")" 2>/dev/null || true
    fi
  done
  if ldd "$f" | grep -q "not found"; then
    echo "warning: $f has unresolved libraries here:" >&2
    ldd "$f" | grep "not found" >&2
  fi
done

{
  echo "lossd bundle"
  # "-dirty": built from a tree with uncommitted changes to tracked files (then HEAD alone
  # does not name what was measured).
  echo "commit: $(git describe --always --dirty --abbrev=7 2>/dev/null || echo unknown)"
  echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "targets: ${TARGETS[*]}"
  echo "build flags: ${FLAGS[*]}"
} > "$OUT/BUNDLE_INFO"
tar -C "$ROOT/dist" -czf "$ROOT/dist/lossd-bundle.tar.gz" lossd-bundle
du -sh "$OUT" "$ROOT/dist/lossd-bundle.tar.gz"
