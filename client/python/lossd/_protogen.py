"""Generates the Python gRPC stubs (lossd.v1.lossd_pb2, lossd_pb2_grpc) from lossd.proto.

Standard library only, so setup.py can load this file before anything is installed. It never
writes into the source tree: setup.py points it at the build directory, and the lazy path
(running from a checkout without installing) at a per-user cache directory.
"""

import hashlib
import os
import shutil
import tempfile

PROTO_REL = os.path.join("lossd", "v1", "lossd.proto")
ENV_PROTO_ROOT = "LOSSD_PROTO_ROOT"


def find_proto_root(start):
    """Returns the folder that holds lossd/v1/lossd.proto: $LOSSD_PROTO_ROOT, else the first
    `proto/` folder found walking up from `start` (the repository layout), else None."""
    env = os.environ.get(ENV_PROTO_ROOT)
    if env:
        return env if os.path.isfile(os.path.join(env, PROTO_REL)) else None
    d = os.path.abspath(start)
    while True:
        cand = os.path.join(d, "proto")
        if os.path.isfile(os.path.join(cand, PROTO_REL)):
            return cand
        parent = os.path.dirname(d)
        if parent == d:
            return None
        d = parent


def proto_digest(proto_root):
    with open(os.path.join(proto_root, PROTO_REL), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


def generate(proto_root, out_dir):
    """Writes out_dir/lossd/v1/lossd_pb2.py and lossd_pb2_grpc.py. Raises RuntimeError."""
    try:
        from grpc_tools import protoc  # imported here: only needed when generating
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise RuntimeError(
            "generating the lossd gRPC stubs needs grpcio-tools (pip install grpcio-tools)"
        ) from e
    import importlib.resources

    well_known = str(importlib.resources.files("grpc_tools") / "_proto")
    os.makedirs(out_dir, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        "-I" + proto_root,
        "-I" + well_known,
        "--python_out=" + out_dir,
        "--grpc_python_out=" + out_dir,
        os.path.join(proto_root, PROTO_REL),
    ]
    rc = protoc.main(args)
    if rc != 0:
        raise RuntimeError("protoc failed (exit %d) on %s" % (rc, os.path.join(proto_root, PROTO_REL)))
    # The generated modules import each other as lossd.v1.*; lossd/v1 must be a package.
    pkg = os.path.join(out_dir, "lossd", "v1")
    open(os.path.join(pkg, "__init__.py"), "a").close()
    return pkg


def generate_cached(proto_root):
    """Generates once per proto content into a cache folder; returns the folder that holds
    lossd/v1 (to be added to the lossd package's __path__ as its parent 'lossd')."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    final = os.path.join(base, "lossd", "stubs", proto_digest(proto_root))
    if os.path.isfile(os.path.join(final, "lossd", "v1", "lossd_pb2_grpc.py")):
        return final
    os.makedirs(os.path.dirname(final), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".gen-", dir=os.path.dirname(final))
    try:
        generate(proto_root, tmp)
        try:
            os.replace(tmp, final)
        except OSError:
            # Another process won the race; its output is identical.
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final
