#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""PNG plots of the kernel benchmark numbers recorded in bench/RESULTS.md: time and peak extra
device memory against BT and against V, lossd's fused kernel beside the 3-GEMM floor and the
naive PyTorch baseline, plus one bar chart of every shape.

Reads every markdown table in the file whose first column is a "BT, H, V" shape and whose
header names the quantities (the tables bench_kernel and torch_baseline.py print, the
headline table of bench/RESULTS.md, or the same columns by hand): "fused" (or "lossd") time,
"3-GEMM floor" time, "naive PyTorch" time, "measured extra" / "peak extra (workspace /
measured)" (or "workspace") memory of the fused kernel, "naive peak extra" memory. Units in
cells: us, ms, s; B, KiB, MiB, GiB (KB, MB, GB as decimal). The fused numbers of a shape come
from the first table that has them (RESULTS.md's headline: the backend's defaults), from its
fastest row. The floor's memory is not measured: it is drawn as the BT x V bf16 logits it must
hold. Where no two shapes differ only in V, the V plots take one BT and let H vary (marked on
the axis), and time is drawn relative to the floor.
Never invents numbers: writes no plot when the file holds no such table. A table under a
heading that names another GPU than the file's `GPU:` line (the H100 round in an H200 file) is
left out of these plots.

anchors.png, the picture of the top-level README: the last measured "In-process anchors beside
lossd" section of the file (its heading names the GPU and the date), lossd beside the other
fused ops timed in the same process (Liger-Kernel, QuACK) and naive PyTorch: time against the
PyTorch 3-GEMM floor of the same call (the slower ratio where an op was timed twice), and
device memory beyond the inputs and the op's own outputs (lossd's measured extra from the
section's table; the others' "beyond dX, dW" from the bench/results/anchors_*.md it cites).

Usage: plot_results.py [--results bench/RESULTS.md] [--out bench/plots]
"""

import argparse
import os
import re
import sys
from collections import defaultdict

SHAPE_RE = re.compile(r"^\s*(\d+)\s*[,x×]\s*(\d+)\s*[,x×]\s*(\d+)\s*$")
NUM_RE = re.compile(r"([-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)\s*([a-zA-Zµ]*)")
TIME_UNITS = {"": 1.0, "ms": 1.0, "s": 1e3, "us": 1e-3, "µs": 1e-3}
BYTE_UNITS = {"b": 1, "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40,
              "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12}


def parse_time_ms(cell):
    m = NUM_RE.search(cell)
    if not m or m.group(2).lower() not in TIME_UNITS:
        return None
    return float(m.group(1)) * TIME_UNITS[m.group(2).lower()]


def parse_bytes(cell, default_unit, last=False):
    """"510 MiB" -> bytes. With several numbers ("509 / 510 MiB") the unit written last
    applies to all, and `last` picks the last number instead of the first."""
    found = NUM_RE.findall(cell)
    if not found:
        return None
    units = [u for _, u in found if u]
    unit = (units[-1] if units else default_unit).lower()
    if unit not in BYTE_UNITS:
        return None
    value = found[-1][0] if last else found[0][0]
    return float(value) * BYTE_UNITS[unit]


def header_unit(name):
    m = re.search(r"\((\w+)\)", name)
    return m.group(1) if m else ""


def classify(name):
    """Header text -> the quantity it holds, or None."""
    n = name.lower()
    if ("tflop" in n or "ratio" in n or re.search(r"\bloss\b", n) or "deterministic" in n
            or "speed" in n):
        return None
    is_mem = any(k in n for k in ("peak", "extra", "memory", "workspace"))
    if "/" in n and not is_mem:  # "fused / floor" is a ratio
        return None
    if "naive" in n and ("peak" in n or "mem" in n or "extra" in n):
        return "naive_mem"
    if "naive" in n or "pytorch" in n and "floor" not in n:
        return "naive_ms"
    if "floor" in n:
        return "torch_floor_ms" if "torch" in n else "floor_ms"
    if "measured" in n or "peak extra" in n or n.strip() in ("peak", "peak memory"):
        return "fused_mem"  # "peak extra (workspace / measured)" too: the measured number
    if "workspace" in n:
        return "fused_workspace"
    if "fused" in n or "lossd" in n:
        return "fused_ms"
    return None


def split_row(line):
    cells = line.strip().strip("|").split("|")
    return [c.strip() for c in cells]


GPU_MODEL_RE = re.compile(r"\b[A-Z]{1,3}\d{2,4}\b")


def other_gpu_lines(lines, gpu):
    """The lines with every section whose heading (or a heading above it) names a GPU model
    other than the file's ("one H100 80GB HBM3" in an H200 file) blanked, so that one GPU's
    tables are never drawn with another's."""
    if not gpu:
        return lines
    out, stack = [], []  # stack: (level, names another GPU) of the headings above a line
    for line in lines:
        m = re.match(r"^(#+)\s", line)
        if m:
            level = len(m.group(1))
            stack = [h for h in stack if h[0] < level]
            stack.append((level, any(g not in gpu for g in GPU_MODEL_RE.findall(line))))
        out.append("" if any(other for _, other in stack) else line)
    return out


