# SPDX-License-Identifier: Apache-2.0
"""Loads the wire messages as `pb` and the Loss service's stub as `pb_grpc`.

Both are built at import by the installed protobuf and grpcio from lossd.proto's descriptor
(lossd/v1): the package carries the descriptor, made when it was built (setup.py); running
from a checkout without installing, it is made on first import from the repository's
proto/lossd/v1/lossd.proto into a per-user cache. Nothing generated is ever committed.
"""

from lossd.v1 import lossd_pb2 as pb
from lossd.v1 import lossd_pb2_grpc as pb_grpc

__all__ = ["pb", "pb_grpc"]
