# SPDX-License-Identifier: Apache-2.0
"""promtool unit tests of deploy/prometheus/rules, one JUnit case per test group, and a check
that every alert and recording rule has one: an alert fires in some group (with its texts
checked), a recording rule is evaluated by some promql_expr_test. promtool itself never says
which rules went untested.

Needs: promtool (Debian package prometheus), PyYAML.
Run: pytest tests/prometheus/test_rules.py --junitxml=prometheus_rules.xml
"""

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "deploy" / "prometheus" / "rules"
TESTS = REPO / "deploy" / "prometheus" / "tests"


def rules():
    """(alert names, recorded names) of every rule file."""
    alerts, records = set(), set()
    for path in sorted(RULES.glob("*.yml")):
        for group in yaml.safe_load(path.read_text())["groups"]:
            for r in group["rules"]:
                (alerts.add(r["alert"]) if "alert" in r else records.add(r["record"]))
    return alerts, records


def rule_test_groups():
    """(file, its parsed content, one test group) for every group of every test file."""
    out = []
    for path in sorted(TESTS.glob("*.yml")):
        doc = yaml.safe_load(path.read_text())
        for group in doc["tests"]:
            out.append(pytest.param(path, doc, group, id="%s: %s" % (path.name, group["name"])))
    return out


@pytest.mark.parametrize("path,doc,group", rule_test_groups())
def test_rule_group(path, doc, group, tmp_path):
    promtool = shutil.which("promtool")
    if not promtool:
        pytest.fail("promtool not found: apt-get install prometheus")
    one = dict(doc)
    one["rule_files"] = [str((path.parent / f).resolve()) for f in doc["rule_files"]]
    one["tests"] = [group]
    single = tmp_path / path.name
    single.write_text(yaml.safe_dump(one, sort_keys=False))
    r = subprocess.run([promtool, "test", "rules", str(single)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_rule_is_tested():
    alerts, records = rules()
    assert alerts and records
    fired, evaluated = set(), set()
    for path in sorted(TESTS.glob("*.yml")):
        for group in yaml.safe_load(path.read_text())["tests"]:
            for t in group.get("alert_rule_test", []):
                if t.get("exp_alerts"):
                    fired.add(t["alertname"])
            for t in group.get("promql_expr_test", []):
                evaluated.update(name for name in records if name in t["expr"])
    assert sorted(alerts - fired) == [], "alerts no test makes fire"
    assert sorted(records - evaluated) == [], "recording rules no test evaluates"
