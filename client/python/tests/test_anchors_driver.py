# SPDX-License-Identifier: Apache-2.0
"""bench/kernel/run_anchors.sh end to end on the CPU, with stand-in wheel sets of the real
names (tiny packages whose ops compute the naive loss): anchor_parts.py packs them into parts
with each tree cut into pieces, two calls stage the parts between them, and each call installs
the sets that are complete (pip --no-index --target, pieces rejoined and sha256-checked), runs
each op in its own process with its set's path, and writes the table of both calls."""

import csv
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytest.importorskip("torch")
REPO = Path(__file__).resolve().parents[3]
BENCH = REPO / "bench" / "kernel"
NEEDED = ("bash", "xz", "tar", "sha256sum", "timeout")

NAIVE = ("import torch.nn.functional as F\n"
         "def naive(x, w, y):\n    return F.cross_entropy((x @ w.t()).float(), y)\n")
# The stand-in ops import a module that only the set's tree holds, from the folder that the
# DSL's .pth would add: they run only when the tree was rejoined, unpacked and put on the path.
LIGER_CUTE = ("import cutlass_probe_481\nfrom liger_kernel._naive import naive\n"
              "def liger_fused_linear_cross_entropy_sm90(x, w, y):\n    return naive(x, w, y)\n")
LIGER_MODULE = ("import torch\nfrom liger_kernel._naive import naive\n"
                "class LigerFusedLinearCrossEntropyLoss(torch.nn.Module):\n"
                "    def forward(self, w, x, y):\n        return naive(x, w, y)\n")
# The scaled path returns twice the loss: the check must refuse it and not time it.
QUACK = ("import cutlass_probe_462\nimport torch.nn.functional as F\n"
         "def chunked_linear_cross_entropy(x, w, y, chunk_size=4096, use_scaled_exp=None):\n"
         "    loss = F.cross_entropy((x @ w.t()).float(), y)\n"
         "    return loss * 2 if use_scaled_exp else loss\n")


