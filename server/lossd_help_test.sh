#!/usr/bin/env bash
# `lossd --help` lists every flag that server/main.cc defines (Abseil's --help shows only the
# flags of files named after the program, which main.cc is not, unless main tells it so).
set -euo pipefail
LOSSD=$1
MAIN=$2
set +e
out=$("$LOSSD" --help 2>&1)
set -e
flags=$(grep -o 'ABSL_FLAG([^,]*, *[a-z_0-9]*' "$MAIN" | sed 's/.*, *//')
n=0
missing=0
for f in $flags; do
  n=$((n + 1))
  if ! grep -q -- "--$f " <<<"$out"; then
    echo "lossd --help does not list --$f"
    missing=$((missing + 1))
  fi
done
if [ "$n" -lt 20 ]; then
  echo "found only $n flags in $MAIN; the pattern no longer matches its ABSL_FLAG lines"
  exit 1
fi
if [ "$missing" -ne 0 ]; then
  echo "--- lossd --help printed:"
  echo "$out" | head -20
  exit 1
fi
echo "lossd --help lists all $n flags of $MAIN"
