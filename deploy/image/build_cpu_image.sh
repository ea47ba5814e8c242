#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Builds the CPU-only lossd image from deploy/Dockerfile on a Debian 12 base made here with
# mmdebstrap from Debian's archive (no container registry needed), with podman.
#   deploy/image/build_cpu_image.sh [IMAGE]        (default localhost/lossd:cpu)
# Makes localhost/lossd-base:debian12 first unless it exists (mmdebstrap minbase, about 2 min).
# Env: MIRROR (Debian archive, default deb.debian.org), BAZEL_DISK_CACHE (a host folder
# mounted into the build as Bazel's --disk_cache; default the one ~/.bazelrc names, if any),
# PODMAN_RUN_FLAGS (see below). Needs root and the Debian packages mmdebstrap, podman, runc.
# Not run by CI (.ci/run): it takes minutes and needs the archive.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
IMAGE=${1:-localhost/lossd:cpu}
BASE=localhost/lossd-base:debian12
MIRROR=${MIRROR:-http://deb.debian.org}
# Where a sandbox withholds what podman's defaults assume (this project's development VMs: no
# CAP_SYS_RESOURCE to raise rlimits, hybrid cgroups that crun refuses), these keep the build
# runnable; elsewhere they are harmless. Override with PODMAN_RUN_FLAGS.
read -r -a RUN_FLAGS <<< "${PODMAN_RUN_FLAGS:---runtime=runc --ulimit nofile=16384:16384 --ulimit nproc=4096:4096}"
PODMAN=(podman --cgroup-manager=cgroupfs)

if ! "${PODMAN[@]}" image exists "$BASE"; then
  WORK=$(mktemp -d)
  trap 'rm -rf "$WORK"' EXIT
  # minbase: the Essential set and apt; passwd (groupadd/useradd for the runtime stage's user).
  mmdebstrap --variant=minbase --mode=root --include=passwd bookworm "$WORK/base.tar" \
    "deb $MIRROR/debian bookworm main" "deb $MIRROR/debian bookworm-updates main" \
    "deb $MIRROR/debian-security bookworm-security main"
  "${PODMAN[@]}" import --change 'CMD ["/bin/bash"]' "$WORK/base.tar" "$BASE"
fi

CACHE=${BAZEL_DISK_CACHE:-$(sed -n 's/^build --disk_cache=//p' ~/.bazelrc 2>/dev/null | head -1)}
cache_args=()
if [[ -n "$CACHE" && -d "$CACHE" ]]; then
  cache_args=(-v "$CACHE:/bazel-cache" --build-arg BAZEL_FLAGS=--disk_cache=/bazel-cache)
fi
# The commit for lossd --version: the build context has no .git.
commit=$(git -C "$ROOT" rev-parse --short=12 HEAD 2>/dev/null || echo unknown)
[[ -n "$(git -C "$ROOT" status --porcelain --untracked-files=no 2>/dev/null)" ]] && commit+=-dirty
"${PODMAN[@]}" build "${RUN_FLAGS[@]}" --network=host --build-arg LOSSD_COMMIT="$commit" \
  -f "$ROOT/deploy/Dockerfile" --ignorefile "$ROOT/deploy/Dockerfile.dockerignore" \
  --build-arg BUILD_BASE="$BASE" --build-arg RUNTIME_BASE="$BASE" "${cache_args[@]}" \
  -t "$IMAGE" "$ROOT"
"${PODMAN[@]}" image inspect --format '{{.Id}} {{.Size}} bytes' "$IMAGE"
