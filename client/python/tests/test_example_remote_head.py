# SPDX-License-Identifier: Apache-2.0
"""Runs examples/remote_head_train.py (a small model trained with its head on lossd and with a
local head, the two loss curves compared) for 60 steps against the test server. Skipped where
torch is not installed or the server has no hosted heads."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from head_harness import require_heads  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "remote_head_train.py"


def test_the_example_trains_like_a_local_head(client, lossd_server):
    require_heads(client)
    env = dict(os.environ, PYTHONPATH=str(EXAMPLE.parents[1]) + os.pathsep +
               os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, str(EXAMPLE), "--server", lossd_server.address,
                        "--steps", "60"], capture_output=True, text=True, timeout=600, env=env)
    print(p.stdout)
    assert p.returncode == 0, "the example failed:\n%s\n%s" % (p.stdout, p.stderr[-3000:])
    assert "largest gap" in p.stdout
