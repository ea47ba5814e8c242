#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The side-by-side table of lossd and the in-process anchors, from the results of one or more
calls on a GPU host.

Each CALL_DIR holds one call's results: anchors.csv (rows of anchors_bench.py, any ops) and,
where lossd's benchmark ran in that call, bench.csv (bench_kernel --csv, its first row at each
shape: the default configuration when run with --budgets_mib=0 --schedules=0). The folder's
name labels the call. Each time is shown with its ratio to the PyTorch 3-GEMM floor measured
in the same call at the same shape (floors move 2-3% between calls), and with its peak memory
above the inputs. Prints the summary table, then every anchor row with its errors; --csv also
writes all rows, lossd's included, as one CSV.
Usage: anchors_table.py [--csv FILE] CALL_DIR [CALL_DIR ...]
"""
import argparse
import csv
import os
import sys

COLUMNS = (("lossd", "lossd (default config)"), ("liger_cute", "Liger CuTe-DSL SM90 op"),
           ("liger_triton", "Liger Triton op"), ("quack", "QuACK chunked, base path"),
           ("quack_scaled", "QuACK scaled-exp path"), ("naive", "naive PyTorch"))
MERGED_FIELDS = ("call", "op", "bt", "h", "v", "ms", "peak_gib", "status", "note")


def read_csv(path):
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def number(text):
    try:
        value = float(text)
    except (TypeError, ValueError):
        return None
    return value if value == value else None


def lossd_rows(path, call):
    """bench_kernel's CSV as merged rows: its first configuration at each shape."""
    rows, seen = [], set()
    for r in read_csv(path):
        shape = (int(r["bt"]), int(r["h"]), int(r["v"]))
        if shape in seen:
            continue
        seen.add(shape)
        extra = number(r.get("measured_extra_mib"))
        rows.append({"call": call, "op": "lossd", "bt": shape[0], "h": shape[1], "v": shape[2],
                     "ms": number(r.get("fused_ms")),
                     "peak_gib": None if extra is None else extra / 1024, "status": "ok",
                     "note": f"its cuBLASLt floor {r.get('floor_ms')} ms, tuned floor "
                             f"{r.get('tuned_floor_ms')} ms, budget {r.get('budget_mib')} MiB"})
    return rows


def anchor_rows(path, call):
    rows = []
    for r in read_csv(path):
        rows.append({"call": call, "op": r["op"], "bt": int(r["bt"]), "h": int(r["h"]),
                     "v": int(r["v"]), "ms": number(r.get("ms")),
                     "peak_gib": number(r.get("peak_gib")), "status": r.get("status", ""),
                     "note": "", "raw": r})
    return rows


def load(call_dirs):
    """Every row of every call, in call order."""
    rows = []
    for d in call_dirs:
        call = os.path.basename(os.path.normpath(d))
        if os.path.exists(os.path.join(d, "anchors.csv")):
            rows += anchor_rows(os.path.join(d, "anchors.csv"), call)
        if os.path.exists(os.path.join(d, "bench.csv")):
            rows += lossd_rows(os.path.join(d, "bench.csv"), call)
    return rows


def floors(rows):
    """{(call, shape): PyTorch floor ms}."""
    return {(r["call"], (r["bt"], r["h"], r["v"])): r["ms"] for r in rows
            if r["op"] == "floor" and r["ms"] is not None}


def memory(gib):
    if gib is None:
        return ""
    return f", {gib * 1024:.0f} MiB" if gib < 1 else f", {gib:.1f} GiB"


def cell(r, floor_of):
    """One run of an op at one shape: time, ratio to its call's floor, memory; or its error."""
    if r["ms"] is None:
        status = r["status"] or "no result"
        return ("fails: " + status[len("error: "):]) if status.startswith("error: ") else status
    floor = floor_of.get((r["call"], (r["bt"], r["h"], r["v"])))
    ratio = f" ({r['ms'] / floor:.3f}x)" if floor else " (no floor in its call)"
    return f"{r['ms']:.2f} ms{ratio}{memory(r['peak_gib'])} [{r['call']}]"


def summary(rows):
    floor_of = floors(rows)
    shapes = list(dict.fromkeys((r["bt"], r["h"], r["v"]) for r in rows))  # first-seen order
    lines = ["| BT, H, V | PyTorch 3-GEMM floor | " + " | ".join(t for _, t in COLUMNS) + " |",
             "|---" * (2 + len(COLUMNS)) + "|"]
    for shape in shapes:
        at = [r for r in rows if (r["bt"], r["h"], r["v"]) == shape]
        fl = [f"{r['ms']:.2f} ms [{r['call']}]" for r in at if r["op"] == "floor" and r["ms"]]
        cells = ["; ".join(fl) or "-"]
        for op, _ in COLUMNS:
            cells.append("; ".join(cell(r, floor_of) for r in at if r["op"] == op) or "not run")
        lines.append(f"| {shape[0]}, {shape[1]}, {shape[2]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def detail(rows):
    """Every anchor row with its errors, as anchors_bench prints them."""
    lines = ["| call | op | BT, H, V | median | peak above inputs | beyond dX, dW | loss rel. error "
             "| dX rel. error (max) | dW rel. error (max) | status |", "|---" * 10 + "|"]

    def f(raw, key, spec):
        v = number(raw.get(key))
        return "-" if v is None else f"{v:{spec}}"
    for r in rows:
        if "raw" not in r:
            continue
        raw = r["raw"]
        lines.append(
            f"| {r['call']} | {r['op']} | {r['bt']}, {r['h']}, {r['v']} | {f(raw, 'ms', '.2f')} "
            f"| {f(raw, 'peak_gib', '.2f')} | {f(raw, 'beyond_grads_gib', '.2f')} "
            f"| {f(raw, 'loss_err', '.1e')} | {f(raw, 'dx_err', '.2e')} "
            f"({f(raw, 'dx_max_err', '.2e')}) | {f(raw, 'dw_err', '.2e')} "
            f"({f(raw, 'dw_max_err', '.2e')}) | {r['status']} |")
    return "\n".join(lines)


def write_merged(path, rows):
    with open(path, "w", newline="") as fh:
        out = csv.writer(fh)
        out.writerow(MERGED_FIELDS)
        for r in rows:
            out.writerow(["" if r.get(k) is None else r.get(k) for k in MERGED_FIELDS])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--csv", default="", help="also write every row to this CSV file")
    ap.add_argument("call_dirs", nargs="+", help="one folder of results per call")
    args = ap.parse_args(argv)
    missing = [d for d in args.call_dirs if not os.path.isdir(d)]
    if missing:
        ap.error(f"not a folder: {', '.join(missing)}")
    rows = load(args.call_dirs)
    if not rows:
        print("no results in " + ", ".join(args.call_dirs), file=sys.stderr)
        return 1
    print("Median ms, fwd+bwd, bf16; (x) = against the PyTorch 3-GEMM floor of the same call "
          "and shape; memory = peak above the inputs (lossd: its measured extra beyond inputs and "
          "outputs); [call] = the call that measured it.\n")
    print(summary(rows))
    print("\nEach anchor against the float32 reference (errors: relative norm, largest element "
          "in parentheses):\n")
    print(detail(rows))
    notes = [f"- lossd [{r['call']}] {r['bt']}, {r['h']}, {r['v']}: {r['note']}"
             for r in rows if r["op"] == "lossd"]
    if notes:
        print("\n" + "\n".join(notes))
    if args.csv:
        write_merged(args.csv, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
