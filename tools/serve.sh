#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Quick start, command 1: installs what is missing, builds lossd and runs it in the
# foreground (CUDA backend where a GPU is present, else CPU). Extra arguments go to lossd,
# e.g. tools/serve.sh --port=50051 --metrics_port=9464 --backend=cpu
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh
bazel build -c opt //service:lossd //client:lossctl
exec "$(bazel info -c opt bazel-bin)/service/lossd" "$@"
