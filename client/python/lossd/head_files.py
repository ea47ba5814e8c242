# SPDX-License-Identifier: Apache-2.0
"""The files lossd writes its hosted heads to as it drains (--head_export_dir;
docs/hosted_head.md), read back as a HeadExport that Client.import_head (or
Client.import_head_into_group) takes.

A one-server head's file is the whole head, which lossd imports by itself at its next start. A
head group's member writes its part (its ZeRO-1 slices of the master and the optimizer state,
<head>.member-<m>-of-<S>.lossd-head), which lossd never imports by itself (a member never
rejoins a group): read_head_files(the S parts) puts the head together.

The file: b"LOSSDHEAD1\\n"; the owner as a little-endian uint32 length and its bytes; the
ExportHeader (lossd.v1) as a uint32 length and its bytes; then the tensors the header lists,
one after another (a part lists each tensor as its (slice) fp32 slice).
"""

import struct

import numpy as np

from lossd import errors
from lossd._heads import _NAME_OF, OptimizerConfig
from lossd._proto import pb
from lossd._results import HeadExport
from lossd.tensors import dtype_name, from_wire

_MAGIC = b"LOSSDHEAD1\n"
_MAX_RECORD = 1 << 20  # as service/head_files.cc: an owner or header is small


def _record(f, path, what):
    n = f.read(4)
    if len(n) != 4:
        raise errors.DataLossError("%s ends before its %s" % (path, what))
    (size,) = struct.unpack("<I", n)
    if size > _MAX_RECORD:
        raise errors.DataLossError("%s: its %s claims %d bytes" % (path, what, size))
    data = f.read(size)
    if len(data) != size:
        raise errors.DataLossError("%s ends inside its %s" % (path, what))
    return data


def read_head_file(path):
    """(owner, ExportHeader, {tensor name: ndarray}) of one file, whole or a member's part,
    each tensor as the header lists it (a part's are flat fp32 slices)."""
    path = str(path)
    with open(path, "rb") as f:
        if f.read(len(_MAGIC)) != _MAGIC:
            raise errors.DataLossError("%s is not an exported head (no magic)" % path)
        owner = _record(f, path, "owner").decode("utf-8", "replace")
        header = pb.ExportHeader()
        header.ParseFromString(_record(f, path, "header"))
        tensors = {}
        for tid, spec in zip(header.tensors, header.specs):
            shape = tuple(int(s) for s in spec.shape)
            nbytes = int(np.prod(shape, dtype=np.int64)) * (4 if spec.dtype == pb.DTYPE_FP32
                                                            else 2)
            buf = bytearray(f.read(nbytes))
            if len(buf) != nbytes:
                raise errors.DataLossError("%s ends inside %s" % (path, _NAME_OF.get(tid)))
            tensors[_NAME_OF[tid]] = from_wire(spec.dtype, shape, buf)
        if f.read(1):
            raise errors.DataLossError("%s holds more than its header describes" % path)
    return owner, header, tensors


def _export(header, tensors):
    h = header.head
    return HeadExport(name=h.name, version=h.version, optimizer_step=h.optimizer_step,
                      optimizer=OptimizerConfig.from_proto(h.optimizer),
                      compute_dtype=dtype_name(h.compute_dtype), tensors=tensors,
                      instance=header.instance, ranges=0)


def read_head_files(paths):
    """The HeadExport in one whole file, or put together from the S parts a head group's
    members wrote (any order; every member's, all of one group, head and version). A part
    holds no compute copy: an import makes it from the master."""
    if isinstance(paths, (str, bytes)) or not hasattr(paths, "__iter__"):
        paths = [paths]
    files = [(str(p),) + read_head_file(p) for p in paths]
    if not files:
        raise errors.InvalidArgumentError("read_head_files needs at least one file")
    groups = [hd.head.group for _, _, hd, _ in files]
    if len(groups[0].members) <= 1:
        if len(files) != 1:
            raise errors.InvalidArgumentError(
                "%s holds a whole head: read it alone, not with %d other files" % (
                    files[0][0], len(files) - 1))
        return _export(files[0][2], files[0][3])
    first = files[0][2].head
    S = len(groups[0].members)
    by_member = {}
    for path, _, hd, t in files:
        h, g = hd.head, hd.head.group
        if (h.name, h.version, g.id, list(g.members)) != (
                first.name, first.version, groups[0].id, list(groups[0].members)):
            raise errors.InvalidArgumentError(
                "%s is a part of head %r version %d of group %r; %s is of head %r version "
                "%d of group %r: the parts of one head's export only" % (
                    path, h.name, h.version, g.id, files[0][0], first.name, first.version,
                    groups[0].id))
        if g.member in by_member:
            raise errors.InvalidArgumentError("%s and %s are both member %d's part" % (
                by_member[g.member][0], path, g.member))
        by_member[g.member] = (path, t)
    missing = sorted(set(range(S)) - set(by_member))
    if missing:
        raise errors.InvalidArgumentError(
            "head %r of group %r has %d members: the parts of member(s) %s are missing" % (
                first.name, groups[0].id, S, ", ".join(map(str, missing))))
    shapes = {"w": tuple(int(s) for s in first.w.shape)}
    shapes["bias"] = (shapes["w"][0],)
    tensors = {}
    for name in by_member[0][1]:
        whole = np.concatenate([by_member[m][1][name] for m in range(S)])
        tensors[name] = whole.reshape(shapes["bias" if name.endswith("_bias") else "w"])
    return _export(files[0][2], tensors)
