#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# `lossd --help` exits 0 and lists every flag that service/flags.cc defines (Abseil's --help
# shows only the flags of files named after the program, which flags.cc is not, unless main
# tells it so).
set -euo pipefail
LOSSD=$1
MAIN=$2
set +e
out=$("$LOSSD" --help 2>&1)
code=$?
set -e
# Help asked for is a success: scripts and package checks run `lossd --help`.
if [ "$code" -ne 0 ]; then
  echo "lossd --help exited $code, wanted 0"
  exit 1
fi
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

# Flags out of range are refused at start, naming the flag, before anything listens.
bad=0
refuse() {  # expected message, flags...
  local want=$1
  shift
  set +e
  local got
  got=$(timeout 30 "$LOSSD" --backend=cpu --metrics_port=0 "$@" 2>&1)
  local code=$?
  set -e
  if [ "$code" -ne 1 ] || ! grep -qF -- "$want" <<<"$got"; then
    echo "lossd $* exited $code, wanted 1 and '$want'; printed:"
    echo "$got" | head -5
    bad=$((bad + 1))
  fi
}
refuse "--port must be in [0, 65535], got 70000" --port=70000
refuse "--port must be in [0, 65535], got -1" --port=-1
refuse "--max_part_bytes must be in [1024, 1073741824], got 0" --max_part_bytes=0
refuse "--max_part_bytes must be in [1024, 1073741824], got 4294967295" --max_part_bytes=4294967295
refuse "--response_part_bytes must be at least 1024, got 0" --response_part_bytes=0
refuse "--response_part_bytes=100000 exceeds --max_part_bytes=65536: set --response_part_bytes to at most 65536" \
  --max_part_bytes=65536 --response_part_bytes=100000
# The weight cache and the accumulators together may not exceed the backend's memory (the
# host's, on the CPU backend): 2^62 bytes each is more than any host has.
refuse "--weight_cache_bytes=4611686018427387904 plus --accumulator_bytes=1073741824" \
  --port=0 --weight_cache_bytes=4611686018427387904 --accumulator_bytes=1073741824
refuse "exceed the cpu backend's host memory of " \
  --port=0 --weight_cache_bytes=4611686018427387904 --accumulator_bytes=4611686018427387904
refuse "--state_idle_ttl must be >= 0 (0 = off); got -1s" --port=0 --state_idle_ttl=-1s
refuse "--health_port must be in [1, 65535] and not --port, got 70000" --port=0 --health_port=70000
refuse "--ticket_max_ms must be positive; got 0" --port=0 --ticket_max_ms=0
refuse "--shutdown_grace must be >= 0; got -1s" --port=0 --shutdown_grace=-1s
# A key that is not the certificate's is named as such (gRPC alone blamed the port).
tmp=${TEST_TMPDIR:-$(mktemp -d)}
openssl req -x509 -newkey rsa:2048 -nodes -keyout "$tmp/cert.key" -out "$tmp/cert.pem" \
  -days 2 -subj /CN=localhost >/dev/null 2>&1
openssl genrsa -out "$tmp/other.key" 2048 >/dev/null 2>&1
refuse "INVALID_ARGUMENT: --tls_key $tmp/other.key is not the private key of the certificate in \
--tls_cert $tmp/cert.pem" --port=0 --tls_cert="$tmp/cert.pem" --tls_key="$tmp/other.key"
# --max_part_bytes alone is enough: the default --response_part_bytes (4 MiB) follows it down.
set +e
got=$(timeout 5 "$LOSSD" --backend=cpu --metrics_port=0 --port=0 --max_part_bytes=65536 \
  --shutdown_grace=0 2>&1)
set -e
if ! grep -q "listening on port" <<<"$got"; then
  echo "lossd --max_part_bytes=65536 did not start; printed:"
  echo "$got" | head -5
  bad=$((bad + 1))
fi
# The default address, 0.0.0.0, in plaintext without tokens: a warning says so; on loopback,
# none.
open_warning="WARNING.* gRPC listens on 0\.0\.0\.0:[0-9]+ \(every address of this host\) in"
open_warning+=" plaintext and without bearer tokens"
if ! grep -qE "$open_warning" <<<"$got"; then
  echo "lossd on 0.0.0.0 without TLS or tokens did not warn; printed:"
  echo "$got" | head -8
  bad=$((bad + 1))
fi
set +e
got=$(timeout 5 "$LOSSD" --backend=cpu --metrics_port=0 --port=0 --address=127.0.0.1 \
  --shutdown_grace=0 2>&1)
set -e
if ! grep -q "listening on port" <<<"$got" || grep -qF "in plaintext and without" <<<"$got"; then
  echo "lossd on 127.0.0.1 did not start, or warned of an open listener; printed:"
  echo "$got" | head -8
  bad=$((bad + 1))
fi
if [ "$bad" -ne 0 ]; then
  exit 1
fi
echo "lossd refuses 13 bad flag settings, naming each, starts with --max_part_bytes alone, and"
echo "warns of a plaintext listener without tokens off loopback only"
