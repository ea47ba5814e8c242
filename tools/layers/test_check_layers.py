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


def test_testing_includes_no_client_code(tmp_path):
    # The arrow that pointed up: the server's harness asking health through the client.
    write(tmp_path, "testing/server_harness.cc",
          '#include "service/loss_server.h"\n#include "client/health_check.h"\n')
    write(tmp_path, "testing/cpu/kind_test_util.h", '#include "testing/client/test_tensors.h"\n')
    problems = sorted(check_layers.check_tree(str(tmp_path)))
    assert len(problems) == 2, problems
    assert problems[0].startswith("testing/cpu/kind_test_util.h:1: testing includes "
                                  "testing/client/test_tensors.h"), problems
    assert problems[1].startswith("testing/server_harness.cc:2: testing includes "
                                  "client/health_check.h (client is not below testing)"), problems


def test_testing_client_sits_over_the_client_and_testing(tmp_path):
    write(tmp_path, "testing/client/pool_test_fixture.h",
          '#include "client/pooled_client.h"\n#include "testing/server_harness.h"\n'
          '#include "testing/client/test_tensors.h"\n#include "lossd/v1/lossd.pb.h"\n')
    write(tmp_path, "testing/client/fake.cc", '#include "engine/engine.h"\n')
    problems = check_layers.check_tree(str(tmp_path))
    assert len(problems) == 1 and problems[0].startswith(
        "testing/client/fake.cc:1: testing/client includes engine/engine.h"), problems


def test_only_tests_and_benchmarks_include_testing(tmp_path):
    # A helper beside production code is production code, whatever its name says.
    write(tmp_path, "kernels/cpu/kind_test_util.h", '#include "testing/test_util.h"\n')
    write(tmp_path, "client/fake_heads.cc", '#include "testing/byte_buffers.h"\n')
    write(tmp_path, "kernels/cpu/cpu_bench.cc", '#include "testing/test_util.h"\n')
    write(tmp_path, "kernels/cpu/cpu_kinds_test.cc", '#include "testing/cpu/kind_test_util.h"\n')
    problems = check_layers.check_tree(str(tmp_path))
    assert sorted(p.split(":")[0] for p in problems) == ["client/fake_heads.cc",
                                                         "kernels/cpu/kind_test_util.h"], problems


def test_only_client_tests_include_the_clients_test_support(tmp_path):
    write(tmp_path, "client/lossctl_test.cc", '#include "testing/client/fake_loss_service.h"\n')
    write(tmp_path, "kernels/cuda/row_loss_test.cc", '#include "testing/client/test_tensors.h"\n')
    problems = check_layers.check_tree(str(tmp_path))
    assert len(problems) == 1 and problems[0].startswith("kernels/cuda/row_loss_test.cc:1:")


def test_a_testonly_target_in_a_production_folder_is_caught(tmp_path):
    write(tmp_path, "kernels/cuda/BUILD", """
lossd_cc_library(name = "fused_loss", deps = [])

# What the GPU tests share.
[lossd_cc_header(
    name = "gpu_test_util",
    testonly = True,
    deps = ["@local_cuda//:cudart"],
) for _ in [1] if CUDA_AVAILABLE]

[lossd_gpu_test(
    name = name,
    deps = [":fused_loss", "//testing/cuda:gpu_test_util"],
) for name in ["a_test"]]
""")
    write(tmp_path, "kernels/BUILD", 'cc_binary(\n    name = "fake_plugin_v1.so",\n'
                                     '    testonly = True,\n)\n')
    write(tmp_path, "testing/cuda/BUILD", 'cc_library(\n    name = "x",\n    testonly = True,\n)\n')
    problems = sorted(check_layers.check_tree(str(tmp_path)))
    assert problems == [
        "kernels/BUILD:1: testonly cc_binary fake_plugin_v1.so in a production folder "
        "(test support lives in testing/)",
        "kernels/cuda/BUILD:5: testonly lossd_cc_header gpu_test_util in a production folder "
        "(test support lives in testing/)"], problems
