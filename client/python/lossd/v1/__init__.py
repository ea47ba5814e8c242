# SPDX-License-Identifier: Apache-2.0
"""lossd.v1: the wire messages (lossd_pb2) and the Loss service's stub (lossd_pb2_grpc),
built at import by the installed protobuf and grpcio from lossd.proto's descriptor."""
