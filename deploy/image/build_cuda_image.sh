#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Builds the CUDA lossd image from deploy/Dockerfile on its default nvidia/cuda bases, with
# podman, only where both bases are present locally or can be pulled; otherwise says which one
# is missing and exits 3 (nothing built), so a machine without a registry skips it plainly.
#   deploy/image/build_cuda_image.sh [IMAGE]       (default localhost/lossd:cuda)
# Env: BUILD_BASE, RUNTIME_BASE (default the Dockerfile's), PODMAN_RUN_FLAGS (as
# build_cpu_image.sh). Not run by CI.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
IMAGE=${1:-localhost/lossd:cuda}
default_of() { sed -n "s/^ARG $1=//p" "$ROOT/deploy/Dockerfile"; }
BUILD_BASE=${BUILD_BASE:-$(default_of BUILD_BASE)}
RUNTIME_BASE=${RUNTIME_BASE:-$(default_of RUNTIME_BASE)}
read -r -a RUN_FLAGS <<< "${PODMAN_RUN_FLAGS:---runtime=runc --ulimit nofile=16384:16384 --ulimit nproc=4096:4096}"
PODMAN=(podman --cgroup-manager=cgroupfs)

for base in "$BUILD_BASE" "$RUNTIME_BASE"; do
  if ! "${PODMAN[@]}" image exists "$base" && ! "${PODMAN[@]}" pull -q "$base" > /dev/null; then
    echo "build_cuda_image: $base is neither present nor pullable; no CUDA image built"
    exit 3
  fi
done
commit=$(git -C "$ROOT" rev-parse --short=12 HEAD 2>/dev/null || echo unknown)
[[ -n "$(git -C "$ROOT" status --porcelain --untracked-files=no 2>/dev/null)" ]] && commit+=-dirty
"${PODMAN[@]}" build "${RUN_FLAGS[@]}" --network=host --build-arg LOSSD_COMMIT="$commit" \
  -f "$ROOT/deploy/Dockerfile" --ignorefile "$ROOT/deploy/Dockerfile.dockerignore" \
  --build-arg BUILD_BASE="$BUILD_BASE" --build-arg RUNTIME_BASE="$RUNTIME_BASE" \
  -t "$IMAGE" "$ROOT"