def wheel(folder, filename, files):
    """A minimal wheel: the files plus the dist-info pip reads."""
    name, version = filename.split("-")[:2]
    info = f"{name}-{version}.dist-info"
    files = dict(files)
    files[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    files[f"{info}/WHEEL"] = "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    files[f"{info}/RECORD"] = "".join(f"{p},,\n" for p in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(folder / filename, "w") as zf:
        for path, text in files.items():
            zf.writestr(path, text)


def stand_in_wheels(folder):
    pkg = "nvidia_cutlass_dsl/dsl_packages"
    # Incompressible filler makes each tree a few pieces long at the parts' tiny size.
    filler = os.urandom(9000).hex()
    wheel(folder, "liger_kernel-0.8.5-py3-none-any.whl", {
        "liger_kernel/__init__.py": "", "liger_kernel/_naive.py": NAIVE,
        "liger_kernel/transformers/__init__.py": "",
        "liger_kernel/transformers/fused_linear_cross_entropy.py": LIGER_MODULE,
        "liger_kernel/ops/__init__.py": "", "liger_kernel/ops/cutedsl/__init__.py": "",
        "liger_kernel/ops/cutedsl/ops/__init__.py": "",
        "liger_kernel/ops/cutedsl/ops/fused_linear_cross_entropy_sm90.py": LIGER_CUTE})
    wheel(folder, "quack_kernels-0.6.4-py3-none-any.whl",
          {"quack/__init__.py": "", "quack/linear_cross_entropy.py": QUACK})
    for version, probe in (("4.6.2", "cutlass_probe_462"), ("4.8.1", "cutlass_probe_481")):
        wheel(folder, f"nvidia_cutlass_dsl-{version}-py3-none-any.whl",
              {"nvidia_cutlass_dsl/__init__.py": ""})
        wheel(folder, f"nvidia_cutlass_dsl_libs_base-{version}-py3-none-any.whl",
              {f"{pkg}/base_{probe}.py": ""})
        wheel(folder, f"nvidia_cutlass_dsl_libs_core-{version}-py3-none-any.whl",
              {f"{pkg}/core_{probe}.py": ""})
        wheel(folder, f"nvidia_cutlass_dsl_libs_cu13-{version}-py3-none-any.whl",
              {f"{pkg}/{probe}.py": f"FILLER = '{filler}'\n"})
    wheel(folder, "apache_tvm_ffi-0.1.15-py3-none-any.whl", {"tvm_ffi/__init__.py": ""})
    wheel(folder, "torch_c_dlpack_ext-0.1.5-py3-none-any.whl", {"torch_c_dlpack_ext/__init__.py": ""})


def driver(parts, root, out, ops):
    env = dict(os.environ, ANCHOR_PARTS=str(parts), ANCHOR_ROOT=str(root), ANCHOR_DEVICE="cpu",
               ANCHOR_SHAPES="16x8x64,24x8x40", ANCHOR_ARGS="--runs 2 --warmup 1",
               ANCHOR_OPS=ops, ANCHOR_BUNDLE=str(root / "no-bundle.tar.xz"),
               PYTHON=sys.executable)
    env.pop("PYTHONPATH", None)
    res = subprocess.run(["bash", str(BENCH / "run_anchors.sh"), str(out)], env=env,
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout


@pytest.mark.skipif(any(shutil.which(t) is None for t in NEEDED), reason="needs " + ", ".join(NEEDED))
def test_two_calls_stage_install_run_and_tabulate(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    stand_in_wheels(wheels)
    packed = tmp_path / "anchors"
    subprocess.run([sys.executable, str(BENCH / "anchor_parts.py"), str(packed), str(wheels),
                    "--first_mb", "0.012", "--part_mb", "0.012"],
                   check=True, capture_output=True, text=True, timeout=300)
    parts = sorted(p.name for p in packed.iterdir() if p.name.startswith("part"))
    assert len(parts) >= 3
    sets = (packed / parts[0] / "sets.txt").read_text()
    assert "quack tree nvidia_cutlass_dsl_libs_cu13-4.6.2-py3-none-any.whl.tar.xz" in sets
    assert all((packed / p / "sets.txt").read_text() == sets for p in parts)
    pieces = [int(line.split()[4]) for line in sets.splitlines() if " tree " in line]
    assert len(pieces) == 2 and min(pieces) >= 2  # both trees are cut, so rejoining is tested
    # Call 1 carries the first part only: liger_kernel alone is complete (the Triton op's set).
    first, rest = tmp_path / "call1_parts", tmp_path / "call2_parts"
    first.mkdir()
    rest.mkdir()
    shutil.copytree(packed / parts[0], first / parts[0])
    for p in parts[1:]:
        shutil.copytree(packed / p, rest / p)
    root = tmp_path / "host"
    log1 = driver(first, root, tmp_path / "out1", "floor liger_triton liger_cute")
    assert "set liger_py: installed" in log1 and "set liger: waits for" in log1
    assert "liger_cute: skipped, set liger not installed yet" in log1
    log2 = driver(rest, root, tmp_path / "out2", "floor liger_cute quack quack_scaled")
    assert "set liger_py: installed earlier" in log2
    assert "set quack: installed" in log2 and "set liger: installed" in log2

    rows = list(csv.DictReader((root / "results" / "call2" / "anchors.csv").open()))
    status = {(r["op"], r["bt"]): r["status"] for r in rows}
    for op in ("floor", "liger_cute", "quack"):
        assert status[(op, "16")].startswith("ok") and status[(op, "24")].startswith("ok")
    assert status[("quack_scaled", "16")].startswith("WRONG, not timed: loss ")
    assert all(r["ms"] == "" for r in rows if r["op"] == "quack_scaled")
    table = (tmp_path / "out2" / "anchors_table.md").read_text()
    line = next(l for l in table.splitlines() if l.startswith("| 16, 8, 64 |"))
    assert "[call1]; " in line and "[call2]" in line  # both calls' floors
    assert "WRONG, not timed" in line
    merged = list(csv.DictReader((tmp_path / "out2" / "anchors_all.csv").open()))
    assert {r["call"] for r in merged} == {"call1", "call2"}
    assert sorted(os.listdir(tmp_path / "out2")) == [
        "anchors.log", "anchors_all.csv", "anchors_results.tar.gz", "anchors_table.md"]
