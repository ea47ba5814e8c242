"""Loads the generated stubs as `pb` (messages) and `pb_grpc` (service stub).

An installed package carries stubs generated at build time (setup.py). Running from a
checkout without installing, the stubs are generated on first import from the repository's
proto/lossd/v1/lossd.proto into a per-user cache; nothing generated is ever committed.
"""

import os

import lossd as _pkg

try:
    from lossd.v1 import lossd_pb2 as pb
    from lossd.v1 import lossd_pb2_grpc as pb_grpc
except ImportError:
    from lossd import _protogen

    _root = _protogen.find_proto_root(os.path.dirname(os.path.abspath(__file__)))
    if _root is None:
        raise ImportError(
            "lossd: no generated stubs in the package and no proto/lossd/v1/lossd.proto found "
            "(install the package with pip, or set %s to the repository's proto/ folder)"
            % _protogen.ENV_PROTO_ROOT
        )
    _cache = _protogen.generate_cached(_root)
    # The cache folder holds lossd/v1/...; make lossd.v1 resolve there.
    _pkg.__path__.append(os.path.join(_cache, "lossd"))
    from lossd.v1 import lossd_pb2 as pb  # noqa: E402
    from lossd.v1 import lossd_pb2_grpc as pb_grpc  # noqa: E402

__all__ = ["pb", "pb_grpc"]