def parse_results(text):
    """Returns {(bt, h, v): {quantity: value}}; times in ms, memory in bytes. Tables under a
    heading that names another GPU than the file's `GPU:` line are left out."""
    data = defaultdict(dict)
    lines = other_gpu_lines(text.splitlines(), gpu_name(text))
    table_index = 0
    i = 0
    while i < len(lines):
        line = lines[i]
        is_header = (line.strip().startswith("|") and i + 1 < len(lines)
                     and re.match(r"^\s*\|?\s*:?-{3,}", lines[i + 1]))
        if not is_header:
            i += 1
            continue
        header = split_row(line)
        kinds = [classify(h) for h in header]
        units = [header_unit(h) for h in header]
        # "workspace / measured": the measured number is the last in the cell.
        lasts = [bool(re.search(r"/\s*measured", h.lower())) for h in header]
        table_index += 1
        i += 2
        while i < len(lines) and lines[i].strip().startswith("|"):
            cells = split_row(lines[i])
            i += 1
            m = SHAPE_RE.match(cells[0]) if cells else None
            if not m:
                continue
            shape = tuple(int(g) for g in m.groups())
            row = {}
            for cell, kind, unit, last in zip(cells[1:], kinds[1:], units[1:], lasts[1:]):
                if kind is None or not cell:
                    continue
                val = parse_time_ms(cell) if kind.endswith("_ms") else parse_bytes(
                    cell, unit or "MiB", last)
                if val is not None:
                    # Two floors in one row (cuBLASLt's first choice and the tuned one): the
                    # lower is the floor.
                    keep_min = kind in row and not kind.startswith("fused_")
                    row[kind] = min(val, row[kind]) if keep_min else val
            rec = data[shape]
            # The fused numbers of a shape come from the first table that has them (the
            # headline: the backend's defaults), and within it from its fastest row, so time
            # and memory describe one configuration.
            fused = {k: v for k, v in row.items() if k.startswith("fused_")}
            first = rec.setdefault("_fused_table", table_index) == table_index
            if first and "fused_ms" in fused and fused["fused_ms"] < rec.get("fused_ms",
                                                                             float("inf")):
                for k in [k for k in rec if k.startswith("fused_")]:
                    del rec[k]
                rec.update(fused)
            for k, v in row.items():
                if not k.startswith("fused_"):
                    rec[k] = min(v, rec[k]) if k in rec else v
    for (bt, h, v), rec in data.items():
        if "floor_ms" not in rec and "torch_floor_ms" in rec:
            rec["floor_ms"] = rec["torch_floor_ms"]
        if "fused_mem" not in rec and "fused_workspace" in rec:
            rec["fused_mem"] = rec["fused_workspace"]
        rec["floor_mem"] = 2.0 * bt * v  # the bf16 logits the floor materialises
        rec.pop("_fused_table", None)
    return {k: v for k, v in data.items() if "fused_ms" in v or "naive_ms" in v}


