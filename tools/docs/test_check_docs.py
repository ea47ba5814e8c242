# SPDX-License-Identifier: Apache-2.0
"""check_docs.py on the real docs (no problem) and on small docs that break each rule."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import check_docs  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def doc(tmp_path, text, name="doc.md"):
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


def test_repository_docs_have_no_problem():
    assert check_docs.check(ROOT) == []


def test_every_checked_doc_exists():
    missing = [d for d in check_docs.DOCS if not os.path.exists(os.path.join(ROOT, d))]
    assert missing == []


def test_broken_links_and_anchors_are_caught(tmp_path):
    doc(tmp_path, "# Title\n\n## The `--x` flag (two)\n\ntext\n", "docs/b.md")
    doc(tmp_path, "[ok](docs/b.md#the---x-flag-two) [ok2](docs/b.md) [web](https://x.y/z)\n"
                  "[gone](docs/c.md) [bad anchor](docs/b.md#nope) [self](#here)\n"
                  "```\n[in code](nowhere.md)\n```\n", "README.md")
    problems = check_docs.check_links(str(tmp_path), ["README.md", "docs/b.md"])
    assert problems == [
        "README.md:2: link docs/c.md: docs/c.md does not exist",
        "README.md:2: link docs/b.md#nope: no heading #nope in docs/b.md",
        "README.md:2: link #here: no heading #here in README.md",
    ]


def test_repeated_headings_get_numbered_anchors():
    assert check_docs.anchors_of("# A\n## Sub\n## Sub\n") == {"a", "sub", "sub-1"}


def test_server_flag_table_checks_names_and_defaults(tmp_path):
    path = doc(tmp_path, "## Flags\n\n| flag | default | meaning |\n|---|---|---|\n"
                         "| `--port` | 50051 | right |\n"
                         "| `--max_tickets`, `--ticket_bytes` | 256, 2 GiB | one wrong |\n"
                         "| `--head_step_timeout` | 5m | wrong |\n"
                         "| `--no_such_flag` | 1 | missing |\n")
    problems = check_docs.check_flag_tables(ROOT, [path])
    assert len(problems) == 3, problems
    assert "--ticket_bytes default is 4ull << 30" in problems[0]
    assert "--head_step_timeout default is absl::Minutes(10)" in problems[1]
    assert "--no_such_flag is not a flag of lossd" in problems[2]


def test_lossctl_table_is_checked_against_lossctl(tmp_path):
    path = doc(tmp_path, "## lossctl\n\n| flag | default | meaning |\n|---|---|---|\n"
                         "| `--target` | localhost:50051 | right |\n"
                         "| `--deadline_seconds` | 60 | wrong |\n"
                         "| `--ticket_bytes` | 4 GiB | lossd's, not lossctl's |\n")
    problems = check_docs.check_flag_tables(ROOT, [path])
    assert len(problems) == 2, problems
    assert "--deadline_seconds default is 600" in problems[0]
    assert "--ticket_bytes is not a flag of lossctl" in problems[1]


def test_commands_and_their_flags_are_caught(tmp_path):
    path = doc(tmp_path, "Run `lossd --port=0 --no_port` and `lossctl compute --bt=2 --nope`,\n"
                         "`lossctl frobnicate` and `lossctl head step --rank=0`,\n"
                         "`lossctl head fly`; `--made_up_flag` anywhere.\n")
    problems = check_docs.check_flag_names(ROOT, [path])
    assert sorted(p.split(": ", 1)[1] for p in problems) == sorted([
        "--no_port is defined by no program here",
        "--nope is defined by no program here",
        "--made_up_flag is defined by no program here",
        "lossd --no_port: no such lossd flag",
        "lossctl --nope: no such lossctl flag",
        "lossctl frobnicate: no such command",
        "lossctl head fly: no such command",
    ]), problems


def test_every_lossd_flag_must_be_documented():
    flags = check_docs.absl_flags(ROOT, ["service/flags.cc"])
    assert len(flags) > 40 and "ticket_bytes" in flags and "head_export_dir" in flags
    assert check_docs.check_flags_documented(ROOT) == []


def test_metrics_names_labels_and_siblings_are_checked(tmp_path):
    path = doc(tmp_path, "`lossd_tickets`, `lossd_max_tickets`, `lossd_ticket_budget_bytes`\n"
                         "`lossd_requests_total{method,code}` `lossd_head_steps_total{phase}`\n"
                         "`lossd_ticket_bytes_total` `lossd_request_duration_seconds_bucket`\n"
                         "`lossd_gpu_memory_used_bytes`, `_total_bytes`, `_spare_bytes`\n")
    problems = check_docs.check_metrics(ROOT, [path])
    assert len(problems) == 3, problems
    assert "lossd_head_steps_total{phase}: lossd's labels are {outcome}" in problems[0]
    assert "metric lossd_ticket_bytes_total is not registered" in problems[1]
    assert "_spare_bytes: no lossd metric ends so" in problems[2]


def test_metrics_registered_with_their_labels():
    metrics = check_docs.registered_metrics(ROOT)
    assert metrics["lossd_requests_total"] == {"method", "code"}
    assert metrics["lossd_build_info"] == {"version", "commit", "backend", "cuda_plugin"}
    assert {"lossd_ticket_budget_bytes", "lossd_max_tickets", "process_open_fds"} <= set(metrics)


def test_alert_table_must_match_the_rules(tmp_path):
    doc(tmp_path, "groups:\n  - rules:\n      - alert: LossdA\n      - alert: LossdB\n",
        "deploy/prometheus/rules/a.yml")
    doc(tmp_path, "| alert | fires when |\n|---|---|\n| LossdA | x |\n| LossdC | y |\n",
        "deploy/README.md")
    assert check_docs.check_alerts(str(tmp_path)) == [
        "deploy/README.md: alert LossdC is in the table but in no rule file",
        "deploy/README.md: alert LossdB of deploy/prometheus/rules is not in the table",
    ]


def test_bazel_targets_must_exist(tmp_path):
    path = doc(tmp_path, "`//service:lossd` `//client:pooled_client_tickets_test` `//engine/...`\n"
                         "`//service:no_such_target` `//nowhere:x` `dns:///name:50051`\n")
    problems = check_docs.check_bazel_targets(ROOT, [path])
    assert [p.split(": ", 1)[1] for p in problems] == [
        "//service:no_such_target: no such target", "//nowhere: no BUILD file there"]


def test_python_names_must_resolve(tmp_path):
    path = doc(tmp_path, "`lossd.Client`, `lossd.rl.LossdFusedLinearGRPOLoss`, `lossd.v1.Loss`\n"
                         "`lossd.Nope`, `lossd.rl.nope`, `lossd.v1.NoSuchMessage`, lossd.slice\n")
    problems = check_docs.check_python_api(ROOT, [path])
    assert [p.split(": ", 1)[1] for p in problems] == [
        "lossd.Nope does not exist in client/python",
        "lossd.rl.nope does not exist in client/python",
        "lossd.v1.NoSuchMessage is not in lossd.proto",
    ], problems


def test_paths_in_code_spans_must_exist(tmp_path):
    path = doc(tmp_path, "`service/main.cc`, `kernels/cpu/reference` (its .h and .cc),\n"
                         "`deploy/k8s/overlays/gpu-single`, `bazel-bin/service/lossd`,\n"
                         "`service/no_such_file.cc`, `deploy/k8s/overlays/gpu-double`\n"
                         "```\ntools/docs/nothing.py --flag\n```\n")
    problems = check_docs.check_paths(ROOT, [path])
    assert [p.split(": ", 1)[1] for p in problems] == [
        "service/no_such_file.cc does not exist",
        "deploy/k8s/overlays/gpu-double does not exist",
        "tools/docs/nothing.py does not exist",
    ], problems


def test_bare_file_names_must_exist_somewhere(tmp_path):
    path = doc(tmp_path, "`two_phase_logprob_pool_test.cc` and `test_rl_two_phase.py` exist;\n"
                         "`two_phase_logprob_gone_test.cc` does not.\n")
    problems = check_docs.check_paths(ROOT, [path])
    assert [p.split(": ", 1)[1] for p in problems] == [
        "two_phase_logprob_gone_test.cc: no file of that name here"], problems


def test_bare_test_names_must_exist(tmp_path):
    path = doc(tmp_path, "`tickets_test`, `:kinds_bench`, `lossd_help_test` and `test_rules`;\n"
                         "`tickets_gone_test` is not.\n")
    problems = check_docs.check_test_names(ROOT, [path])
    assert [p.split(": ", 1)[1] for p in problems] == [
        "tickets_gone_test: no Bazel target or script of that name"], problems


def test_environment_variables_must_be_read_somewhere(tmp_path):
    path = doc(tmp_path, "`LOSSD_HEAD_EXPORT_DIR_BASE`, `LOSSD_BIN` and `FUZZ_SECONDS` are read;\n"
                         "`LOSSD_NO_SUCH_SETTING` is not.\n")
    problems = check_docs.check_env_vars(ROOT, [path])
    assert [p.split(": ", 1)[1] for p in problems] == [
        "LOSSD_NO_SUCH_SETTING: no script or program reads it"], problems


def test_code_names_must_exist(tmp_path):
    path = doc(tmp_path, "`TwoPhaseLogprob`, `PoolOptions::tickets_kept`, `STATE_TICKET`,\n"
                         "`LossdTicketBudgetNearlyFull`; `TwoPhaseRouter` and\n"
                         "`PoolOptions::tickets_remembered` are not.\n")
    problems = check_docs.check_code_names(ROOT, [path])
    assert [p.split(": ", 1)[1] for p in problems] == [
        "TwoPhaseRouter: no source names TwoPhaseRouter",
        "PoolOptions::tickets_remembered: no source names tickets_remembered",
    ], problems
