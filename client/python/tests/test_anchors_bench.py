# SPDX-License-Identifier: Apache-2.0
"""The in-process anchors' benchmark (bench/kernel/anchors_bench.py), its table
(anchors_table.py) and the packing of its wheel parts (anchor_parts.py): flags, the correctness
check refusing wrong results, the CSV and markdown writers, the merged table's ratios, and the
script end to end on the CPU (the GPU run is skipped without CUDA)."""

import csv
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

BENCH = Path(__file__).resolve().parents[3] / "bench" / "kernel"
sys.path.insert(0, str(BENCH))
import anchor_parts  # noqa: E402
import anchors_bench as ab  # noqa: E402
import anchors_table as at  # noqa: E402


def run_script(*flags, timeout=300):
    return subprocess.run([sys.executable, str(BENCH / "anchors_bench.py"), *flags],
                          capture_output=True, text=True, timeout=timeout)


# --- flags ------------------------------------------------------------------------------------

def test_flags_default_to_the_three_reference_shapes():
    args = ab.parse_args(["--op", "quack"])
    assert args.shapes == [(8192, 4096, 128256), (8192, 2304, 256000), (16384, 4096, 128256)]
    assert (args.runs, args.warmup, args.quack_chunk, args.device) == (20, 3, 4096, "cuda")
    assert args.grad_tol == 2.0 ** -6 and args.loss_tol == 1e-3


@pytest.mark.parametrize("flags, words", [
    (["--op", "liger"], "bad --op 'liger'"),
    (["--op", "naive", "--shapes", "8x4"], "bad shape '8x4'"),
    (["--op", "naive", "--shapes", "8x0x4"], "bad shape '8x0x4'"),
    (["--op", "naive", "--runs", "0"], "bad --runs 0"),
    (["--op", "naive", "--grad_tol", "0"], "bad --grad_tol 0.0"),
    (["--op", "naive", "--loss_tol", "2"], "--loss_tol 2.0"),
    (["--op", "quack", "--quack_chunk", "100"], "bad --quack_chunk 100"),
    (["--op", "naive", "--device", "tpu"], "bad --device 'tpu'"),
    (["--op", "naive", "--mark_missing", "late"], "--mark_missing needs --csv"),
])
def test_bad_flags_are_refused_naming_them(flags, words, capsys):
    with pytest.raises(SystemExit) as stop:
        ab.parse_args(flags)
    assert stop.value.code != 0
    assert words in capsys.readouterr().err + str(stop.value.code)


def test_the_command_line_refuses_a_bad_flag():
    res = run_script("--dry-run", "--op", "liger", timeout=120)
    assert res.returncode == 2 and "bad --op 'liger'" in res.stderr


