# SPDX-License-Identifier: Apache-2.0
"""A repository of cc_library targets for the system's packages, generated with pkg-config.

Hand-written -l flags break (Abseil's library names are not what one would guess), so every
target takes its link flags from `pkg-config --libs`. Headers are on the default include path.
"""

# target name -> (pkg-config modules, extra linkopts)
_LIBS = {
    "grpc++": (["grpc++"], []),
    "grpc++_reflection": (["grpc++"], ["-Wl,--no-as-needed", "-lgrpc++_reflection", "-Wl,--as-needed"]),
    "protobuf": (["protobuf"], []),
    "absl": ([
        "absl_flags",
        "absl_flags_parse",
        "absl_flags_usage",
        "absl_strings",
        "absl_str_format",
        "absl_status",
        "absl_statusor",
        "absl_synchronization",
        "absl_time",
        "absl_random_random",
    ], []),
    "prometheus": (["prometheus-cpp-pull", "prometheus-cpp-core"], []),
    # The exposer's HTTP server (civetweb has no pkg-config file), for the probes lossd serves
    # beside /metrics (server/metrics.cc).
    "prometheus_http": (["prometheus-cpp-pull", "prometheus-cpp-core"], ["-lcivetweb-cpp", "-lcivetweb"]),
    "gtest": (["gtest", "gmock"], []),
    "gtest_main": (["gtest_main", "gtest", "gmock"], []),
    "openblas": (["openblas"], []),
    # Built against Debian's libfmt: its -D flags (pkg-config --cflags) must reach every user.
    "spdlog": (["spdlog"], []),
    # Debian's libgloo-dev (a head group's collectives on the CPU backend, engine/head_group*)
    # ships no .pc file: no modules, its one library named by hand. libgloo.so carries its own
    # dependencies (ibverbs, hiredis) as DT_NEEDED entries.
    "gloo": ([], ["-lgloo"]),
}

def _system_libs_impl(ctx):
    lines = ['package(default_visibility = ["//visibility:public"])', ""]
    for name, (modules, extra) in _LIBS.items():
        flags, cflags = [], []
        if modules:
            res = ctx.execute(["pkg-config", "--libs"] + modules)
            if res.return_code != 0:
                fail("pkg-config --libs %s failed: %s" % (" ".join(modules), res.stderr))
            flags = res.stdout.strip().split(" ")
            cflags = ctx.execute(["pkg-config", "--cflags"] + modules).stdout.strip().split(" ")
        flags = [f for f in flags if f] + extra
        defines = [f[2:] for f in cflags if f.startswith("-D")]
        lines.append("cc_library(")
        lines.append('    name = "%s",' % name)
        if defines:
            lines.append("    defines = %s," % repr(defines))
        lines.append("    linkopts = %s," % repr(flags + ["-lpthread"]))
        lines.append(")")
        lines.append("")
    ctx.file("BUILD", "\n".join(lines))
    ctx.file("WORKSPACE", 'workspace(name = "%s")\n' % ctx.name)

system_libs = repository_rule(
    implementation = _system_libs_impl,
    local = True,
)
