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
