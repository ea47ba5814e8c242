# SPDX-License-Identifier: Apache-2.0
"""plot_results.py parses the tables bench_kernel and torch_baseline.py print (made-up numbers
below, in their exact layout) and writes the PNGs."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import plot_results  # noqa: E402

SAMPLE = """
# Kernel benchmark

GPU: X (132 SMs), fwd+bwd bf16, median of 20 runs after 3 warm-up

| BT, H, V | 3-GEMM floor | budget | C | fused | fused / floor | TFLOP/s | workspace | measured extra | deterministic | mean loss |
|---|---|---|---|---|---|---|---|---|---|---|
| 8192, 4096, 128256 | 36.70 ms | 512 MiB | 1024 | 44.00 ms | 1.199x | 600 | 260 MiB | 270 MiB | yes | 11.9000 |
| 8192, 4096, 128256 | 36.70 ms | 1024 MiB | 2048 | 41.00 ms | 1.117x | 640 | 510 MiB | 520 MiB | yes | 11.9000 |
| 8192, 4096, 128256 | floor 690 TFLOP/s; chunked GEMMs alone 39.60 ms, CE kernels alone 1.00 ms | | | | | | | | | |
| 16384, 4096, 128256 | 77.40 ms | 1024 MiB | 2048 | 82.00 ms | 1.059x | 650 | 510 MiB | 530 MiB | yes | 11.9000 |
| 8192, 4096, 64128 | 18.50 ms | 1024 MiB | 4096 | 21.00 ms | 1.135x | 610 | 505 MiB | 515 MiB | yes | 11.2000 |

| BT, H, V | naive PyTorch | naive TFLOP/s | naive peak extra | torch 3-GEMM floor | loss |
|---|---|---|---|---|---|
| 8192, 4096, 128256 | 120.00 ms | 200 | 12.50 GiB | 37.00 ms | 11.9000 |
| 16384, 4096, 128256 | 240.00 ms | 200 | 25.00 GiB | 78.00 ms | 11.9000 |
| 8192, 4096, 64128 | 60.00 ms | 200 | 6.25 GiB | 19.00 ms | 11.2000 |
"""


def test_parses_both_tables():
    d = plot_results.parse_results(SAMPLE)
    assert set(d) == {(8192, 4096, 128256), (16384, 4096, 128256), (8192, 4096, 64128)}
    r = d[(8192, 4096, 128256)]
    assert r["fused_ms"] == 41.0  # fastest of the budgets
    assert r["floor_ms"] == 36.7  # the C++ floor, not torch's
    assert r["naive_ms"] == 120.0
    assert r["fused_mem"] == 520 * 2 ** 20  # measured extra of that same (fastest) row
    assert r["naive_mem"] == 12.5 * 2 ** 30
    assert r["floor_mem"] == 2.0 * 8192 * 128256


def test_headline_table_of_results_md():
    """RESULTS.md's headline layout: 'lossd CUDA (fused)', 'peak extra (workspace /
    measured)', a speed-up column; its fused numbers win over a later all-settings table."""
    text = """
| BT, H, V | 3-GEMM floor | lossd CUDA (fused) | fused / floor | TFLOP/s | peak extra (workspace / measured) | naive PyTorch | naive peak extra | speed-up over naive |
|---|---|---|---|---|---|---|---|---|
| 8192, 4096, 128256 | 37.58 ms | 40.26 ms | 1.071x | 641 | 509 / 510 MiB | 47.66 ms | 11.74 GiB | 1.18x |

| BT, H, V | floor | budget | C | schedule | fused | fused / floor | TFLOP/s | workspace |
|---|---|---|---|---|---|---|---|---|
| 8192, 4096, 128256 | 37.58 ms | 1024 MiB | 4096 | columns | 39.75 ms | 1.058x | 650 | 1010 MiB |
"""
    r = plot_results.parse_results(text)[(8192, 4096, 128256)]
    assert r["fused_ms"] == 40.26 and r["fused_mem"] == 510 * 2 ** 20
    assert r["floor_ms"] == 37.58 and r["naive_ms"] == 47.66
    assert r["naive_mem"] == 11.74 * 2 ** 30
    assert "fused_workspace" not in r


