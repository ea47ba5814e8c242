#!/usr/bin/env python3
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
import subprocess
import sys

# The docs a newcomer or an operator reads, whose facts are checked beyond their links.
DOCS = [
    "README.md", "docs/operating.md", "docs/rl_clients.md", "docs/rl_losses.md",
    "docs/replica_pool.md", "docs/hosted_head.md", "docs/scale_out.md",
    "docs/loss_kinds_requests.md", "deploy/README.md", "proto/README.md", "tests/README.md",
    "kernels/cuda/README.md", "kernels/cpu/README.md", "client/python/README.md",
    "bench/service/README.md",
]

# Flags of programs that are not ours (bazel, kubectl, podman, numactl, systemctl, pip, ...).
OTHER_PROGRAMS_FLAGS = {
    "config", "test_tag_filters", "test_output", "test_arg", "compilation_mode", "copt",
    "runs_per_test", "cert", "key", "cgroup-manager", "runtime", "rm", "gpus", "ulimit",
    "cpunodebind", "membind", "preferred", "now", "strict", "help", "helpfull", "version",
    "junitxml", "user", "upgrade", "device", "network", "from-file", "namespace",
}

# Defaults a flag table describes in words instead of a value: (flag, words) -> the code's value.
DESCRIBED_DEFAULTS = {("cuda_plugin", "beside the binary"): ""}

SIZE_UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


def read(root, rel):
    with open(os.path.join(root, rel), encoding="utf-8") as f:
        return f.read()


def tracked_markdown(root):
    try:
        out = subprocess.run(["git", "ls-files", "*.md"], cwd=root, capture_output=True,
                             text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        out = []
    if not out:  # not a git checkout (a test's small tree): every .md file
        for dirpath, _, names in os.walk(root):
            out += [os.path.relpath(os.path.join(dirpath, n), root)
                    for n in names if n.endswith(".md")]
    return sorted(p for p in out if not p.startswith("third_party/"))


def existing_docs(root):
    return [d for d in DOCS if os.path.exists(os.path.join(root, d))]


def strip_fences(text):
    """The text with fenced code blocks blanked (line numbers kept)."""
    out, fenced = [], False
    for line in text.split("\n"):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            out.append("")
        else:
            out.append("" if fenced else line)
    return out


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


# ---------------------------------------------------------------------------------- flags

ABSL_FLAG = re.compile(r"ABSL_FLAG\(\s*([\w:<>]+)\s*,\s*(\w+)\s*,\s*(.*?)\s*,\s*\"", re.S)


def absl_flags(root, rels):
    """{name: default expression} of the ABSL_FLAGs in these files."""
    flags = {}
    for rel in rels:
        for _, name, default in ABSL_FLAG.findall(read(root, rel)):
            flags[name] = default.strip()
    return flags


def source_files(root, exts):
    out = []
    for dirpath, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith((".", "bazel-")) and d != "third_party"]
        out += [os.path.relpath(os.path.join(dirpath, n), root)
                for n in names if n.endswith(exts)]
    return out


def server_flags(root):
    flags = absl_flags(root, ["service/main.cc"])
    flags.update({n: None for n in ABSL_BUILTIN})
    return flags


# Flags Abseil defines in every program.
ABSL_BUILTIN = ("help", "helpfull", "helpshort", "version", "flagfile")


def lossctl_flags(root):
    rels = [f"client/{n}" for n in sorted(os.listdir(os.path.join(root, "client")))
            if n.startswith("lossctl") and n.endswith(".cc") and not n.endswith("_test.cc")]
    return absl_flags(root, rels)


def lossctl_commands(root):
    """(commands, head commands) lossctl dispatches."""
    main = read(root, "client/lossctl.cc")
    heads = read(root, "client/lossctl_heads.cc")
    return (set(re.findall(r'\{"([a-z-]+)",\s*&Run', main)) | {"head"},
            set(re.findall(r'\{"([a-z-]+)",\s*&Run', heads)))


