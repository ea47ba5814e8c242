#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Checks the facts the user-facing docs state against the code they describe.

- links: every relative link of a tracked Markdown file names an existing file or folder, and
  its #anchor a heading (or an <a id>) of the file it points to;
- flags: every `--flag` the docs name is defined somewhere (an ABSL_FLAG, an argparse option
  or a shell script's option) or is another program's; a flag table's flags are those of the
  program it documents (lossd, or lossctl under a "lossctl" heading) with the default given;
  `lossd --x` and `lossctl <command> --x` name that program's flags and commands;
- metrics: every `lossd_*` metric named exists (service/metrics.cc, with the labels given),
  and every metric lossd registers is in docs/operating.md's table;
- alerts: deploy/README.md's alert table lists exactly the alerts of deploy/prometheus/rules;
- Bazel targets: every //package:target named has a BUILD rule of that name;
- Python: every lossd.<name> named resolves in client/python/lossd (lossd.v1.<name> in the
  proto);
- names: a file, test, environment variable, C++ type or member named in a code span exists.

Usage: tools/docs/check_docs.py [ROOT]; prints one line per problem, exits 1 if any.
"""
import glob
import importlib
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# The programs' facts are checked in facts.py; absl_flags and registered_metrics are
# re-exported for the tests.
from doc_text import code_spans, read, source_files, strip_fences, tracked_markdown  # noqa: E402
from facts import (absl_flags, check_alerts, check_flag_names,  # noqa: E402,F401
                   check_flag_tables, check_flags_documented, check_metrics,
                   registered_metrics)

# The docs a newcomer or an operator reads, whose facts are checked beyond their links.
DOCS = [
    "README.md", "docs/operating.md", "docs/rl_clients.md", "docs/rl_losses.md",
    "docs/replica_pool.md", "docs/hosted_head.md", "docs/scale_out.md",
    "docs/loss_kinds_requests.md", "deploy/README.md", "proto/README.md", "tests/README.md",
    "kernels/cuda/README.md", "kernels/cpu/README.md", "client/python/README.md",
    "bench/service/README.md",
]

# Flags of programs that are not ours (bazel, kubectl, podman, numactl, systemctl, pip, ...).


def existing_docs(root):
    return [d for d in DOCS if os.path.exists(os.path.join(root, d))]


# ---------------------------------------------------------------------------------- links

def slug(heading):
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())  # a link's text only
    text = text.lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors_of(text):
    found, seen = set(), {}
    for line in strip_fences(text):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
        for a in re.findall(r'<a\s+(?:id|name)="([^"]+)"', line):
            found.add(a)
    return found


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def check_links(root, files):
    problems, anchor_cache = [], {}
    for rel in files:
        lines = strip_fences(read(root, rel))
        for no, line in enumerate(lines, 1):
            line = re.sub(r"`[^`]*`", "", line)
            for target in LINK.findall(line):
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                    continue
                path, _, anchor = target.partition("#")
                if path:
                    full = os.path.normpath(os.path.join(os.path.dirname(rel), path))
                    if full.startswith(".."):
                        problems.append(f"{rel}:{no}: link {target} leaves the repository")
                        continue
                    if not os.path.exists(os.path.join(root, full)):
                        problems.append(f"{rel}:{no}: link {target}: {full} does not exist")
                        continue
                else:
                    full = rel
                if anchor and full.endswith(".md"):
                    if full not in anchor_cache:
                        anchor_cache[full] = anchors_of(read(root, full))
                    if anchor not in anchor_cache[full]:
                        problems.append(f"{rel}:{no}: link {target}: no heading #{anchor} in {full}")
    return problems


# Files the docs name that are not ours: other projects' (Liger-Kernel's test, gRPC's header)
# or what a run writes.
NOT_OUR_FILES = {"test_fused_linear_cross_entropy.py", "proto_utils.h", "service_bench.md"}

# A bare file name of one of these kinds names a file somewhere in the repository.
FILE_EXTS = (".cc", ".h", ".cu", ".py", ".sh", ".bzl", ".proto", ".yml", ".yaml", ".json",
             ".md")
PATHISH = re.compile(r"^\.?[\w-]+(?:/[\w.+-]+)+/?$")


def check_paths(root, files):
    """A path in a code span that starts at a folder of the repository (or of the doc's own
    folder) names something that exists; a bare source file name, a file somewhere here."""
    problems = []
    basenames = {os.path.basename(p) for p in source_files(root, FILE_EXTS)}
    top = {d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d))
           and not d.startswith(("bazel-", "dist"))}
    for rel in files:
        here = os.path.dirname(rel)
        for no, span in code_spans(read(root, rel)):
            for word in re.split(r"[\s=:,;()\[\]'\"]+", span):
                word = word.rstrip(".")
                if (re.fullmatch(r"[\w-]+\.(?:" + "|".join(e[1:] for e in FILE_EXTS) + ")", word)
                        and word not in basenames and word not in NOT_OUR_FILES):
                    problems.append(f"{rel}:{no}: {word}: no file of that name here")
                    continue
                if not PATHISH.match(word) or "//" in word:
                    continue
                first = word.split("/")[0]
                bases = [b for b in ("", here) if os.path.isdir(os.path.join(root, b, first))
                         and (b or first in top)]
                # a file, a folder, or a stem (kernels/cpu/reference: its .h and .cc)
                if bases and not any(os.path.exists(os.path.join(root, b, word))
                                     or glob.glob(os.path.join(root, b, word) + ".*")
                                     for b in bases):
                    problems.append(f"{rel}:{no}: {word} does not exist")
    return problems


# ---------------------------------------------------------------------------- Bazel targets

def check_bazel_targets(root, files):
    problems = []
    for rel in files:
        for no, line in enumerate(read(root, rel).split("\n"), 1):
            for pkg, name in re.findall(r"(?<![\w/])//([a-z][a-z0-9_/]*?)(?::([\w.+-]+)|/\.\.\.)?(?=[\s`),;]|$)",
                                         line):
                if not pkg:
                    continue
                build = os.path.join(root, pkg, "BUILD")
                if not os.path.exists(build) and not os.path.exists(build + ".bazel"):
                    if not (os.path.isdir(os.path.join(root, pkg)) and not name):
                        problems.append(f"{rel}:{no}: //{pkg}: no BUILD file there")
                    continue
                target = name or os.path.basename(pkg)
                if name in ("all", "*") or (not name and line.find(f"//{pkg}/...") >= 0):
                    continue
                text = open(build, encoding="utf-8").read()
                named = re.search(r'name\s*=\s*"' + re.escape(target) + '"', text)
                # [macro(name = name, ...) for name in ["a_test", "b_test"]]
                listed = (re.search(r"for\s+(\w+)\s+in\s+\[[^\]]*\"" + re.escape(target) + '"',
                                    text) is not None)
                if not named and not listed:
                    problems.append(f"{rel}:{no}: //{pkg}:{target}: no such target")
    return problems


def check_test_names(root, files):
    """A test or benchmark named bare (`tickets_test`, `:kinds_bench`) is a Bazel target or a
    script somewhere in the repository."""
    builds = "".join(read(root, b) for b in source_files(root, ("BUILD", "BUILD.bazel")))
    stems = {os.path.splitext(os.path.basename(p))[0] for p in source_files(root, (".py", ".sh"))}
    problems = []
    for rel in files:
        for no, line in enumerate(read(root, rel).split("\n"), 1):
            for name in re.findall(r"`:?([a-z0-9_]+_(?:test|bench))`", line):
                if f'"{name}"' not in builds and name not in stems:
                    problems.append(f"{rel}:{no}: {name}: no Bazel target or script of that name")
    return problems


def check_code_names(root, files):
    """A type, message or alert named alone in a code span (`TwoPhaseLogprob`,
    `PoolOptions::tickets_kept`) is a word of some source file (each part of a C++ name)."""
    words = set()
    for p in source_files(root, (".h", ".cc", ".cu", ".cuh", ".py", ".proto", ".sh", ".yml",
                                 ".yaml")):
        if not p.startswith("tools/docs/"):
            words.update(re.findall(r"\w+", read(root, p)))
    problems = []
    for rel in files:
        for no, line in enumerate(read(root, rel).split("\n"), 1):
            for name in re.findall(r"`([A-Z][A-Za-z0-9]+(?:::[A-Za-z_]\w*)*)`", line):
                missing = [part for part in name.split("::") if part not in words]
                if missing:
                    problems.append(f"{rel}:{no}: {name}: no source names {missing[0]}")
    return problems


def check_env_vars(root, files):
    """An environment variable of ours (LOSSD_*, LOSSCTL_*, FUZZ_*, LIGER_*) that the docs
    name is read somewhere outside the docs."""
    code = "".join(read(root, p) for p in source_files(
        root, (".sh", ".py", ".cc", ".h", ".service", ".env", ".yaml", ".yml", "BUILD", ".bzl",
               "Dockerfile", ".target", ".slice", "run"))
        if not p.startswith("tools/docs/"))  # not this checker's own test cases
    problems = []
    for rel in files:
        for no, line in enumerate(read(root, rel).split("\n"), 1):
            for var in re.findall(r"\b((?:LOSSD|LOSSCTL|FUZZ|LIGER)_[A-Z0-9_]+)\b", line):
                if not re.search(r"\b" + var + r"\b", code):
                    problems.append(f"{rel}:{no}: {var}: no script or program reads it")
    return problems


# --------------------------------------------------------------------------------- Python

def proto_names(root):
    text = read(root, "proto/lossd/v1/lossd.proto")
    return set(re.findall(r"^\s*(?:message|service|enum)\s+(\w+)", text, re.M))


def check_python_api(root, files):
    problems = []
    sys.path.insert(0, os.path.join(root, "client", "python"))
    try:
        lossd = importlib.import_module("lossd")
    except ImportError as e:
        return [f"client/python: cannot import lossd to check the docs' names ({e})"]
    finally:
        sys.path.pop(0)
    protos = proto_names(root)
    for rel in files:
        for no, line in enumerate(read(root, rel).split("\n"), 1):
            for dotted in re.findall(r"(?<![\w/.-])lossd((?:\.[A-Za-z_]\w*)+)", line):
                parts = dotted[1:].split(".")
                if parts[0] in ("slice", "target", "service", "binpb", "log", "proto"):
                    continue  # systemd units, files, the proto's package
                if parts[0] == "v1" and len(parts) > 1 and not parts[1].startswith("lossd_pb2"):
                    if parts[1] not in protos:
                        problems.append(f"{rel}:{no}: lossd.v1.{parts[1]} is not in lossd.proto")
                    continue
                obj, path = lossd, "lossd"
                for part in parts:
                    path += "." + part
                    try:
                        obj = getattr(obj, part)
                    except AttributeError:
                        try:
                            obj = importlib.import_module(path)
                        except ImportError:
                            problems.append(f"{rel}:{no}: {path} does not exist in client/python")
                            break
    return problems


def check(root):
    docs = existing_docs(root)
    problems = check_links(root, tracked_markdown(root))
    problems += check_paths(root, docs)
    problems += check_flag_tables(root, docs)
    problems += check_flag_names(root, docs)
    problems += check_flags_documented(root)
    problems += check_metrics(root, docs)
    problems += check_alerts(root)
    problems += check_bazel_targets(root, docs)
    problems += check_test_names(root, docs)
    problems += check_env_vars(root, docs)
    problems += check_code_names(root, docs)
    problems += check_python_api(root, docs)
    return problems


def main(argv):
    root = argv[1] if len(argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "..")
    problems = check(os.path.abspath(root))
    for p in problems:
        print(p)
    print(f"check_docs: {len(problems)} problem(s)", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
