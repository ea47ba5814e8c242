#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Packs the anchors' wheel sets into parts small enough for one transfer each to a GPU host.

The anchors need two CUDA-DSL stacks that cannot share a folder (Liger-Kernel on DSL 4.8.1,
QuACK on DSL 4.6.2), and each stack's libs-cu13 wheel alone is larger than one transfer. So:
every small wheel travels as it is; each large wheel (a "tree") is unzipped, packed as
tar | xz -9 and cut into pieces; the files are then laid into part1/, part2/, ... in the order
small wheels, then the trees in the order given, part1 holding at most --first_mb (room left
for the lossd bundle that travels beside it) and every other part at most --part_mb.
Every part carries sets.txt, which names each set's files with their sha256 (and a tree's piece
count), so a host holding some of the parts knows which sets are complete
(bench/kernel/run_anchors.sh reads it), and OUT/README.md lists what is in each part.

Usage: anchor_parts.py OUT WHEEL_DIR [--first_mb N] [--part_mb N] [--cache DIR] [--xz_level N]
   (--cache: a folder of ready WHEEL_FILE_NAME.tar.xz archives of a tree, to skip its xz)
"""
import argparse
import fnmatch
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

MB = 1000 * 1000
# Each set: the wheels pip installs into one folder, and at most one tree unpacked over them.
SETS = (
    ("liger_py", ("liger_kernel-0.8.5-*.whl",), None),
    ("quack", ("quack_kernels-0.6.4-*.whl", "nvidia_cutlass_dsl-4.6.2-*.whl",
               "nvidia_cutlass_dsl_libs_base-4.6.2-*.whl", "nvidia_cutlass_dsl_libs_core-4.6.2-*.whl",
               "apache_tvm_ffi-*.whl", "torch_c_dlpack_ext-*.whl"),
     "nvidia_cutlass_dsl_libs_cu13-4.6.2-*.whl"),
    ("liger", ("liger_kernel-0.8.5-*.whl", "nvidia_cutlass_dsl-4.8.1-*.whl",
               "nvidia_cutlass_dsl_libs_base-4.8.1-*.whl", "nvidia_cutlass_dsl_libs_core-4.8.1-*.whl",
               "apache_tvm_ffi-*.whl", "torch_c_dlpack_ext-*.whl"),
     "nvidia_cutlass_dsl_libs_cu13-4.8.1-*.whl"),
)


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def find_one(wheel_dir, pattern):
    hits = sorted(f for f in os.listdir(wheel_dir) if fnmatch.fnmatch(f, pattern))
    if len(hits) != 1:
        raise SystemExit(f"want exactly one wheel matching '{pattern}' in {wheel_dir}, found "
                         f"{hits or 'none'}")
    return hits[0]


def resolve_sets(wheel_dir, sets=SETS):
    """[(set, [wheel file names], tree wheel file name or None)] from the patterns."""
    return [(name, [find_one(wheel_dir, p) for p in wheels],
             find_one(wheel_dir, tree) if tree else None) for name, wheels, tree in sets]


def pack_tree(wheel_path, out_path, cache_dir, level=9):
    """The wheel's files as tar | xz -LEVEL (a ready one from cache_dir when there is one)."""
    cached = os.path.join(cache_dir, os.path.basename(wheel_path) + ".tar.xz") if cache_dir else ""
    if cached and os.path.exists(cached):
        shutil.copyfile(cached, out_path)
        return
    with zipfile.ZipFile(wheel_path) as zf:
        if any(".data/" in n for n in zf.namelist()):
            raise SystemExit(f"{wheel_path} has a .data folder: unpacking it is not an install")
        with tempfile.TemporaryDirectory() as tmp:
            zf.extractall(tmp)
            with open(out_path, "wb") as out:
                tar = subprocess.Popen(["tar", "-cf", "-", "-C", tmp, "."], stdout=subprocess.PIPE)
                subprocess.run(["xz", f"-{level}", "-T1"], stdin=tar.stdout, stdout=out, check=True)
                if tar.wait() != 0:
                    raise SystemExit(f"tar of {wheel_path} failed")


def plan_parts(items, first_cap, cap):
    """Lays (name, size, splittable) items into parts in order: [[(name, offset, length)]].
    A splittable item is cut where a part fills; another item that does not fit the part's
    room starts the next part, and one larger than a whole part is refused."""
    parts, room = [[]], first_cap
    for name, size, splittable in items:
        offset = 0
        while offset < size:
            if room <= 0 or (not splittable and size > room):
                if not splittable and size > cap:
                    raise SystemExit(f"{name} ({size} bytes) is larger than a part ({cap})")
                parts.append([])
                room = cap
            length = min(size - offset, room) if splittable else size
            parts[-1].append((name, offset, length))
            offset += length
            room -= length
    return [p for p in parts if p]


