#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Installs what lossd needs to build and test on Debian 12, idempotently: only missing
# packages are installed, so a second run is quick. Needs root (or sudo) for apt-get.
set -euo pipefail

APT_PACKAGES=(
  bazel-bootstrap pkg-config build-essential
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev prometheus-cpp-dev libgtest-dev libgmock-dev libopenblas-dev libspdlog-dev
  libgloo-dev
  python3 python3-pip python3-venv curl
)
# Extra packages for the full test suite (Prometheus and manifest checks).
if [[ "${LOSSD_SETUP_TEST_EXTRAS:-0}" == "1" ]]; then
  APT_PACKAGES+=(prometheus yamllint clang libclang-rt-14-dev openssl)
fi

missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# kubectl (for its built-in kustomize) comes from Kubernetes' own apt repository where one is
# configured; the manifest checks need it.
if [[ "${LOSSD_SETUP_TEST_EXTRAS:-0}" == "1" ]] && ! command -v kubectl >/dev/null; then
  apt-cache show kubectl >/dev/null 2>&1 && missing+=(kubectl)
fi
if ((${#missing[@]})); then
  SUDO=""
  [[ $(id -u) -ne 0 ]] && SUDO="sudo"
  echo "setup: installing ${missing[*]}"
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
else
  echo "setup: every package is installed"
fi

# The CUDA Toolkit is optional: without /usr/local/cuda (or $CUDA_PATH) the build leaves the
# CUDA backend out and the server runs on the CPU backend.
if [[ -x "${CUDA_PATH:-/usr/local/cuda}/bin/nvcc" ]]; then
  echo "setup: CUDA Toolkit found at ${CUDA_PATH:-/usr/local/cuda}; the CUDA backend is built"
else
  echo "setup: no CUDA Toolkit; CPU-only build"
fi

# CUTLASS's headers, for the sm_90a experiments only (bench/kernel's cutlass_logits_bench,
# tagged manual): LOSSD_SETUP_CUTLASS=1 installs them; CI does not need them.
if [[ "${LOSSD_SETUP_CUTLASS:-0}" == "1" ]]; then
  "$(dirname "$0")/setup_cutlass.sh" ${LOSSD_CUTLASS_WHEEL:+"$LOSSD_CUTLASS_WHEEL"}
fi
