#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The wheel in fresh virtual environments of Python 3.9 to 3.13, each at the oldest releases
# of grpcio, protobuf and numpy that have wheels for that Python (the declared floors where
# they do) and at the newest: check_package.sh (sdist -> wheel -> venv -> smoke.py against a
# live lossd) per row. Slow (a few minutes, downloads); not run by CI. Prints one line a row.
# Usage: client/python/pkgtest/matrix.sh LOSSD_BINARY
# Env: PYTHONS="3.9 3.13" to run some rows; PYENV_ROOT (default ~/.pyenv) where the
# interpreters are, else pythonX.Y on PATH.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
BIN=$1
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

# Oldest per Python: the declared floors (pyproject.toml) where that Python has wheels of them,
# else the first release that does. grpcio-health-checking is left to pip (each release needs
# its own protobuf floor, and pip picks one that fits).
floor() {
  case $1 in
    3.9|3.10) echo "grpcio==1.48.2 protobuf==3.20.3 numpy==1.22.4" ;;
    3.11) echo "grpcio==1.49.1 protobuf==3.20.3 numpy==1.23.2" ;;
    3.12) echo "grpcio==1.59.0 protobuf==3.20.3 numpy==1.26.0" ;;
    3.13) echo "grpcio==1.66.2 protobuf==3.20.3 numpy==2.1.0" ;;
  esac
}

interpreter() {
  local root=${PYENV_ROOT:-$HOME/.pyenv}
  local p
  p=$(ls -d "$root"/versions/"$1".*/bin/python"$1" 2>/dev/null | sort -V | tail -1)
  echo "${p:-$(command -v python"$1")}"
}

status=0
for v in ${PYTHONS:-3.9 3.10 3.11 3.12 3.13}; do
  py=$(interpreter "$v")
  if [[ -z "$py" ]]; then echo "FAIL python $v: no interpreter"; status=1; continue; fi
  "$py" -c "import build" 2> /dev/null || "$py" -m pip install -q build > /dev/null 2>&1
  for kind in oldest newest; do
    : > "$WORK/c.txt"
    [[ $kind == oldest ]] && tr ' ' '\n' <<< "$(floor "$v")" > "$WORK/c.txt"
    if PYTHON=$py "$HERE/check_package.sh" "$BIN" "$WORK/c.txt" > "$WORK/log" 2>&1; then
      echo "PASS python $v $kind: $(grep '^smoke: python' "$WORK/log" | cut -d' ' -f2-)"
    else
      echo "FAIL python $v $kind (constraints: $(tr '\n' ' ' < "$WORK/c.txt"))"
      sed 's/^/    /' "$WORK/log" | tail -25
      status=1
    fi
  done
done
exit $status
