#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# A plugin exports its entry point and nothing else (its version script): no C++ symbol of
# the backend, Abseil or the CUDA runtime can clash with the server's across dlopen.
# Usage: plugin_exports_test.sh PLUGIN.so
set -euo pipefail
so=$1
exports=$(nm -D --defined-only "$so" | awk '{print $3}' | sort)
if [ "$exports" != "LossdPluginGetApi" ]; then
  echo "$so exports more or less than LossdPluginGetApi:"
  echo "$exports"
  exit 1
fi
echo "$so exports LossdPluginGetApi only"
