# SPDX-License-Identifier: Apache-2.0
"""Runs examples/pipeline_train.py (the synchronous gradient-accumulation loop and
lossd.pipeline's, both with a hosted head, the two loss curves compared) against the test
server: 60 steps with two calls in flight (the curves to rounding, the loss falling by more
than 1), and 10 with one (the same curves, bit for bit). Skipped where torch is not installed
or the server has no hosted heads."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from head_harness import require_heads  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "pipeline_train.py"


@pytest.mark.parametrize("in_flight, steps, min_drop, identical",
                         [(2, 60, 1.0, False), (1, 10, 0.0, True)])
def test_the_example_trains_like_the_synchronous_loop(client, lossd_server, in_flight, steps,
                                                       min_drop, identical):
    require_heads(client)
    env = dict(os.environ, PYTHONPATH=str(EXAMPLE.parents[1]) + os.pathsep +
               os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, str(EXAMPLE), "--server", lossd_server.address,
                        "--steps", str(steps), "--max_in_flight", str(in_flight),
                        "--min_drop", str(min_drop)],
                       capture_output=True, text=True, timeout=600, env=env)
    print(p.stdout)
    assert p.returncode == 0, "the example failed:\n%s\n%s" % (p.stdout, p.stderr[-3000:])
    assert "largest gap" in p.stdout
    if identical:
        assert "identical: True" in p.stdout
