# SPDX-License-Identifier: Apache-2.0
"""Makes lossd.proto's serialized FileDescriptorProto (lossd/v1/lossd.binpb), from which
lossd.v1.lossd_pb2 builds the message classes at import, and finds it again at import.

Standard library only at the top, so setup.py can load this file before anything is installed.
It never writes into the source tree: setup.py points it at the build directory, and the lazy
path (running from a checkout without installing) at a per-user cache directory.
"""

import hashlib
import os
import shutil
import tempfile

PROTO_REL = os.path.join("lossd", "v1", "lossd.proto")
DESCRIPTOR_REL = os.path.join("lossd", "v1", "lossd.binpb")
ENV_PROTO_ROOT = "LOSSD_PROTO_ROOT"


def find_proto_root(start):
    """Returns the folder that holds lossd/v1/lossd.proto: $LOSSD_PROTO_ROOT, else the first
    `proto/` folder found walking up from `start` (the repository layout, and an unpacked
    sdist, which carries proto/), else None."""
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
    """Writes out_dir/lossd/v1/lossd.binpb (protoc's FileDescriptorProto of lossd.proto);
    returns its path. Needs grpcio-tools (for protoc) and so protobuf. Raises RuntimeError."""
    try:
        from google.protobuf import descriptor_pb2
        from grpc_tools import protoc  # imported here: only needed when generating
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise RuntimeError(
            "making lossd.proto's descriptor needs grpcio-tools (pip install grpcio-tools)"
        ) from e
    out = os.path.join(out_dir, DESCRIPTOR_REL)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    fd, set_path = tempfile.mkstemp(suffix=".pb")
    os.close(fd)
    try:
        rc = protoc.main(["grpc_tools.protoc", "-I" + proto_root,
                          "--descriptor_set_out=" + set_path,
                          os.path.join(proto_root, PROTO_REL)])
        if rc != 0:
            raise RuntimeError("protoc failed (exit %d) on %s"
                               % (rc, os.path.join(proto_root, PROTO_REL)))
        with open(set_path, "rb") as f:
            files = descriptor_pb2.FileDescriptorSet.FromString(f.read()).file
    finally:
        os.remove(set_path)
    # lossd.proto imports nothing, so the set holds exactly its own file.
    if len(files) != 1:
        raise RuntimeError("expected one file in lossd.proto's descriptor set, got %d" % len(files))
    with open(out, "wb") as f:
        f.write(files[0].SerializeToString())
    return out


def generate_cached(proto_root):
    """Generates once per proto content into a cache folder; returns the descriptor's path."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    final = os.path.join(base, "lossd", "descriptors", proto_digest(proto_root))
    if os.path.isfile(os.path.join(final, DESCRIPTOR_REL)):
        return os.path.join(final, DESCRIPTOR_REL)
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
    return os.path.join(final, DESCRIPTOR_REL)


def load_descriptor():
    """lossd.proto's serialized FileDescriptorProto: the one the installed package carries,
    else (a checkout) one made from the repository's proto/ into the per-user cache."""
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.join(os.path.dirname(here), DESCRIPTOR_REL)
    if not os.path.isfile(path):
        root = find_proto_root(here)
        if root is None:
            raise ImportError(
                "lossd: the package has no lossd.binpb and no proto/lossd/v1/lossd.proto was "
                "found (install the package with pip, or set %s to the repository's proto/ "
                "folder)" % ENV_PROTO_ROOT)
        path = generate_cached(root)
    with open(path, "rb") as f:
        return f.read()
