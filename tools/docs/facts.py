# SPDX-License-Identifier: Apache-2.0
"""check_docs.py's checks of the programs' facts: lossd's and lossctl's flags, their
defaults and lossctl's commands, lossd's metrics and their labels, the alert table."""
import os
import re

from doc_text import code_spans, read, source_files, strip_fences, tables

OTHER_PROGRAMS_FLAGS = {
    "config", "test_tag_filters", "test_output", "test_arg", "compilation_mode", "copt",
    "runs_per_test", "cert", "key", "cgroup-manager", "runtime", "rm", "gpus", "ulimit",
    "cpunodebind", "membind", "preferred", "now", "strict", "help", "helpfull", "version",
    "junitxml", "user", "upgrade", "device", "network", "from-file", "namespace",
}

# Defaults a flag table describes in words instead of a value: (flag, words) -> the code's value.
DESCRIBED_DEFAULTS = {("cuda_plugin", "beside the binary"): ""}

SIZE_UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}

ABSL_FLAG = re.compile(r"ABSL_FLAG\(\s*([\w:<>]+)\s*,\s*(\w+)\s*,\s*(.*?)\s*,\s*\"", re.S)


def absl_flags(root, rels):
    """{name: default expression} of the ABSL_FLAGs in these files."""
    flags = {}
    for rel in rels:
        for _, name, default in ABSL_FLAG.findall(read(root, rel)):
            flags[name] = default.strip()
    return flags


def server_flags(root):
    flags = absl_flags(root, ["service/flags.cc"])
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
    if m and isinstance(code_value, int):
        return int(m.group(1)) * {"ms": 1, "s": 1000, "m": 60000, "h": 3600000}[m.group(2)]
    if re.fullmatch(r"-?\d+", words):
        return int(words)
    if re.fullmatch(r"-?\d+\.\d*", words):
        return float(words)
    return words


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
    return [f"docs/operating.md: lossd --{name} (service/flags.cc) is not documented"
            for name in sorted(absl_flags(root, ["service/flags.cc"]))
            if not re.search(r"--" + name + r"\b", text)]


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
        for m in re.finditer(r'(?:\(\s*\*?\w*\s*,?\s*|gauge\(|counter\(|Add\w*\(&out,\s*|'
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


# Not after "=" or "-": a Bazel define (`--define=lossd_sm90=1`), a flag value or a flag's own
# name (`--lossd_bin`) is no metric.
METRIC = re.compile(r"(?<![\w.=-])((?:lossd|process)_[a-z0-9_]+)(\{[^}]*\})?((?:`?,\s*`_[a-z0-9_]+`?)*)")
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
