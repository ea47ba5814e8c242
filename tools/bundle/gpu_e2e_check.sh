#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# End to end on a GPU host, from inside the bundle: lossd on the CUDA backend and lossd on the
# CPU backend, the same lossctl computes sent to both, overlapped and not. Checks that the
# CUDA answers with and without overlap are bit-identical, and that CUDA and CPU agree to the
# tolerance of the gradient dtype (compare_outputs.py). Writes into OUT_DIR (lossd logs, the
# .npy outputs, check.txt) and exits non-zero on any mismatch.
# Usage: ./gpu_e2e_check.sh OUT_DIR
set -uo pipefail
OUTDIR=$(mkdir -p "${1:-.}" && cd "${1:-.}" && pwd)
cd "$(dirname "$0")"
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null; done; wait 2>/dev/null; }
trap cleanup EXIT INT TERM

start() {  # backend -> prints the port
  local log="$OUTDIR/lossd_$1.log"
  ./lossd --backend="$1" --port=0 --address=127.0.0.1 --metrics_port=0 > "$log" 2>&1 &
  PIDS+=($!)
  for _ in $(seq 1 300); do
    l=$(grep -m1 -E "listening on port [0-9]+" "$log" 2>/dev/null) && {
      sed -E 's/.*listening on port ([0-9]+).*/\1/' <<< "$l"; return 0; }
    sleep 0.2
  done
  echo "lossd --backend=$1 did not start" >&2; cat "$log" >&2; return 1
}
CUDA_PORT=$(start cuda) || exit 1
CPU_PORT=$(start cpu) || exit 1

rc=0
# (name, extra lossctl flags): several chunks and row halves, an accumulator-free inline call
# with every gradient, fp32 gradients, and reduction none with softcap and z-loss.
CASES=(
  "bf16_chunks|--dtype=bf16 --chunk_rows=256 --with_bias --want=dx,dw,db,lse"
  "bf16_default|--dtype=bf16 --want=dx,dw,lse,predictions"
  "fp32_grads|--dtype=bf16 --chunk_rows=512 --grad_dtype=fp32 --want=dx,dw"
  "fp16_none|--dtype=fp16 --chunk_rows=300 --reduction=none --softcap=20 --lse_square_scale=1e-3 --want=dx,dw,lse"
  "fp32_bias|--dtype=fp32 --chunk_rows=400 --with_bias --want=dx,dw,db,lse"
)
for c in "${CASES[@]}"; do
  name=${c%%|*}
  flags=${c#*|}
  mkdir -p "$OUTDIR/$name"
  for run in "cuda $CUDA_PORT true" "cuda $CUDA_PORT false" "cpu $CPU_PORT false"; do
    read -r be port ov <<< "$run"
    dir="$OUTDIR/$name/${be}_overlap_$ov"
    # shellcheck disable=SC2086
    ./lossctl compute --target="127.0.0.1:$port" --overlap="$ov" --bt=1537 --h=512 --v=32000 \
      --ignore_fraction=0.1 --seed=7 $flags --out_dir="$dir" > "$dir.txt" 2>&1 || {
        echo "FAIL $name $be overlap=$ov: lossctl failed"; cat "$dir.txt"; rc=1; }
  done
  dtype=$(sed -E 's/.*--dtype=([a-z0-9]+).*/\1/' <<< "$flags")
  python3 compare_outputs.py "$OUTDIR/$name" "$dtype" >> "$OUTDIR/check.txt" 2>&1 || rc=1
done
cat "$OUTDIR/check.txt"
echo "gpu_e2e_check: $([ $rc = 0 ] && echo PASS || echo FAIL)"
exit $rc
