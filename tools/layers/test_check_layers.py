# SPDX-License-Identifier: Apache-2.0
"""check_layers.py on the real tree (no violation) and on small trees that break each rule."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import check_layers  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def write(root, rel, text):
    path = os.path.join(root, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def test_repository_has_no_violation():
    assert check_layers.check_tree(ROOT) == []


def test_every_layer_of_the_map_exists():
    for layer in check_layers.ALLOWED:
        assert os.path.isdir(os.path.join(ROOT, layer)), layer


def test_upward_include_is_caught(tmp_path):
    write(tmp_path, "engine/plan.cc", '#include "core/dtype.h"\n#include "service/log.h"\n')
    problems = check_layers.check_tree(str(tmp_path))
    assert len(problems) == 1
    assert problems[0].startswith("engine/plan.cc:2: engine includes service/log.h")


def test_sideways_include_is_caught(tmp_path):
    write(tmp_path, "client/c.cc", '#include "kernels/backend.h"\n')
    write(tmp_path, "kernels/k.h", '#include "wire/part_codec.h"\n')
    problems = check_layers.check_tree(str(tmp_path))
    assert [p.split(":")[0] for p in problems] == ["client/c.cc", "kernels/k.h"]


def test_grpc_and_protobuf_never_reach_kernels_engine_or_core(tmp_path):
    write(tmp_path, "kernels/cuda/a.cc", "#include <grpcpp/grpcpp.h>\n")
    write(tmp_path, "engine/b.h", '#include "google/protobuf/message.h"\n')
    write(tmp_path, "core/c.h", '#include "lossd/v1/lossd.pb.h"\n')
    problems = check_layers.check_tree(str(tmp_path))
    assert len(problems) == 3, problems


def test_tests_may_use_testing_and_the_oracle_but_production_may_not(tmp_path):
    write(tmp_path, "client/x_test.cc",
          '#include "testing/test_util.h"\n#include "kernels/cpu/reference.h"\n')
    write(tmp_path, "client/x.cc", '#include "testing/test_util.h"\n')
    problems = check_layers.check_tree(str(tmp_path))
    assert len(problems) == 1 and problems[0].startswith("client/x.cc:1:"), problems


def test_top_level_folders_are_free(tmp_path):
    write(tmp_path, "tests/e2e.cc", '#include "service/loss_server.h"\n')
    write(tmp_path, "bench/b.cc", '#include "kernels/cuda/fused_loss.h"\n')
    assert check_layers.check_tree(str(tmp_path)) == []
