#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Sums JUnit XML reports (GoogleTest's, Bazel's and pytest's) into one line:
"N passed, N failed, N skipped". Exits non-zero when anything failed or nothing ran."""
import argparse
import sys
import xml.etree.ElementTree as ET


def count(path):
    passed = failed = skipped = 0
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as e:
        print(f"test_summary: {path}: unreadable report ({e})", file=sys.stderr)
        return 0, 1, 0
    for case in root.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            failed += 1
            print(f"FAILED: {case.get('classname')}.{case.get('name')} ({path})", file=sys.stderr)
        elif case.find("skipped") is not None or case.get("result") == "suppressed" or \
                case.get("status") == "notrun":
            skipped += 1
        else:
            passed += 1
    # A test binary that crashed before writing cases: Bazel's own report has a failure.
    if passed + failed + skipped == 0:
        for suite in root.iter("testsuite"):
            if int(suite.get("failures", "0")) + int(suite.get("errors", "0")) > 0:
                failed += 1
    return passed, failed, skipped


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--skipped-targets", type=int, default=0,
                    help="test targets skipped as a whole (GPU tests on a machine without one)")
    ap.add_argument("reports", nargs="*")
    args = ap.parse_args()
    p = f = s = 0
    for r in args.reports:
        a, b, c = count(r)
        p, f, s = p + a, f + b, s + c
    s += args.skipped_targets
    print(f"{p} passed, {f} failed, {s} skipped")
    return 1 if f or p == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
