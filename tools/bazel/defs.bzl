# SPDX-License-Identifier: Apache-2.0
"""Shorthands for the rules most of lossd's BUILD files are made of.

lossd_cc_library(name): the library <name>.h + <name>.cc (one cc_library per pair).
lossd_cc_header(name): the header-only library <name>.h.
lossd_cc_test(name): the GoogleTest binary <name>.cc, linked with gtest_main, size small
unless given. Every other attribute passes through to cc_library / cc_test unchanged.
"""

def lossd_cc_library(name, deps = [], **kwargs):
    native.cc_library(
        name = name,
        srcs = [name + ".cc"],
        hdrs = [name + ".h"],
        deps = deps,
        **kwargs
    )

def lossd_cc_header(name, deps = [], **kwargs):
    native.cc_library(
        name = name,
        hdrs = [name + ".h"],
        deps = deps,
        **kwargs
    )

def lossd_cc_test(name, deps = [], size = "small", **kwargs):
    native.cc_test(
        name = name,
        size = size,
        srcs = [name + ".cc"],
        deps = deps + ["@system//:gtest_main"],
        **kwargs
    )

def lossd_gpu_test(name, deps = [], size = "small", **kwargs):
    """lossd_cc_test tagged gpu and exclusive: compiled wherever the CUDA Toolkit is, run only
    on a GPU host (--config=nogpu filters it out), one at a time there (the GPU is shared)."""
    lossd_cc_test(
        name = name,
        size = size,
        tags = [
            "exclusive",
            "gpu",
        ],
        deps = deps,
        **kwargs
    )
