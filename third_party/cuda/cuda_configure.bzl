# SPDX-License-Identifier: Apache-2.0
"""Finds the CUDA Toolkit (default /usr/local/cuda, or $CUDA_PATH) without downloading anything.

Generates @local_cuda with:
  :cuda_headers    the toolkit's include/ for host-side .cc files of the CUDA backend
  :cudart, :cublas link flags against the toolkit's libraries
  defs.bzl         CUDA_AVAILABLE, so BUILD files leave the CUDA backend out where there is
                   no toolkit (a CPU-only build) instead of failing.
"""

def _cuda_configure_impl(ctx):
    root = ctx.os.environ.get("CUDA_PATH", "/usr/local/cuda")
    nvcc = ctx.path(root + "/bin/nvcc")
    available = nvcc.exists and ctx.path(root + "/include/cuda_runtime.h").exists
    build = ['package(default_visibility = ["//visibility:public"])', ""]
    if available:
        ctx.symlink(root + "/include", "include")
        build += [
            "cc_library(",
            '    name = "cuda_headers",',
            '    hdrs = glob(["include/**/*.h", "include/**/*.hpp", "include/**/*.inl", "include/**/*.cuh"]),',
            '    includes = ["include"],',
            ")",
            "",
            "cc_library(",
            '    name = "cudart",',
            '    linkopts = ["-L%s/lib64", "-lcudart_static", "-ldl", "-lrt", "-lpthread"],' % root,
            '    deps = [":cuda_headers"],',
            ")",
            "",
            "cc_library(",
            '    name = "cublas",',
            '    linkopts = ["-L%s/lib64", "-lcublasLt", "-lcublas", "-Wl,-rpath,%s/lib64"],' % (root, root),
            '    deps = [":cudart"],',
            ")",
        ]
    ctx.file("BUILD", "\n".join(build) + "\n")
    ctx.file("defs.bzl", 'CUDA_AVAILABLE = %s\nCUDA_ROOT = "%s"\n' % (available, root))
    ctx.file("WORKSPACE", 'workspace(name = "local_cuda")\n')

cuda_configure = repository_rule(
    implementation = _cuda_configure_impl,
    environ = ["CUDA_PATH"],
    local = True,
)