def write_pieces(src, name, spans, out_dir):
    """Cuts `src` at the planned spans into NAME.00, NAME.01, ... in their parts' folders."""
    with open(src, "rb") as fh:
        for index, (part, offset, length) in enumerate(spans):
            fh.seek(offset)
            with open(os.path.join(out_dir, part, f"{name}.{index:02d}"), "wb") as out:
                out.write(fh.read(length))


def sets_text(sets, shas, pieces):
    lines = ["# set kind file sha256 [pieces]: written by bench/kernel/anchor_parts.py"]
    for name, wheels, tree in sets:
        lines += [f"{name} wheel {w} {shas[w]}" for w in wheels]
        if tree:
            lines.append(f"{name} tree {tree}.tar.xz {shas[tree + '.tar.xz']} {pieces[tree]}")
    return "\n".join(lines) + "\n"


def readme_text(parts, sets, sizes, first_cap):
    out = ["# Wheel sets for the in-process anchors, in parts for a GPU host",
           "", "Made by bench/kernel/anchor_parts.py; installed there by "
           "bench/kernel/run_anchors.sh (see its header for the calls). A tree is a large "
           "wheel's files as tar | xz -9, cut into NAME.00, NAME.01, ...; part1 leaves room "
           f"for the lossd bundle (part1 at most {first_cap / MB:.0f} MB).", "", "Sets:"]
    for name, wheels, tree in sets:
        out.append(f"- {name}: " + ", ".join(wheels) + (f"; tree {tree}" if tree else ""))
    for i, part in enumerate(parts, 1):
        total = sum(length for _, _, length in part)
        out += ["", f"## part{i} ({total / MB:.1f} MB)", ""]
        for name, _, length in part:
            label = name if sizes[name][1] is False else f"{name} (piece of {sizes[name][0] / MB:.1f} MB)"
            out.append(f"- {label}: {length / MB:.2f} MB")
    return "\n".join(out) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("wheel_dir")
    ap.add_argument("--first_mb", type=float, default=36.0)
    ap.add_argument("--part_mb", type=float, default=55.0)
    ap.add_argument("--cache", default="")
    ap.add_argument("--xz_level", type=int, default=9, help="0-9 (a lower one for a quick check)")
    args = ap.parse_args(argv)
    if not 0 < args.first_mb <= args.part_mb:
        ap.error(f"bad --first_mb {args.first_mb} / --part_mb {args.part_mb} (0 < first <= part)")
    sets = resolve_sets(args.wheel_dir)
    os.makedirs(args.out, exist_ok=True)
    work = os.path.join(args.out, ".work")
    os.makedirs(work, exist_ok=True)
    small = list(dict.fromkeys(w for _, wheels, _ in sets for w in wheels))
    trees = [t for _, _, t in sets if t]
    shas, sizes = {}, {}
    for w in small:
        path = os.path.join(args.wheel_dir, w)
        shas[w], sizes[w] = sha256(path), (os.path.getsize(path), False)
    for t in trees:
        packed = os.path.join(work, t + ".tar.xz")
        pack_tree(os.path.join(args.wheel_dir, t), packed, args.cache, args.xz_level)
        shas[t + ".tar.xz"], sizes[t + ".tar.xz"] = sha256(packed), (os.path.getsize(packed), True)
    items = [(n, sizes[n][0], sizes[n][1]) for n in small + [t + ".tar.xz" for t in trees]]
    parts = plan_parts(items, int(args.first_mb * MB), int(args.part_mb * MB))
    for old in os.listdir(args.out):
        if old.startswith("part"):
            shutil.rmtree(os.path.join(args.out, old))
    pieces = {}
    for i, part in enumerate(parts, 1):
        os.makedirs(os.path.join(args.out, f"part{i}"))
        for name, offset, length in part:
            if not sizes[name][1]:
                shutil.copyfile(os.path.join(args.wheel_dir, name),
                                os.path.join(args.out, f"part{i}", name))
    for t in trees:
        name = t + ".tar.xz"
        spans = [(f"part{i}", off, ln) for i, part in enumerate(parts, 1)
                 for n, off, ln in part if n == name]
        write_pieces(os.path.join(work, name), name, spans, args.out)
        pieces[t] = len(spans)
    text = sets_text(sets, shas, pieces)
    for i in range(1, len(parts) + 1):
        with open(os.path.join(args.out, f"part{i}", "sets.txt"), "w") as fh:
            fh.write(text)
    with open(os.path.join(args.out, "README.md"), "w") as fh:
        fh.write(readme_text(parts, sets, sizes, args.first_mb * MB))
    print(open(os.path.join(args.out, "README.md")).read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
