# SPDX-License-Identifier: Apache-2.0
"""The packaging check as one JUnit case: check_package.sh builds the sdist, a wheel from it
alone, installs it into a fresh virtual environment of this interpreter and runs smoke.py
against a live lossd ($LOSSD_BIN, else $(bazel info bazel-bin)/service/lossd), and fails if
anything was written into the checkout.

Run: pytest client/python/pkgtest/test_package.py --junitxml=python_package.xml
"""

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from lossd_servers import find_lossd_binary  # noqa: E402


def test_sdist_wheel_venv_smoke():
    r = subprocess.run([str(HERE / "check_package.sh"), find_lossd_binary()],
                       capture_output=True, text=True,
                       env=dict(os.environ, PYTHON=sys.executable))
    print(r.stdout)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "smoke: OK" in r.stdout
