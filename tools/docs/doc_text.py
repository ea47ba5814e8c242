# SPDX-License-Identifier: Apache-2.0
"""Reading the docs and the sources for check_docs.py: files, fenced blocks, code spans,
Markdown tables."""
import os
import re
import subprocess


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


def source_files(root, exts):
    out = []
    for dirpath, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith((".", "bazel-")) and d != "third_party"]
        out += [os.path.relpath(os.path.join(dirpath, n), root)
                for n in names if n.endswith(exts)]
    return out
