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
Never invents numbers: writes no plot when the file holds no such table.

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


def parse_results(text):
    """Returns {(bt, h, v): {quantity: value}}; times in ms, memory in bytes."""
    data = defaultdict(dict)
    lines = text.splitlines()
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
    for s in sorted(data):
        print("  %s: %s" % ("x".join(map(str, s)), ", ".join(
            "%s=%.4g" % (k, v) for k, v in sorted(data[s].items()))))
    print("plot_results: wrote %s" % ", ".join(os.path.relpath(p) for p in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
