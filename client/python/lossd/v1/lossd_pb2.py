# SPDX-License-Identifier: Apache-2.0
"""The lossd.v1 messages and enums, built at import by the installed protobuf runtime from
lossd.proto's serialized descriptor (lossd.binpb, which protoc writes when the package is
built; lossd._protogen finds it).

Never protoc's Python output: that code refuses a protobuf older than the generator, so a
wheel built with this year's grpcio-tools would demand this year's protobuf. The calls below
are the ones generated code makes itself (google.protobuf.internal.builder, protobuf >= 3.20),
so the classes are the same classes, on every runtime from that floor up.
"""

from google.protobuf import descriptor_pool as _descriptor_pool
from google.protobuf.internal import builder as _builder

from lossd import _protogen

DESCRIPTOR = _descriptor_pool.Default().AddSerializedFile(_protogen.load_descriptor())
_builder.BuildMessageAndEnumDescriptors(DESCRIPTOR, globals())
_builder.BuildTopDescriptorsAndMessages(DESCRIPTOR, __name__, globals())