def defined_anywhere(root):
    """Every option name some program of ours defines, and the text of our shell scripts."""
    names = set(absl_flags(root, source_files(root, (".cc", ".h"))))
    scripts = ""
    for rel in source_files(root, (".py",)):
        names |= set(re.findall(r"add_argument\(\s*['\"]--([\w-]+)", read(root, rel)))
    for rel in source_files(root, (".sh",)):
        scripts += read(root, rel)
    return names, scripts


def value_of_cpp(expr):
    expr = expr.strip()
    m = re.fullmatch(r'"(.*)"', expr)
    if m:
        return m.group(1)
    if expr in ("true", "false"):
        return expr
    m = re.fullmatch(r"absl::(Minutes|Seconds|Milliseconds)\((\d+)\)", expr)
    if m:
        return int(m.group(2)) * {"Minutes": 60000, "Seconds": 1000, "Milliseconds": 1}[m.group(1)]
    if expr == "absl::ZeroDuration()":
        return 0
    arith = re.sub(r"(?<=\d)(ull|ul|u|ll|l)\b", "", expr)
    if re.fullmatch(r"[\d\s<>*+().-]+", arith):
        return eval(arith)  # noqa: S307: digits and operators only
    return None


def value_of_doc(words, flag, code_value):
    """The value a flag table's default cell states, comparable with value_of_cpp's."""
    words = words.strip().strip("`")
    if (flag, words) in DESCRIBED_DEFAULTS:
        return DESCRIBED_DEFAULTS[(flag, words)]
    words = re.sub(r"\s*\(.*\)\s*$", "", words).strip()  # "0 (off)", "600000 (10 min)"
    if words in ('""', "none"):
        return ""
    m = re.fullmatch(r"([\d.]+)\s*(KiB|MiB|GiB|TiB)", words)
    if m:
        return int(float(m.group(1)) * SIZE_UNITS[m.group(2)])
    m = re.fullmatch(r"2\^(\d+)", words)
    if m:
        return 1 << int(m.group(1))
    m = re.fullmatch(r"(\d+)(ms|s|m|h)", words)
    if m and isinstance(code_value, int) and flag_is_duration(code_value, words):
        return int(m.group(1)) * {"ms": 1, "s": 1000, "m": 60000, "h": 3600000}[m.group(2)]
    if re.fullmatch(r"-?\d+", words):
        return int(words)
    if re.fullmatch(r"-?\d+\.\d*", words):
        return float(words)
    return words


def flag_is_duration(_, words):
    return bool(re.fullmatch(r"\d+(ms|s|m|h)", words))


def tables(lines):
    """(line number, heading path, header cells, rows of (line number, cells)) per table."""
    out, headings, i = [], [], 0
    while i < len(lines):
        line = lines[i]
        m = re.match(r"^(#{1,6})\s+(.*)", line)
        if m:
            depth = len(m.group(1))
            headings = headings[:depth - 1] + [m.group(2).strip()]
        if line.startswith("|") and i + 1 < len(lines) and re.match(r"^\|[\s:|-]+\|\s*$",
                                                                      lines[i + 1]):
            header = cells(line)
            rows, j = [], i + 2
            while j < len(lines) and lines[j].startswith("|"):
                rows.append((j + 1, cells(lines[j])))
                j += 1
            out.append((i + 1, list(headings), header, rows))
            i = j
            continue
        i += 1
    return out


def cells(line):
    parts = re.split(r"(?<!\\)\|", line.strip())[1:-1]
    return [p.strip().replace("\\|", "|") for p in parts]