def test_units():
    assert plot_results.parse_time_ms("1.5 s") == 1500.0
    assert plot_results.parse_time_ms("250 us") == 0.25
    assert plot_results.parse_bytes("1.1 GB", "MiB") == 1.1e9
    assert plot_results.parse_time_ms("floor 690 TFLOP/s") is None


def test_writes_pngs(tmp_path):
    res = tmp_path / "RESULTS.md"
    res.write_text(SAMPLE)
    assert plot_results.main(["--results", str(res), "--out", str(tmp_path)]) == 0
    for name in ("time_vs_bt.png", "memory_vs_bt.png", "time_vs_v.png", "memory_vs_v.png",
                 "all_shapes.png"):
        p = tmp_path / name
        assert p.is_file() and p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name


def test_no_table_no_plots(tmp_path):
    res = tmp_path / "RESULTS.md"
    res.write_text("# Results\n\nNot measured yet.\n")
    assert plot_results.main(["--results", str(res), "--out", str(tmp_path)]) == 1
    assert not list(tmp_path.glob("*.png"))


RESULTS_MD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "RESULTS.md")
A, B, C = (8192, 4096, 128256), (8192, 2304, 256000), (16384, 4096, 128256)
GIB, MIB = 2 ** 30, 2 ** 20


def test_anchors_picture_reads_results_md():
    """The README's picture: the H200 anchors section of bench/RESULTS.md (2026-12-03) and
    the per-call table it cites, number for number."""
    text = open(RESULTS_MD, encoding="utf-8").read()
    sections = [s for s in plot_results.parse_anchor_sections(text) if s["date"] == "2026-12-03"
                and s["gpu"] == "NVIDIA H200"]
    assert len(sections) == 1
    s = sections[0]
    assert s["shapes"] == [A, B, C]
    assert s["cited"] == "bench/results/anchors_2026-12-03_h200.md"
    assert s["ops"]["floor"][A]["ms"] == 37.55
    cited = os.path.join(os.path.dirname(RESULTS_MD), "results", "anchors_2026-12-03_h200.md")
    beyond = plot_results.parse_beyond_outputs(open(cited, encoding="utf-8").read())
    d = plot_results.anchor_figure_data(s, beyond)
    ratio = {op: [d[op].get(x, {}).get("ratio") for x in (A, B, C)] for op in d}
    mem = {op: [d[op].get(x, {}).get("mem") for x in (A, B, C)] for op in d}
    assert ratio == {
        "floor": [1.0, 1.0, 1.0],
        "lossd": [1.042, 1.101, 1.027],  # timed twice: the slower of the two
        "liger_cute": [1.069, 1.250, 1.048],
        "liger_triton": [1.441, 2.639, 1.178],
        "quack": [1.021, None, None],  # the other two shapes were not timed
        "naive": [1.293, 1.563, 1.288],
    }
    assert mem == {
        "floor": [1.96 * GIB, 3.91 * GIB, 3.91 * GIB],
        "lossd": [510 * MIB, 1008 * MIB, 510 * MIB],  # its measured extra, from RESULTS.md
        "liger_cute": [2.02 * GIB, 3.94 * GIB, 4.04 * GIB],
        "liger_triton": [0.06 * GIB, 0.06 * GIB, 0.12 * GIB],
        "quack": [2.94 * GIB, None, None],
        "naive": [10.70 * GIB, 22.30 * GIB, 22.38 * GIB],
    }


