#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Fails on any #include that points up or sideways across lossd's layers.

The layers, bottom to top (README.md draws the map):
  core      dtypes, the loss problem, status macros: no gRPC, no protobuf, no CUDA
  proto     lossd/v1/lossd.proto (generated headers are included as "lossd/v1/...")
  wire      the codec shared by the service and the clients (protobuf, gRPC byte buffers)
  kernels   the backend interface and the CPU and CUDA backends, under the engine
  engine    plans, admission, weights, accumulators; over the backend interface, no gRPC
  service   the gRPC reactors and the binary
  client    the C++ client and lossctl: on proto, core and wire only
  testing   helpers shared by tests (testonly): may use every layer
tests/, bench/ and tools/ sit on top and may include anything. A test source (*_test.cc,
fake_*.cc, *_bench.cc) may also include testing/ and the float64 oracle (kernels/cpu/reference.h).

Usage: check_layers.py [ROOT]   prints one line per violation and exits 1 if there is any.
"""
import os
import re
import sys

# What each layer's production code may include, by the first folder of the included path.
ALLOWED = {
    "core": {"core"},
    "wire": {"core", "wire", "lossd"},
    "kernels": {"core", "kernels"},
    "engine": {"core", "kernels", "engine"},
    "service": {"core", "wire", "kernels", "engine", "service", "lossd"},
    "client": {"core", "wire", "client", "lossd"},
    "testing": {"core", "wire", "kernels", "engine", "service", "client", "testing", "lossd"},
}
# Third-party headers a layer must never see, whatever its files are.
FORBIDDEN_EXTERNAL = {
    "core": ("grpc", "grpcpp/", "google/protobuf/", "cuda", "cublas"),
    "kernels": ("grpc", "grpcpp/", "google/protobuf/"),
    "engine": ("grpc", "grpcpp/", "google/protobuf/", "cuda", "cublas"),
}
PROJECT = {"core", "wire", "kernels", "engine", "service", "client", "testing", "tests",
           "bench", "tools", "lossd"}
TEST_EXTRA = {"testing"}
ORACLE = "kernels/cpu/reference.h"
SOURCE = re.compile(r".*\.(h|cc|cu|cuh|inc)$")
INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]')


def is_test_source(name):
    return (name.endswith("_test.cc") or name.startswith("fake_") or name.endswith("_bench.cc")
            or "_test_" in name)


def check_file(root, rel):
    layer = rel.split("/", 1)[0]
    if layer not in ALLOWED:
        return []
    name = os.path.basename(rel)
    allowed = set(ALLOWED[layer])
    test = is_test_source(name)
    if test:
        allowed |= TEST_EXTRA
    problems = []
    with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            m = INCLUDE.match(line)
            if not m:
                continue
            inc = m.group(1)
            first = inc.split("/", 1)[0]
            if first in PROJECT and "/" in inc:
                if first not in allowed and not (test and inc == ORACLE):
                    problems.append(f"{rel}:{lineno}: {layer} includes {inc} ({first} is not "
                                    f"below {layer})")
            elif inc.startswith(FORBIDDEN_EXTERNAL.get(layer, ())):
                problems.append(f"{rel}:{lineno}: {layer} includes {inc} (the {layer} layer "
                                f"never sees it)")
    return problems


def check_tree(root):
    problems = []
    for layer in sorted(ALLOWED):
        top = os.path.join(root, layer)
        for dirpath, dirnames, filenames in os.walk(top):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for fn in sorted(filenames):
                if SOURCE.match(fn):
                    rel = os.path.relpath(os.path.join(dirpath, fn), root)
                    problems += check_file(root, rel)
    return problems


def main(argv):
    root = argv[1] if len(argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "..")
    problems = check_tree(os.path.abspath(root))
    for p in problems:
        print(p)
    print(f"{len(problems)} layer violation(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