def check_flag_tables(root, files):
    problems = []
    server, ctl = server_flags(root), lossctl_flags(root)
    for rel in files:
        lines = strip_fences(read(root, rel))
        for _, headings, header, rows in tables(lines):
            if "flag" not in header:
                continue
            col = header.index("flag")
            ctl_table = any("lossctl" in h for h in headings)
            program, defined = ("lossctl", ctl) if ctl_table else ("lossd", server)
            with_default = col + 1 < len(header) and header[col + 1] == "default"
            for no, row in rows:
                names = re.findall(r"`--(\w+)`", row[col])
                for name in names:
                    if name not in defined:
                        problems.append(f"{rel}:{no}: --{name} is not a flag of {program}")
                if not with_default or not names or any(n not in defined for n in names):
                    continue
                stated = [s.strip() for s in re.split(r",\s+(?![^()]*\))", row[col + 1])]
                if len(stated) == 1:  # one default said of them all ("none")
                    stated *= len(names)
                if len(stated) != len(names):
                    problems.append(f"{rel}:{no}: {len(names)} flags but {len(stated)} "
                                    f"defaults: {row[col + 1]}")
                    continue
                for name, words in zip(names, stated):
                    code = value_of_cpp(defined[name])
                    if code is None:
                        continue
                    said = value_of_doc(words, name, code)
                    if said != code and str(said) != str(code):
                        problems.append(f"{rel}:{no}: --{name} default is {defined[name]} in "
                                        f"the code, the docs say {words}")
    return problems


def check_flags_documented(root):
    """Every flag of lossd is in docs/operating.md."""
    text = read(root, "docs/operating.md")
    return [f"docs/operating.md: lossd --{name} (service/main.cc) is not documented"
            for name in sorted(absl_flags(root, ["service/main.cc"]))
            if not re.search(r"--" + name + r"\b", text)]


