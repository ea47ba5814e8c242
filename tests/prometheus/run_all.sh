#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Runs the Python client tests, the packaging check (client/python/pkgtest: sdist -> wheel ->
# fresh venv -> calls against lossd), the live Prometheus test, the promtool unit tests of the
# alert and recording rules, the deploy/ manifest checks, the layer and docs checks, the
# bench/plots parser test and Liger-Kernel's fused linear cross-entropy, GRPO and JSD tests
# (tools/liger_check), each writing a JUnit report into REPORT_DIR (default: a temporary
# folder), and prints PASS/FAIL per suite. Usage: tests/prometheus/run_all.sh [REPORT_DIR]
# Env: LOSSD_BIN (the lossd binary; default $(bazel info bazel-bin)/service/lossd),
#      LOSSD_SKIP_PIP=1 to skip installing the Python packages below,
#      LOSSD_TEST_TORCH=1 to pip install torch too (large: about 3 GB with its CUDA wheels;
#      CI sets it), and with it transformers and accelerate at the pins of the client's
#      "integrations" extra; best effort: where they cannot be installed their tests are skipped.
# Needs: apt packages prometheus (promtool too) and kubectl (kustomize), python3 + pip.
# torch is optional: its tests are skipped where it is not installed.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
REPORTS=${1:-$(mktemp -d)}
mkdir -p "$REPORTS"
export LOSSD_BIN=${LOSSD_BIN:-$(cd "$ROOT" && bazel info bazel-bin 2>/dev/null)/service/lossd}

PY_PACKAGES=(numpy grpcio grpcio-tools grpcio-health-checking protobuf pytest pyyaml
             yamllint kubernetes-validate matplotlib build)
missing_of() {  # package names -> the ones not installed
  python3 - "$@" <<'PY'
import importlib.metadata as md
import sys
missing = []
for name in sys.argv[1:]:
    try:
        md.version(name)
    except md.PackageNotFoundError:
        missing.append(name)
print(" ".join(missing))
PY
}
if [[ "${LOSSD_SKIP_PIP:-0}" != "1" ]]; then
  missing=$(missing_of "${PY_PACKAGES[@]}") || exit 1
  if [[ -n "$missing" ]]; then
    echo "run_all: pip install $missing"
    python3 -m pip install -q $missing || exit 1
  fi
  # torch only serves the autograd tests, which skip without it: a failed download must not
  # fail the rest.
  if [[ "${LOSSD_TEST_TORCH:-0}" == "1" && -n "$(missing_of torch)" ]]; then
    echo "run_all: pip install torch"
    python3 -m pip install -q torch ||
      echo "run_all: torch could not be installed; the torch tests will be skipped"
  fi
  # transformers (pinned to the range lossd.integrations is tested against: the
  # "integrations" extra of client/python/pyproject.toml) and accelerate (Trainer needs it):
  # test_integrations_transformers.py, and Liger-Kernel's own tests (their helpers import
  # transformers). pip leaves a version inside the range alone; about 25 s when missing.
  if [[ "${LOSSD_TEST_TORCH:-0}" == "1" && -z "$(missing_of torch)" ]]; then
    python3 -m pip install -q "transformers>=4.57,<5.26" "accelerate>=1.1" ||
      echo "run_all: transformers could not be installed; its tests will be skipped"
    # TRL at the client's "trl" extra (test_integrations_trl.py; it brings datasets): about
    # 30 s when missing.
    python3 -m pip install -q "trl>=1.16,<1.17" ||
      echo "run_all: trl could not be installed; its tests will be skipped"
    # verl without its dependencies (ray, vllm, ...): test_integrations_verl.py loads only
    # its torch fused-kernel modules from the package's files; about 5 s.
    python3 -m pip install -q --no-deps "verl>=0.9.1,<0.10" ||
      echo "run_all: verl could not be installed; its tests will be skipped"
    # torchtitan without its dependencies (wandb, tensorboard, torchdata, ...), plus what its
    # Llama 3 and loss import (test_integrations_torchtitan.py); about 8 s.
    { python3 -m pip install -q --no-deps "torchtitan>=0.3,<0.4" "spmd_types==0.2.3" &&
      python3 -m pip install -q einops tyro; } ||
      echo "run_all: torchtitan could not be installed; its tests will be skipped"
    # DeepSpeed (test_integrations_deepspeed.py: ZeRO-3 on CPU over gloo), its ops left to
    # compile on use (none is used there); about 20 s when missing.
    DS_BUILD_OPS=0 python3 -m pip install -q "deepspeed>=0.19,<0.20" ||
      echo "run_all: deepspeed could not be installed; its ZeRO-3 tests will be skipped"
  fi
fi

status=0
suite() {  # name command...
  local name=$1
  shift
  if "$@"; then
    echo "PASS suite $name"
  else
    local rc=$?
    echo "FAIL suite $name (exit $rc)"
    status=1
  fi
}

suite "python client" python3 -m pytest -q -p no:cacheprovider client/python/tests \
  --junitxml="$REPORTS/python_client.xml"
suite "python packaging (sdist -> wheel -> fresh venv)" python3 -m pytest -q -p no:cacheprovider \
  client/python/pkgtest/test_package.py --junitxml="$REPORTS/python_package.xml"
suite "prometheus end-to-end" python3 -m pytest -q -p no:cacheprovider \
  tests/prometheus/test_prometheus.py --junitxml="$REPORTS/prometheus_e2e.xml"
suite "prometheus rules (promtool unit tests)" python3 -m pytest -q -p no:cacheprovider \
  tests/prometheus/test_rules.py --junitxml="$REPORTS/prometheus_rules.xml"
suite "deploy manifests" env JUNIT_XML="$REPORTS/deploy_manifests.xml" \
  tests/prometheus/check_manifests.sh
suite "layers (every include points down)" python3 -m pytest -q -p no:cacheprovider \
  tools/layers/test_check_layers.py --junitxml="$REPORTS/layers.xml"
suite "docs (links, flags, metrics, alerts, targets, names)" python3 -m pytest -q \
  -p no:cacheprovider tools/docs/test_check_docs.py --junitxml="$REPORTS/docs.xml"
suite "bench plots parser" python3 -m pytest -q -p no:cacheprovider \
  bench/plots/test_plot_results.py --junitxml="$REPORTS/bench_plots.xml"
# Liger-Kernel's fused linear cross-entropy tests, unmodified, through the torch module (about
# 2 min on 2 cores); a skipped case where torch, transformers or Liger's sdist is missing.
suite "liger fused linear cross-entropy" tools/liger_check/run.sh "$REPORTS/liger_flce.xml"
# Liger-Kernel's GRPO and JSD loss tests, unmodified, through lossd.rl (880 of their 1676
# cases, the large test_correctness shape left out: about 2 min on 2 cores); skipped as above.
suite "liger GRPO and JSD losses" tools/liger_check/run_rl.sh "$REPORTS/liger_rl.xml"
exit $status
