# SPDX-License-Identifier: Apache-2.0
"""cuda_library: compiles .cu files with nvcc (sm_80, sm_90, PTX for later) into a static library.

There are no CUDA rules for Bazel offline, so each .cu becomes one genrule calling nvcc. The
result must be linkstatic: linked as a shared object, the CUDA runtime's launch stubs are left
undefined (__cudaPopCallConfiguration).
"""

load("@local_cuda//:defs.bzl", "CUDA_ROOT")

_GENCODE = [
    "-gencode=arch=compute_80,code=sm_80",
    "-gencode=arch=compute_90,code=sm_90",
    "-gencode=arch=compute_90,code=compute_90",
]

def cuda_library(name, srcs, hdrs = [], deps = [], copts = [], nvcc_hdrs = [], gencode = None,
                 **kwargs):
    """nvcc_hdrs: headers of other packages the .cu files include (nvcc reads them outside
    Bazel's C++ rules, so they must be inputs of its action); their libraries go in deps.
    gencode: the -gencode flags, default sm_80 + sm_90 + PTX; Hopper-only code (wgmma, TMA)
    passes ["-gencode=arch=compute_90a,code=sm_90a"]."""
    objs = []
    for src in srcs:
        obj = name + "_" + src.replace("/", "_").replace(".cu", ".o")
        cmd = " ".join([
            CUDA_ROOT + "/bin/nvcc",
            "-std=c++17",
            "-O3",
            "-Xcompiler=-fPIC",
            "-I.",
            "-I$(GENDIR)",
        ] + (_GENCODE if gencode == None else gencode) + copts + [
            "-c $(location %s)" % src,
            "-o $@",
        ])
        native.genrule(
            name = obj + "_nvcc",
            tags = kwargs.get("tags", []),
            srcs = [src] + hdrs + nvcc_hdrs,
            outs = [obj],
            cmd = cmd,
            message = "nvcc " + src,
        )
        objs.append(obj)
    native.cc_library(
        name = name,
        srcs = objs,
        hdrs = hdrs,
        deps = deps + ["@local_cuda//:cudart"],
        alwayslink = True,
        linkstatic = True,
        **kwargs
    )