def code_spans(text):
    """Inline code spans and the lines of fenced blocks, with their line numbers."""
    out, fenced = [], False
    for no, line in enumerate(text.split("\n"), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            out.append((no, line))
        else:
            out += [(no, s) for s in re.findall(r"`([^`]+)`", line)]
    return out


def check_flag_names(root, files):
    problems = []
    anywhere, scripts = defined_anywhere(root)
    server, ctl = server_flags(root), lossctl_flags(root)
    commands, head_commands = lossctl_commands(root)
    for rel in files:
        text = read(root, rel)
        for no, line in enumerate(text.split("\n"), 1):
            for name in re.findall(r"(?<![\w-])--([a-z][\w-]*)", line):
                if (name not in anywhere and name not in OTHER_PROGRAMS_FLAGS
                        and f"--{name}" not in scripts):
                    problems.append(f"{rel}:{no}: --{name} is defined by no program here")
        for no, span in code_spans(text):
            for m in re.finditer(r"(?:^|[\s/$)])lossd((?:\s+--[\w]+(?:=\S*)?)+)", span):
                for name in re.findall(r"--(\w+)", m.group(1)):
                    if name not in server:
                        problems.append(f"{rel}:{no}: lossd --{name}: no such lossd flag")
            m = re.match(r"^\s*(?:\S*/)?(?:lossctl|\$LOSSCTL|\$\{LOSSCTL\})(?=\s|$)(.*)", span)
            if not m:
                continue
            rest = m.group(1)
            words = re.findall(r"(?<![\w-])([a-z][a-z-]*)(?=\s|$|\|)", rest.split("--")[0])
            if words and words[0] in ("head",) and len(words) > 1:
                if words[1] not in head_commands:
                    problems.append(f"{rel}:{no}: lossctl head {words[1]}: no such command")
            elif words and words[0] not in commands and words[0] not in ("info",):
                problems.append(f"{rel}:{no}: lossctl {words[0]}: no such command")
            for name in re.findall(r"(?<![\w-])--(\w+)", rest):
                if name not in ctl and name not in ABSL_BUILTIN:
                    problems.append(f"{rel}:{no}: lossctl --{name}: no such lossctl flag")
    return problems


# -------------------------------------------------------------------------------- metrics

def registered_metrics(root):
    """{name: set of label names} lossd registers (service/*.cc)."""
    metrics = {}
    for rel in sorted(os.listdir(os.path.join(root, "service"))):
        if not rel.endswith(".cc") or rel.endswith("_test.cc"):
            continue
        text = read(root, "service/" + rel)
        for m in re.finditer(r'(?:\(\s*\*?\w*\s*,?\s*|gauge\(|counter\(|Add\(&out,\s*|'
                             r'Name\()\s*"((?:lossd|process)_\w+)"', text):
            name = m.group(1)
            end = re.compile(r";\s*\n").search(text, m.end())
            stmt = text[m.end():end.start() if end else len(text)]
            labels = set()
            add = re.search(r"\.Add\(\{(\{.*?\})\}", stmt, re.S)
            if add:
                labels = set(re.findall(r'\{"(\w+)",', add.group(1)))
            else:
                member = re.search(r"(\w+_)\s*=\s*&?\s*\n?\s*(?:&\s*)?prometheus::Build\w+\(\)\s*"
                                   r"\.Name\(\"" + name + "\"", text)
                if member:
                    use = re.search(re.escape(member.group(1)) + r"->Add\(\{(\{.*?\})\}", text, re.S)
                    if use:
                        labels = set(re.findall(r'\{"(\w+)",', use.group(1)))
            metrics[name] = labels
    return metrics


METRIC = re.compile(r"(?<![\w.])((?:lossd|process)_[a-z0-9_]+)(\{[^}]*\})?((?:`?,\s*`_[a-z0-9_]+`?)*)")
NOT_METRICS = re.compile(r"^lossd_(pb2\w*|client\w*|cuda\w*|metrics|bench\w*|help\w*)$")


def check_metrics(root, files):
    problems = []
    known = registered_metrics(root)
    documented = set()

    def exists(name):
        return name in known or re.sub(r"_(bucket|sum|count)$", "", name) in known

    for rel in files:
        for no, line in enumerate(read(root, rel).split("\n"), 1):
            for m in METRIC.finditer(line):
                name, labels, more = m.group(1), m.group(2), m.group(3)
                if NOT_METRICS.match(name) or line[m.end(1):m.end(1) + 1] in ("(", "."):
                    continue
                if not exists(name) and name.startswith("process_"):
                    continue  # a process_ word that is no metric of ours
                if not exists(name):
                    problems.append(f"{rel}:{no}: metric {name} is not registered by lossd")
                    continue
                if rel == "docs/operating.md":
                    documented.add(name)
                if labels:
                    said = {re.split(r"[=!~]", l)[0].strip() for l in labels[1:-1].split(",")}
                    base = re.sub(r"_(bucket|sum|count)$", "", name)
                    extra = {"le"} if name.endswith("_bucket") else set()
                    if not said <= known.get(name, known.get(base, set())) | extra:
                        problems.append(f"{rel}:{no}: {name}{labels}: lossd's labels are "
                                        f"{{{','.join(sorted(known.get(base, set())))}}}")
                # `lossd_a_b_bytes`, `_c_bytes`: a sibling named by its differing end
                for suffix in re.findall(r"`?(_[a-z0-9_]+)", more or ""):
                    parts = name.split("_")
                    siblings = ["_".join(parts[:k]) + suffix for k in range(2, len(parts))]
                    found = [s for s in siblings if s in known]
                    if not found:
                        problems.append(f"{rel}:{no}: metric {name}, {suffix}: no lossd metric "
                                        f"ends so")
                    elif rel == "docs/operating.md":
                        documented.update(found)
    if "docs/operating.md" in files:
        for name in sorted(set(known) - documented):
            problems.append(f"docs/operating.md: metric {name} is registered by lossd but not "
                            f"in the docs")
    return problems


# --------------------------------------------------------------------------------- alerts

def check_alerts(root):
    rules = ""
    rules_dir = os.path.join(root, "deploy/prometheus/rules")
    if not os.path.isdir(rules_dir):
        return []
    for n in sorted(os.listdir(rules_dir)):
        rules += read(root, f"deploy/prometheus/rules/{n}")
    defined = set(re.findall(r"^\s*-\s*alert:\s*(\w+)", rules, re.M))
    listed = set()
    lines = strip_fences(read(root, "deploy/README.md"))
    for _, _, header, rows in tables(lines):
        if header and header[0] == "alert":
            listed |= {row[0].strip("`") for _, row in rows}
    problems = [f"deploy/README.md: alert {a} is in the table but in no rule file"
                for a in sorted(listed - defined)]
    problems += [f"deploy/README.md: alert {a} of deploy/prometheus/rules is not in the table"
                 for a in sorted(defined - listed)]
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
