#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Fails on any #include that points up or sideways across lossd's layers, and on test
support kept in a production folder.

The layers, bottom to top (README.md draws the map):
  core      dtypes, the loss problem, status macros: no gRPC, no protobuf, no CUDA
  proto     lossd/v1/lossd.proto (generated headers are included as "lossd/v1/...")
  wire      the codec shared by the service and the clients (protobuf, gRPC byte buffers)
  kernels   the backend interface and the CPU and CUDA backends, under the engine
  engine    plans, admission, weights, accumulators; over the backend interface, no gRPC
  service   the gRPC reactors and the binary
  client    the C++ client and lossctl: on proto, core and wire only
  testing   all test support (testonly), over service: never client code
  testing/client  the client's test support (fakes, fixtures): over client and testing/
tests/, bench/ and tools/ sit on top and may include anything. Production code never includes
testing/: only a test or benchmark source (*_test.cc, *_bench.cc) may, and the float64 oracle
(kernels/cpu/reference.h) beside it; a client test may include testing/client/ too. A
production folder's BUILD declares no testonly target: test support lives in testing/.

Usage: check_layers.py [ROOT]   prints one line per violation and exits 1 if there is any.
"""
import os
import re
import sys

# What each layer's production code may include, by the first folder of the included path
# (testing/client/ counts as a layer of its own).
ALLOWED = {
    "core": {"core"},
    "wire": {"core", "wire", "lossd"},
    "kernels": {"core", "kernels"},
    "engine": {"core", "kernels", "engine"},
    "service": {"core", "wire", "kernels", "engine", "service", "lossd"},
    "client": {"core", "wire", "client", "lossd"},
    "testing": {"core", "wire", "kernels", "engine", "service", "testing", "lossd"},
    "testing/client": {"core", "wire", "client", "testing", "testing/client", "lossd"},
}
# Third-party headers a layer must never see, whatever its files are.
FORBIDDEN_EXTERNAL = {
    "core": ("grpc", "grpcpp/", "google/protobuf/", "cuda", "cublas"),
    "kernels": ("grpc", "grpcpp/", "google/protobuf/"),
    "engine": ("grpc", "grpcpp/", "google/protobuf/", "cuda", "cublas"),
}
PROJECT = {"core", "wire", "kernels", "engine", "service", "client", "testing", "tests",
           "bench", "tools", "lossd"}
# What a test or benchmark source may include beyond its layer's production rule.
TEST_EXTRA = {"testing"}
TEST_EXTRA_OF = {"client": {"testing", "testing/client"}}
ORACLE = "kernels/cpu/reference.h"
SOURCE = re.compile(r".*\.(h|cc|cu|cuh|inc)$")
INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]')
PRODUCTION = ("core", "wire", "kernels", "engine", "service", "client", "proto")


def layer_of(rel):
    """The layer of a path in the tree, or of an included path."""
    if rel.startswith("testing/client/"):
        return "testing/client"
    return rel.split("/", 1)[0]


def is_test_source(name):
    return name.endswith(("_test.cc", "_test.cu", "_bench.cc"))


def check_file(root, rel):
    layer = layer_of(rel)
    if layer not in ALLOWED:
        return []
    name = os.path.basename(rel)
    allowed = set(ALLOWED[layer])
    test = is_test_source(name)
    if test:
        allowed |= TEST_EXTRA_OF.get(layer, TEST_EXTRA)
    problems = []
    with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            m = INCLUDE.match(line)
            if not m:
                continue
            inc = m.group(1)
            first = layer_of(inc)
            if inc.split("/", 1)[0] in PROJECT and "/" in inc:
                if first not in allowed and not (test and inc == ORACLE):
                    problems.append(f"{rel}:{lineno}: {layer} includes {inc} ({first} is not "
                                    f"below {layer})")
            elif inc.startswith(FORBIDDEN_EXTERNAL.get(layer, ())):
                problems.append(f"{rel}:{lineno}: {layer} includes {inc} (the {layer} layer "
                                f"never sees it)")
    return problems


RULE_START = re.compile(r"^\[?(\w+)\(", re.M)


def check_build(root, rel):
    """A testonly target (a helper library, a fake plugin) in a production folder. Each
    testonly = True belongs to the rule call that opens last before it (BUILD files here open
    every rule at the start of a line, alone or as [rule( of a comprehension)."""
    problems = []
    with open(os.path.join(root, rel), encoding="utf-8") as f:
        text = f.read()
    starts = list(RULE_START.finditer(text))
    for flag in re.finditer(r"^\s*testonly\s*=\s*True", text, re.M):
        opened = [m for m in starts if m.start() < flag.start()]
        if not opened:
            continue
        call = opened[-1]
        m = re.compile(r'\bname\s*=\s*"([^"]+)"').search(text, call.end(), flag.start())
        name = m.group(1) if m else "(a comprehension)"
        line = text.count("\n", 0, call.start()) + 1
        problems.append(f"{rel}:{line}: testonly {call.group(1)} {name} in a production folder "
                        f"(test support lives in testing/)")
    return problems


def check_tree(root):
    problems = []
    for top_layer in sorted({layer.split("/", 1)[0] for layer in ALLOWED} | set(PRODUCTION)):
        top = os.path.join(root, top_layer)
        for dirpath, dirnames, filenames in os.walk(top):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for fn in sorted(filenames):
                rel = os.path.relpath(os.path.join(dirpath, fn), root)
                if SOURCE.match(fn):
                    problems += check_file(root, rel)
                elif fn in ("BUILD", "BUILD.bazel") and top_layer in PRODUCTION:
                    problems += check_build(root, rel)
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