ANCHORS_SAMPLE = """
GPU: NVIDIA H200 (132 SMs)

## In-process anchors beside lossd (issue 26; 2026-12-03, one H200 on a GPU host)

| BT, H, V | PyTorch floor (3 calls) | lossd, default config | Liger Triton op | QuACK chunked, base path | naive PyTorch |
|---|---|---|---|---|---|
| 8192, 4096, 128256 | 37.00 / 38.00 | 39.00 (1.054x), 39.10 (1.029x); 510 MiB | 54.00 (1.459x), 1.1 GiB | not timed (below) | 48.00 (1.297x), 11.7 GiB |

- Raw rows: bench/results/anchors_x.md.

## In-process anchors beside lossd (issue 26): how to run

| BT, H, V | what |
|---|---|
| 8192, 4096, 128256 | nothing measured |

## In-process anchors beside lossd (2026-12-08, one H100 80GB HBM3 on a GPU host)

| BT, H, V | PyTorch 3-GEMM floor | lossd | naive PyTorch |
|---|---|---|---|
| 8192, 4096, 128256 | 36.00 ms | 40.00 ms (1.111x), 607 MiB | 50.00 ms (1.389x), 11.7 GiB |
| 16384, 4096, 128256 | 72.00 ms | 79.00 ms (1.097x), 607 MiB | 99.00 ms (1.375x), 23.5 GiB |

Raw rows: bench/results/anchors_h100.md.

| BT, H, V | 3-GEMM floor | fused | peak extra (measured) |
|---|---|---|---|
| 8192, 4096, 128256 | 30.00 ms | 31.00 ms | 600 MiB |
"""

BEYOND_SAMPLE = """
| call | op | BT, H, V | median | peak above inputs | beyond dX, dW | status |
|---|---|---|---|---|---|---|
| call1 | floor | 8192, 4096, 128256 | 36.00 | 3.00 | 1.96 | ok |
| call1 | naive | 8192, 4096, 128256 | 50.00 | 11.74 | 10.70 | ok |
| call1 | naive | 16384, 4096, 128256 | - | - | - | stopped |
| call2 | floor | 8192, 4096, 128256 | 36.50 | 3.00 | 1.97 | ok |
"""


def test_anchor_sections_and_the_latest_one(tmp_path):
    sections = plot_results.parse_anchor_sections(ANCHORS_SAMPLE)
    # The how-to-run section has no floor column: not a measurement.
    assert [(s["gpu"], s["date"], s["cited"]) for s in sections] == [
        ("NVIDIA H200", "2026-12-03", "bench/results/anchors_x.md"),
        ("NVIDIA H100 80GB", "2026-12-08", "bench/results/anchors_h100.md")]
    h200 = sections[0]["ops"]
    assert h200["lossd"][A] == {"ratio": 1.054, "mem": 510 * MIB}
    assert h200["liger_triton"][A] == {"ratio": 1.459, "mem": 1.1 * GIB}
    assert A not in h200.get("quack", {})
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "anchors_h100.md").write_text(BEYOND_SAMPLE)
    res = tmp_path / "RESULTS.md"
    res.write_text(ANCHORS_SAMPLE)
    section, d = plot_results.anchors_for_figure(ANCHORS_SAMPLE, str(res))
    assert section["gpu"] == "NVIDIA H100 80GB" and section["shapes"] == [A, C]
    assert d == {
        "floor": {A: {"ratio": 1.0, "mem": 1.97 * GIB}, C: {"ratio": 1.0, "mem": None}},
        "lossd": {A: {"ratio": 1.111, "mem": 607 * MIB}, C: {"ratio": 1.097, "mem": 607 * MIB}},
        "naive": {A: {"ratio": 1.389, "mem": 10.70 * GIB}, C: {"ratio": 1.375, "mem": None}},
    }
    assert plot_results.main(["--results", str(res), "--out", str(tmp_path)]) == 0
    assert (tmp_path / "anchors.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_tables_of_another_gpu_are_left_out():
    """The H100 section's floor (30 ms) and fused time are not mixed into the H200 file's."""
    d = plot_results.parse_results(ANCHORS_SAMPLE)
    assert d[A]["floor_ms"] == 37.0 and d[A]["fused_ms"] == 39.0
    assert d[A]["naive_ms"] == 48.0 and C not in d
