#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The Python client tests, the Prometheus end-to-end test and the manifest checks; JUnit
# reports go to the folder given as $1. Needs LOSSD_BIN (tools/test.sh sets it).
exec "$(dirname "$0")/prometheus/run_all.sh" "$@"
