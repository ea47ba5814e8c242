# SPDX-License-Identifier: Apache-2.0
"""Builds the lossd wheel and sdist. Everything but the build-time steps is in pyproject.toml.

- The wheel carries lossd/v1/lossd.binpb, lossd.proto's serialized descriptor, which protoc
  (grpcio-tools, a build-time requirement only) writes into the build directory; lossd.v1 builds
  its message classes from it at import with whatever protobuf is installed, so the runtime
  floors are what the code needs, not the generator's version.
- The sdist carries proto/lossd/v1/lossd.proto, so a wheel can be built from it alone.
- Nothing is written into the source tree: the build directory and the egg-info go to a
  temporary folder (pip builds in place, where setuptools would leave build/ and *.egg-info).
The proto is found by walking up from this folder to proto/ (or at $LOSSD_PROTO_ROOT).
"""

import atexit
import importlib.util
import os
import shutil
import tempfile

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

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


class BuildPyWithDescriptor(build_py):
    def run(self):
        super().run()
        _gen.generate(_PROTO_ROOT, self.build_lib)


class SdistWithProto(sdist):
    def make_release_tree(self, base_dir, files):
        super().make_release_tree(base_dir, files)
        dest = os.path.join(base_dir, "proto", _gen.PROTO_REL)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        shutil.copyfile(os.path.join(_PROTO_ROOT, _gen.PROTO_REL), dest)


_scratch = tempfile.mkdtemp(prefix="lossd-build-")
atexit.register(shutil.rmtree, _scratch, True)

setup(
    cmdclass={"build_py": BuildPyWithDescriptor, "sdist": SdistWithProto},
    options={
        "build": {"build_base": os.path.join(_scratch, "build")},
        "egg_info": {"egg_base": _scratch},
    },
)