def test_dry_run_lists_each_shape():
    res = run_script("--dry-run", "--op", "liger_cute", "--shapes", "256x64x512,128x32x256",
                     timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == [
        "would run liger_cute at 256x64x512: checked once, then 20 runs after 3 warm-up, on cuda",
        "would run liger_cute at 128x32x256: checked once, then 20 runs after 3 warm-up, on cuda"]


# --- the check --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_case():
    """torch_baseline's inputs at a small shape, the float32 reference and the naive bf16 result."""
    x, w, y = ab.make_inputs(96, 64, 300, torch.device("cpu"))
    ref = ab.reference(x, w, y)
    xg = x.clone().requires_grad_(True)
    wg = w.clone().requires_grad_(True)
    loss = torch.nn.functional.cross_entropy((xg @ wg.t()).float(), y)
    loss.backward()
    return ref, loss.detach(), xg.grad, wg.grad


def test_inputs_are_torch_baselines():
    x, w, y = ab.make_inputs(16, 8, 40, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    want_x = (torch.rand(16, 8, generator=gen) * 2 - 1).to(torch.bfloat16)
    want_w = ((torch.rand(40, 8, generator=gen) * 2 - 1) * (6.0 / 8 ** 0.5)).to(torch.bfloat16)
    want_y = torch.randint(0, 40, (16,), generator=gen)
    assert torch.equal(x, want_x) and torch.equal(w, want_w) and torch.equal(y, want_y)
    assert x.dtype == w.dtype == torch.bfloat16 and y.dtype == torch.int64


def test_the_naive_bf16_result_passes_with_bf16_sized_errors(small_case):
    ref, loss, dx, dw = small_case
    errs, problem = ab.check_outputs(loss, dx, dw, ref, ab.GRAD_TOL, ab.LOSS_TOL)
    assert problem == ""
    # Rounded to bf16, not exact: the errors are there, and well inside the tolerance.
    for key in ("dx_err", "dw_err"):
        assert 1e-4 < errs[key] < ab.GRAD_TOL / 2
    assert errs["dx_max_err"] >= errs["dx_err"] / 10
    assert errs["loss_err"] < ab.LOSS_TOL / 10
    assert errs["ref_loss"] == ref.loss


@pytest.mark.parametrize("break_it, words", [
    (lambda l, dx, dw: (l * 2, dx, dw), "loss "),                     # sum-like scale
    (lambda l, dx, dw: (l, dx * 2, dw), "dX rel. error"),             # gradient of a 2x loss
    (lambda l, dx, dw: (l, dx, dw * len(dx)), "dW rel. error"),       # sum instead of mean
    (lambda l, dx, dw: (l, dx, -dw), "dW rel. error"),                # wrong sign
    (lambda l, dx, dw: (l, dx, torch.roll(dw, 1, 0)), "dW rel. error"),  # targets off by one
    (lambda l, dx, dw: (l, dx.t().contiguous(), dw), "dX shape"),
    (lambda l, dx, dw: (l, None, dw), "no dX"),
    (lambda l, dx, dw: (l, dx, dw.masked_fill(dw == dw.max(), float("nan"))), "dW rel. error"),
    (lambda l, dx, dw: (torch.tensor(float("nan")), dx, dw), "loss nan"),
    (lambda l, dx, dw: (None, dx, dw), "no scalar loss"),
])
def test_a_wrong_result_is_refused_naming_what_is_wrong(small_case, break_it, words):
    ref, loss, dx, dw = small_case
    bad = break_it(loss, dx, dw)
    _, problem = ab.check_outputs(*bad, ref, ab.GRAD_TOL, ab.LOSS_TOL)
    assert words in problem


def test_a_tighter_tolerance_refuses_the_bf16_result(small_case):
    ref, loss, dx, dw = small_case
    _, problem = ab.check_outputs(loss, dx, dw, ref, 1e-5, 1e-9)
    assert "dX rel. error" in problem and "dW rel. error" in problem and "loss " in problem


# --- rows, CSV, table -------------------------------------------------------------------------

def row(op, call, ms, status="ok", shape=(8, 4, 16), peak=None):
    bt, h, v = shape
    r = {"call": call, "op": op, "bt": bt, "h": h, "v": v, "status": status}
    if ms is not None:
        r.update(ms=ms, tflops=6.0 * bt * h * v / ms / 1e9, peak_gib=peak,
                 loss=2.5, loss_err=1e-6, dx_err=2e-3, dx_max_err=4e-3, dw_err=3e-3,
                 dw_max_err=5e-3)
    return r


def test_csv_gets_one_header_and_every_row_in_order(tmp_path):
    path = tmp_path / "a.csv"
    ab.append_csv(str(path), row("floor", "call1", 40.0))
    ab.append_csv(str(path), row("quack_scaled", "call1", None, "error: ValueError: m == n"))
    lines = path.read_text().splitlines()
    assert lines[0] == ",".join(ab.CSV_FIELDS)
    back = list(csv.DictReader(path.open()))
    assert [r["op"] for r in back] == ["floor", "quack_scaled"]
    assert float(back[0]["ms"]) == 40.0 and back[1]["ms"] == ""
    assert back[1]["status"] == "error: ValueError: m == n"


def test_markdown_row_shows_dashes_for_what_did_not_run():
    good = ab.markdown_row(row("naive", "c", 50.0, peak=11.74))
    assert good.startswith("| naive | 8, 4, 16 | 50.00 ms |") and "11.74 GiB" in good
    assert "2.00e-03 (4.00e-03)" in good and good.endswith("| ok |")
    failed = ab.markdown_row(row("liger_cute", "c", None, "error: ImportError: no cutlass"))
    assert "| - | - | - |" in failed and failed.endswith("| error: ImportError: no cutlass |")


def test_error_text_is_one_short_line_without_table_bars():
    text = ab.error_text(ValueError("m == n | makes it ambiguous\nsecond line"))
    assert text == "ValueError: m == n / makes it ambiguous"


def test_mark_missing_adds_only_the_shapes_not_reached(tmp_path):
    path = tmp_path / "a.csv"
    ab.append_csv(str(path), row("quack", "call2", 39.0, shape=(8192, 4096, 128256)))
    res = run_script("--op", "quack", "--label", "call2", "--csv", str(path), "--shapes",
                     "8192x4096x128256,8192x2304x256000", "--mark_missing", "stopped", timeout=120)
    assert res.returncode == 0, res.stderr
    back = list(csv.DictReader(path.open()))
    assert [(r["v"], r["status"]) for r in back] == [("128256", "ok"), ("256000", "stopped")]


def write_call(folder, rows, bench_lines=None):
    folder.mkdir()
    for r in rows:
        ab.append_csv(str(folder / "anchors.csv"), r)
    if bench_lines:
        (folder / "bench.csv").write_text(
            "bt,h,v,floor_ms,tuned_floor_ms,budget_mib,chunk_rows,schedule,side_sms,fused_ms,"
            "ratio,tflops,workspace_mib,measured_extra_mib,deterministic,mean_loss\n"
            + "\n".join(bench_lines) + "\n")


def test_table_compares_each_op_with_the_floor_of_its_own_call(tmp_path):
    s1, s2 = (8, 4, 16), (8, 2, 32)
    write_call(tmp_path / "call1", [row("floor", "call1", 40.0, shape=s1),
                                    row("floor", "call1", 20.0, shape=s2),
                                    row("naive", "call1", 50.0, shape=s1, peak=11.7)],
               ["8,4,16,38.8,37.4,512,2048,0,0,38.8,1.0,668,520,510,1,11.9",
                "8,4,16,38.8,37.4,1024,4096,0,0,39.9,1.0,668,520,1020,1,11.9"])
    write_call(tmp_path / "call2", [row("floor", "call2", 41.0, shape=s1),
                                    row("liger_cute", "call2", 45.1, shape=s1, peak=3.1),
                                    row("quack_scaled", "call2", None, "error: ValueError: m == n",
                                        shape=s1),
                                    row("quack", "call2", 22.0, shape=s2, peak=0.5)])
    rows = at.load([str(tmp_path / "call1"), str(tmp_path / "call2")])
    table = at.summary(rows).splitlines()
    assert table[0].startswith("| BT, H, V | PyTorch 3-GEMM floor | lossd")
    first = [c.strip() for c in table[2].split("|")[1:-1]]
    assert first[0] == "8, 4, 16"
    assert first[1] == "40.00 ms [call1]; 41.00 ms [call2]"
    # lossd: bench_kernel's first row at the shape, against call1's floor (38.8 / 40).
    assert first[2] == "38.80 ms (0.970x), 510 MiB [call1]"
    assert first[3] == "45.10 ms (1.100x), 3.1 GiB [call2]"
    assert first[4] == "not run"
    assert first[6] == "fails: ValueError: m == n"
    assert first[7] == "50.00 ms (1.250x), 11.7 GiB [call1]"
    second = [c.strip() for c in table[3].split("|")[1:-1]]
    assert second[0] == "8, 2, 32" and second[5] == "22.00 ms (no floor in its call), 512 MiB [call2]"
    assert len([r for r in rows if r["op"] == "lossd"]) == 1


def test_table_command_writes_the_merged_csv(tmp_path):
    write_call(tmp_path / "call1", [row("floor", "call1", 40.0), row("naive", "call1", 50.0)])
    out = subprocess.run([sys.executable, str(BENCH / "anchors_table.py"), "--csv",
                          str(tmp_path / "all.csv"), str(tmp_path / "call1")],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert "| 8, 4, 16 | 40.00 ms [call1] |" in out
    merged = list(csv.DictReader((tmp_path / "all.csv").open()))
    assert [(r["call"], r["op"]) for r in merged] == [("call1", "floor"), ("call1", "naive")]
    bad = subprocess.run([sys.executable, str(BENCH / "anchors_table.py"),
                          str(tmp_path / "nowhere")], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "not a folder" in bad.stderr


# --- packing the parts ------------------------------------------------------------------------

def test_parts_split_trees_where_a_part_fills_and_keep_wheels_whole():
    items = [("a.whl", 30, False), ("b.whl", 30, False), ("t1", 100, True), ("t2", 20, True)]
    parts = anchor_parts.plan_parts(items, 40, 60)
    assert parts == [[("a.whl", 0, 30)],
                     [("b.whl", 0, 30), ("t1", 0, 30)],
                     [("t1", 30, 60)],
                     [("t1", 90, 10), ("t2", 0, 20)]]
    for part, cap in zip(parts, [40] + [60] * 10):
        assert sum(length for _, _, length in part) <= cap
    for name, size, _ in items:
        spans = [(off, ln) for part in parts for n, off, ln in part if n == name]
        assert spans[0][0] == 0 and sum(ln for _, ln in spans) == size
        assert all(a[0] + a[1] == b[0] for a, b in zip(spans, spans[1:]))


def test_parts_refuse_a_wheel_larger_than_a_part():
    with pytest.raises(SystemExit, match="big.whl"):
        anchor_parts.plan_parts([("big.whl", 70, False)], 40, 60)


# --- end to end -------------------------------------------------------------------------------

def test_script_on_the_cpu_reports_a_failing_op_and_goes_on(tmp_path):
    path = tmp_path / "a.csv"
    ok = run_script("--op", "naive", "--device", "cpu", "--shapes", "16x8x64,24x8x40", "--runs",
                    "2", "--warmup", "1", "--csv", str(path), "--label", "call1")
    assert ok.returncode == 0, ok.stderr
    # No package for the CuTe op here (or no Hopper GPU): each shape's row says why.
    failing = run_script("--op", "liger_cute", "--device", "cpu", "--shapes", "16x8x64,24x8x40",
                         "--runs", "1", "--warmup", "0", "--csv", str(path), "--label", "call1")
    assert failing.returncode == 3
    back = list(csv.DictReader(path.open()))
    assert [(r["op"], r["bt"]) for r in back] == [("naive", "16"), ("naive", "24"),
                                                  ("liger_cute", "16"), ("liger_cute", "24")]
    assert all(r["status"] == "ok" and float(r["ms"]) > 0 for r in back[:2])
    assert all(float(r["dw_err"]) < ab.GRAD_TOL for r in back[:2])
    assert all(r["status"].startswith("error: ") and r["ms"] == "" for r in back[2:])
    assert "| liger_cute | 24, 8, 40 |" in failing.stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_naive_and_floor_on_the_gpu_report_time_and_memory(tmp_path):
    path = tmp_path / "a.csv"
    for op in ("naive", "floor"):
        res = run_script("--op", op, "--shapes", "256x128x1024", "--runs", "3", "--warmup", "1",
                         "--csv", str(path))
        assert res.returncode == 0, res.stderr
    back = list(csv.DictReader(path.open()))
    assert [r["op"] for r in back] == ["naive", "floor"]
    for r in back:
        assert float(r["ms"]) > 0 and float(r["peak_gib"]) > 0
    assert float(back[0]["dx_err"]) < ab.GRAD_TOL
