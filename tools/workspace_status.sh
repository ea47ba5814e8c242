#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Bazel's --workspace_status_command (.bazelrc): the commit a build comes from, for
# `lossd --version`. Stable keys only, so an unchanged tree does not relink. Outside a git
# checkout (a source tarball, an image build's context) it takes $LOSSD_COMMIT where set
# (deploy/Dockerfile's build argument), else says so rather than failing the build.
cd "$(dirname "$0")/.." || exit 0
if commit=$(git rev-parse --short=12 HEAD 2>/dev/null); then
  if [[ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]]; then
    commit="${commit}-dirty"
  fi
elif [[ -n "${LOSSD_COMMIT:-}" ]]; then
  commit="${LOSSD_COMMIT}"
else
  commit="unknown (built outside a git checkout)"
fi
echo "STABLE_LOSSD_COMMIT ${commit}"
