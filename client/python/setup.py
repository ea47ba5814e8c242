"""Builds the lossd wheel, generating the gRPC stubs from proto/lossd/v1/lossd.proto.

The proto is found by walking up from this folder to the repository's proto/ (or at
$LOSSD_PROTO_ROOT). The stubs are written into the build directory only, so the wheel carries
them and the source tree never does. The generated code requires grpcio and protobuf at least
as new as the generator, so those lower bounds are computed here.
"""

import importlib.util
import os
import re
import shutil
import tempfile

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


def _load_protogen():
    spec = importlib.util.spec_from_file_location(
        "_lossd_protogen", os.path.join(HERE, "lossd", "_protogen.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_gen = _load_protogen()
_PROTO_ROOT = _gen.find_proto_root(HERE)
if _PROTO_ROOT is None:
    raise RuntimeError("proto/lossd/v1/lossd.proto not found above %s; set %s" % (
        HERE, _gen.ENV_PROTO_ROOT))


def _requirements():
    from grpc_tools import grpc_version

    tmp = tempfile.mkdtemp()
    try:
        pkg = _gen.generate(_PROTO_ROOT, tmp)
        with open(os.path.join(pkg, "lossd_pb2.py")) as f:
            m = re.search(r"Protobuf Python Version: (\d+\.\d+\.\d+)", f.read())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    reqs = ["numpy>=1.22", "grpcio>=%s" % grpc_version.VERSION, "grpcio-health-checking"]
    reqs.append("protobuf>=%s" % m.group(1) if m else "protobuf")
    return reqs


class BuildPyWithStubs(build_py):
    def run(self):
        super().run()
        _gen.generate(_PROTO_ROOT, self.build_lib)


setup(install_requires=_requirements(), cmdclass={"build_py": BuildPyWithStubs})