def best_series(data, vary):
    """The largest group of shapes that differ only in `vary` ('bt' or 'v'): (fixed, shapes,
    mixed_h). For V, where no two shapes share BT and H, the largest group sharing BT alone,
    with mixed_h True (H varies along the series)."""
    idx = 0 if vary == "bt" else 2

    def largest(keyfn):
        groups = defaultdict(list)
        for s in data:
            groups[keyfn(s)].append(s)
        key, shapes = max(groups.items(), key=lambda kv: (len({s[idx] for s in kv[1]}), kv[0]))
        by_x = {}
        for s in sorted(shapes):
            by_x.setdefault(s[idx], s)  # one shape per x
        return key, [by_x[x] for x in sorted(by_x)]

    if vary == "bt":
        key, shapes = largest(lambda s: (s[1], s[2]))
        return key, shapes, False
    key, shapes = largest(lambda s: (s[0], s[1]))
    if len(shapes) >= 2:
        return key, shapes, False
    key, shapes = largest(lambda s: (s[0],))
    return key, shapes, True


SERIES = [("fused", "lossd (fused)", "tab:blue", "o"),
          ("floor", "3-GEMM floor", "tab:gray", "s"),
          ("naive", "naive PyTorch", "tab:red", "^")]


def gpu_name(text):
    """"GPU: NVIDIA H200 (132 SMs, ...)" -> "NVIDIA H200", or ""."""
    m = re.search(r"GPU:\s*([^,(\n]+)", text)
    return m.group(1).strip() if m else ""


