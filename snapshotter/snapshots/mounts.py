"""Mount computation, exactly as containerd's overlay snapshotter does it. Pure.

- no parents:                 bind of the snapshot's fs dir, "rw" (active) or "ro" (view), rbind
- view of exactly one parent: ro rbind of the parent's fs dir
- otherwise:                  overlay, lowerdir = parents' fs dirs nearest first,
                              plus upperdir/workdir for an active snapshot

Our extension: with data-only layers (a lazy image's FUSE mount under its metadata image, see
fusefs/metaimage.py) it is always an overlay, even for a view of one parent, with `metacopy=on`
and the data layers after "::" (`lowerdir=meta/1:local:meta/0::fuse`, Linux 6.5+): a bind mount of
a metadata image alone would show files without their bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from snapshotter.snapshots.model import Kind, Mount


def compute_mounts(
    kind: Kind,
    snapshot_id: str,
    lower_dirs: Sequence[str],
    *,
    upper_dir: Callable[[str], str],
    work_dir: Callable[[str], str],
    extra_options: Sequence[str] = (),
    data_dirs: Sequence[str] = (),
) -> list[Mount]:
    """Mounts for snapshot `snapshot_id` of `kind` over `lower_dirs` (nearest parent first).

    lower_dirs are already resolved to directories (a parent's fs dir, or a lazy mount's tree).
    extra_options (e.g. "index=off") are added to overlay mounts only. data_dirs: data-only
    lower layers that metacopy files of lower_dirs redirect into (needs lower_dirs).
    """
    if data_dirs and not lower_dirs:
        raise ValueError("data-only layers need a lower layer above them")
    if not lower_dirs:
        flag = "ro" if kind is Kind.VIEW else "rw"
        return [Mount("bind", upper_dir(snapshot_id), (flag, "rbind"))]
    options: list[str] = []
    if kind is Kind.ACTIVE:
        options += [f"workdir={work_dir(snapshot_id)}", f"upperdir={upper_dir(snapshot_id)}"]
    elif len(lower_dirs) == 1 and not data_dirs:
        return [Mount("bind", lower_dirs[0], ("ro", "rbind"))]
    options += list(extra_options)
    if data_dirs:
        options.append("metacopy=on")
    options.append("lowerdir=" + ":".join(lower_dirs) + "".join("::" + d for d in data_dirs))
    return [Mount("overlay", "overlay", tuple(options))]
