# SPDX-License-Identifier: Apache-2.0
"""Finds CUTLASS's C++ headers (cute/ and cutlass/) installed by tools/setup_cutlass.sh.

Generates @cutlass with:
  :headers   every header, as inputs of the nvcc genrules that include them
  defs.bzl   CUTLASS_AVAILABLE and CUTLASS_COPTS (nvcc's -I paths: include/ and the
             utilities' tools/util/include/, and the flags CUTLASS's templates need)
Where the headers are absent (CI, a laptop) the repository is a stub with
CUTLASS_AVAILABLE = False, so nothing that loads it fails: the targets over CUTLASS are
tagged manual and are built only when asked for by name.
"""

_DEFAULT_DIR = "/.cache/lossd/nvidia-cutlass-4.2.0.0"

def _cutlass_configure_impl(ctx):
    root = ctx.os.environ.get("LOSSD_CUTLASS_DIR", "")
    if not root:
        root = ctx.os.environ.get("HOME", "/root") + _DEFAULT_DIR
    inc = root + "/cutlass_library/source/include"
    util = root + "/cutlass_library/source/tools/util/include"
    available = (ctx.path(inc + "/cute/tensor.hpp").exists and
                 ctx.path(inc + "/cutlass/cutlass.h").exists)
    build = ['package(default_visibility = ["//visibility:public"])', ""]
    if available:
        ctx.symlink(inc, "include")
        ctx.symlink(util, "util_include")
        build += [
            "filegroup(",
            '    name = "headers",',
            '    srcs = glob(["include/**/*.h", "include/**/*.hpp", "include/**/*.inl",',
            '                  "util_include/**/*.h", "util_include/**/*.hpp"]),',
            ")",
        ]
    ctx.file("BUILD", "\n".join(build) + "\n")
    copts = ["-Iexternal/cutlass/include", "-Iexternal/cutlass/util_include",
             "--expt-relaxed-constexpr", "-DNDEBUG"]
    ctx.file("defs.bzl", "CUTLASS_AVAILABLE = %s\nCUTLASS_COPTS = %s\n" % (available, copts))
    ctx.file("WORKSPACE", 'workspace(name = "cutlass")\n')

cutlass_configure = repository_rule(
    implementation = _cutlass_configure_impl,
    environ = ["LOSSD_CUTLASS_DIR", "HOME"],
    local = True,
)