def plot_sweep(plt, data, vary, quantity, path, gpu=""):
    key, shapes, mixed_h = best_series(data, vary)
    if len(shapes) < 2:
        return False
    idx = 0 if vary == "bt" else 2
    # With H varying along the series, absolute times mix two effects: draw them relative to
    # the floor of the same shape instead.
    relative = mixed_h and quantity == "time"
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    drawn = False
    for name, label, color, marker in SERIES:
        k = "%s_%s" % (name, "ms" if quantity == "time" else "mem")
        pts = [(s[idx], data[s][k] / (data[s]["floor_ms"] if relative else 1.0))
               for s in shapes if k in data[s] and (not relative or "floor_ms" in data[s])]
        if not pts:
            continue
        xs, ys = zip(*pts)
        if quantity == "memory":
            ys = [y / 2 ** 30 for y in ys]
            if name == "floor":
                label += " (BT x V bf16 logits)"
        ax.plot(xs, ys, marker=marker, color=color, label=label,
                linestyle="--" if name == "floor" else "-")
        drawn = True
    if not drawn:
        plt.close(fig)
        return False
    if vary == "bt":
        fixed = "H=%d, V=%d" % key
    elif mixed_h:
        fixed = "BT=%d, H as marked" % key
    else:
        fixed = "BT=%d, H=%d" % key
    ax.set_xscale("log", base=2)
    ax.set_xlabel("BT (tokens)" if vary == "bt" else "V (vocabulary)")
    if quantity == "time":
        ax.set_ylabel("time / 3-GEMM floor of the same shape" if relative
                      else "time, fwd + bwd (ms)")
    else:
        ax.set_ylabel("peak extra memory (GiB)")
    ax.set_title("%s vs %s (%s, bf16)%s" % ("Time" if quantity == "time" else "Peak memory",
                                           "BT" if vary == "bt" else "V", fixed,
                                           "\n" + gpu if gpu else ""), fontsize=10)
    ax.set_xticks([s[idx] for s in shapes])
    ax.set_xticklabels([("%d\nH=%d" % (s[idx], s[1])) if mixed_h else str(s[idx])
                        for s in shapes])
    ax.minorticks_off()
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def plot_all_shapes(plt, data, path, gpu=""):
    shapes = sorted(data, key=lambda s: 6.0 * s[0] * s[1] * s[2])
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), dpi=120)
    width = 0.27
    for ax, quantity in zip(axes, ("time", "memory")):
        for j, (name, label, color, _) in enumerate(SERIES):
            k = "%s_%s" % (name, "ms" if quantity == "time" else "mem")
            xs = [i + (j - 1) * width for i, s in enumerate(shapes) if k in data[s]]
            ys = [data[s][k] / (1 if quantity == "time" else 2 ** 30) for s in shapes
                  if k in data[s]]
            if xs:
                ax.bar(xs, ys, width, color=color, label=label)
        ax.set_xticks(range(len(shapes)))
        ax.set_xticklabels(["%d\n%d\n%d" % s for s in shapes], fontsize=7)
        ax.set_xlabel("BT / H / V")
        ax.set_ylabel("time (ms)" if quantity == "time" else "peak extra memory (GiB)")
        ax.set_yscale("log")
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].set_title("Forward + backward time")
    axes[1].set_title("Peak extra device memory (floor: logits)")
    axes[0].legend(fontsize=8)
    if gpu:
        fig.suptitle("lossd fused linear + cross-entropy, bf16, %s" % gpu, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# The in-process anchors (RESULTS.md's "In-process anchors beside lossd" sections): which op a
# column of their table holds, in the order the picture draws them, with the op's id in the
# per-call tables of the bench/results file the section cites.
ANCHOR_OPS = [("floor", "PyTorch 3-GEMM floor", "tab:gray"),
              ("lossd", "lossd", "tab:blue"),
              ("liger_cute", "Liger CuTe-DSL op", "tab:orange"),
              ("liger_triton", "Liger Triton op", "tab:olive"),
              ("quack", "QuACK chunked", "tab:purple"),
              ("quack_scaled", "QuACK scaled-exp", "tab:pink"),
              ("naive", "naive PyTorch", "tab:red")]
ANCHOR_HEADING_RE = re.compile(r"^(#+)\s*In-process anchors beside lossd\b(.*)$")
BYTES_RE = re.compile(r"(\d+(?:\.\d+)?)\s*(B|KiB|MiB|GiB|TiB)\b")


def anchor_op(name):
    """Header text of an anchors table -> the op's id, or None."""
    n = name.lower()
    if "floor" in n:
        return "floor"
    if "lossd" in n:
        return "lossd"
    if "liger" in n:
        return "liger_cute" if "cute" in n else "liger_triton" if "triton" in n else None
    if "quack" in n:
        return "quack_scaled" if "scaled" in n else "quack"
    return "naive" if "naive" in n else None


def anchor_cell(cell):
    """"39.13 (1.042x), 39.25 (1.041x); 510 MiB" -> {"ratio": the slower timing's ratio to the
    floor of its call, "mem": bytes or None}; "37.55 / 37.70" (a floor) -> {"ms": the first};
    a cell with no timing ("not timed (below)") -> None."""
    ratios = [float(r) for r in re.findall(r"\((\d+(?:\.\d+)?)x\)", cell)]
    mem = BYTES_RE.search(cell)
    mem = float(mem.group(1)) * BYTE_UNITS[mem.group(2).lower()] if mem else None
    if ratios:
        return {"ratio": max(ratios), "mem": mem}
    m = re.match(r"^\s*(\d+(?:\.\d+)?)\s*(ms)?\s*(/|\[|;|$)", cell)
    return {"ms": float(m.group(1)), "mem": mem} if m else None


def parse_anchor_sections(text):
    """Every measured anchors section of RESULTS.md, in file order: {"heading", "gpu", "date",
    "cited" (the bench/results/*.md it cites, or None), "shapes", "ops": {op: {shape: cell}}}.
    A section whose table has no floor column (the how-to-run one) is left out."""
    lines = text.splitlines()
    sections = []
    for i, line in enumerate(lines):
        m = ANCHOR_HEADING_RE.match(line)
        if not m:
            continue
        end = next((j for j in range(i + 1, len(lines)) if re.match(
            r"^#{1,%d}\s" % len(m.group(1)), lines[j])), len(lines))
        body = lines[i + 1:end]
        table = parse_anchor_table(body)
        if table is None:
            continue
        shapes, ops = table
        gpu = re.search(r"\b((?:NVIDIA )?[A-Z]{1,3}\d{2,4}[A-Za-z]?(?: \d+GB)?)\b", m.group(2))
        date = re.search(r"\d{4}-\d{2}-\d{2}", m.group(2))
        cited = re.search(r"bench/results/anchors_[\w.-]+\.md", "\n".join(body))
        name = gpu.group(1) if gpu else ""
        sections.append({"heading": line.lstrip("#").strip(),
                         "gpu": name if not name or name.startswith("NVIDIA") else
                         "NVIDIA " + name,
                         "date": date.group(0) if date else "",
                         "cited": cited.group(0) if cited else None,
                         "shapes": shapes, "ops": ops})
    return sections


def parse_anchor_table(body):
    """The first table in `body` whose first column is a shape and that has a floor column:
    (shapes, {op: {shape: cell}}), or None."""
    for i, line in enumerate(body[:-1]):
        if not (line.strip().startswith("|") and re.match(r"^\s*\|?\s*:?-{3,}", body[i + 1])):
            continue
        header = split_row(line)
        ops = [anchor_op(h) for h in header]
        if "floor" not in ops or "bt" not in header[0].lower():
            continue
        shapes, found = [], defaultdict(dict)
        for row in body[i + 2:]:
            if not row.strip().startswith("|"):
                break
            cells = split_row(row)
            m = SHAPE_RE.match(cells[0])
            if not m:
                continue
            shape = tuple(int(g) for g in m.groups())
            shapes.append(shape)
            for cell, op in zip(cells[1:], ops[1:]):
                parsed = anchor_cell(cell) if op else None
                if parsed is not None:
                    found[op][shape] = parsed
        return shapes, dict(found)
    return None


def parse_beyond_outputs(text):
    """The per-call table of a bench/results/anchors_*.md file -> {(op, shape): bytes}: each
    op's peak device memory beyond the inputs and its own dX and dW ("beyond dX, dW", GiB), the
    quantity lossd's measured extra is; the largest over the calls that measured it."""
    out = {}
    lines = text.splitlines()
    for i, line in enumerate(lines[:-1]):
        header = [h.lower() for h in split_row(line)] if line.strip().startswith("|") else []
        if "op" not in header or not any(h.startswith("beyond") for h in header):
            continue
        col_op, col_shape = header.index("op"), header.index("bt, h, v")
        col_mem = next(k for k, h in enumerate(header) if h.startswith("beyond"))
        for row in lines[i + 2:]:
            if not row.strip().startswith("|"):
                break
            cells = split_row(row)
            m = SHAPE_RE.match(cells[col_shape])
            value = NUM_RE.match(cells[col_mem])
            if m and value:
                key = (cells[col_op], tuple(int(g) for g in m.groups()))
                gib = float(value.group(1)) * 2 ** 30
                out[key] = max(gib, out.get(key, 0.0))
    return out


def anchor_figure_data(section, beyond):
    """{op: {shape: {"ratio", "mem"}}} for the picture: time against the floor of the same
    call (the floor 1.0), memory beyond the inputs and the op's outputs (lossd's from
    RESULTS.md, which measures that; the others' from the cited per-call table)."""
    data = {}
    for op, _, _ in ANCHOR_OPS:
        per_shape = {}
        for shape in section["shapes"]:
            cell = section["ops"].get(op, {}).get(shape)
            if cell is None:
                continue
            ratio = 1.0 if op == "floor" else cell.get("ratio")
            mem = cell["mem"] if op == "lossd" else beyond.get((op, shape))
            if ratio is not None:
                per_shape[shape] = {"ratio": ratio, "mem": mem}
        if per_shape:
            data[op] = per_shape
    return data


def plot_anchors(plt, section, data, path):
    """Two panels of bars, one group a shape: time / the floor, and extra memory (log)."""
    shapes = section["shapes"]
    ops = [o for o in ANCHOR_OPS if o[0] in data]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4), dpi=120)
    width = 0.8 / len(ops)
    for ax, quantity in zip(axes, ("ratio", "mem")):
        for j, (op, label, color) in enumerate(ops):
            for i, shape in enumerate(shapes):
                x = i + (j - (len(ops) - 1) / 2.0) * width
                value = data[op].get(shape, {}).get(quantity)
                if value is None:
                    ax.text(x, 1.0 if quantity == "ratio" else 0.05, "not timed",
                            rotation=90, ha="center", va="bottom", fontsize=6, color=color)
                    continue
                y = value if quantity == "ratio" else value / 2 ** 30
                ax.bar(x, y, width, color=color, label=label if i == 0 else None)
                ax.text(x, y, "%.2f" % y if quantity == "ratio" or y < 1 else "%.1f" % y,
                        ha="center",
                        va="bottom", fontsize=6)
        ax.set_xticks(range(len(shapes)))
        ax.set_xticklabels(["BT %d\nH %d\nV %d" % s for s in shapes], fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].axhline(1.0, color="tab:gray", linestyle="--", linewidth=0.8)
    axes[0].set_ylim(0.9, None)
    axes[0].set_ylabel("time / 3-GEMM floor of the same call")
    axes[0].set_title("Forward + backward time (lower is better)", fontsize=10)
    axes[1].set_yscale("log")
    axes[1].set_ylabel("GiB beyond inputs and outputs")
    axes[1].set_title("Extra device memory (lower is better)", fontsize=10)
    axes[0].legend(fontsize=7, loc="upper left")
    fig.suptitle("Fused linear + cross-entropy, bf16, in one process on one %s (%s)"
                 % (section["gpu"] or "GPU", section["date"]), fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def anchors_for_figure(text, results_path):
    """The last measured anchors section of RESULTS.md and its figure data, or (None, None)."""
    sections = parse_anchor_sections(text)
    if not sections:
        return None, None
    section = sections[-1]
    beyond = {}
    if section["cited"]:
        # The cited path is the repository's (bench/results/...); RESULTS.md lives in bench/.
        cited = os.path.join(os.path.dirname(os.path.abspath(results_path)),
                             section["cited"].split("/", 1)[1])
        if os.path.isfile(cited):
            beyond = parse_beyond_outputs(open(cited, encoding="utf-8").read())
    return section, anchor_figure_data(section, beyond)


def main(argv=None):
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", default=os.path.join(here, "..", "RESULTS.md"))
    ap.add_argument("--out", default=here)
    args = ap.parse_args(argv)
    if not os.path.isfile(args.results):
        print("plot_results: %s not found; no plots" % args.results)
        return 1
    text = open(args.results, encoding="utf-8").read()
    data = parse_results(text)
    gpu = gpu_name(text)
    if not data:
        print("plot_results: no benchmark table with a 'BT, H, V' column in %s" % args.results)
        return 1
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(args.out, exist_ok=True)
    written = []
    for vary in ("bt", "v"):
        for quantity in ("time", "memory"):
            path = os.path.join(args.out, "%s_vs_%s.png" % (quantity, vary))
            if plot_sweep(plt, data, vary, quantity, path, gpu):
                written.append(path)
    path = os.path.join(args.out, "all_shapes.png")
    plot_all_shapes(plt, data, path, gpu)
    written.append(path)
    section, anchors = anchors_for_figure(text, args.results)
    if anchors:
        path = os.path.join(args.out, "anchors.png")
        plot_anchors(plt, section, anchors, path)
        written.append(path)
    for s in sorted(data):
        print("  %s: %s" % ("x".join(map(str, s)), ", ".join(
            "%s=%.4g" % (k, v) for k, v in sorted(data[s].items()))))
    print("plot_results: wrote %s" % ", ".join(os.path.relpath(p) for p in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
