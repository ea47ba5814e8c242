#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# `lossd --version` is lossd's own (not Abseil's "Debug build" line): the release, the commit
# it was built from, the build mode and what the CUDA plugin says of itself; exit 0, and no
# server started.
set -euo pipefail
LOSSD=$1
out=$(timeout 30 "$LOSSD" --version 2>&1)
fail=0
expect() {  # regex
  if ! grep -qE -- "$1" <<<"$out"; then
    echo "lossd --version lacks /$1/"
    fail=1
  fi
}
expect '^lossd [0-9]+\.[0-9]+\.[0-9]+$'
# A 12-digit hash (maybe -dirty) from a checkout; a sentence outside one.
expect '^commit: ([0-9a-f]{12}(-dirty)?|unknown \(built outside a git checkout\))$'
expect '^build: (opt|fastbuild|dbg) \((NDEBUG: assertions off|assertions on)\)$'
# Built with the toolkit, the plugin travels in the runfiles; without it there is none.
expect '^cuda plugin: (.*liblossd_cuda\.so, ABI version [0-9]+\.[0-9]+|none usable \(.*\))$'
if grep -q "Debug build" <<<"$out"; then
  echo "lossd --version printed Abseil's default text"
  fail=1
fi
# A plugin path that exists but is not a plugin is reported, not fatal.
bogus="${TEST_TMPDIR:-/tmp}/not_a_plugin.so"
echo "not an ELF file" >"$bogus"
out=$(timeout 30 "$LOSSD" --version --cuda_plugin="$bogus" 2>&1)
expect "^cuda plugin: none usable \(dlopen\($bogus\): "
if [ "$fail" -ne 0 ]; then
  echo "--- it printed:"
  echo "$out"
  exit 1
fi
echo "lossd --version prints its release, commit, build mode and plugin"
