"""Mount computation, exactly as containerd's overlay snapshotter does it. Pure.

- no parents:                 bind of the snapshot's fs dir, "rw" (active) or "ro" (view), rbind
- view of exactly one parent: ro rbind of the parent's fs dir
- otherwise:                  overlay, lowerdir = parents' fs dirs nearest first,
                              plus upperdir/workdir for an active snapshot
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
) -> list[Mount]:
    """Mounts for snapshot `snapshot_id` of `kind` over `lower_dirs` (nearest parent first).

    lower_dirs are already resolved to directories (a parent's fs dir, or a lazy mount's tree).
    extra_options (e.g. "index=off") are added to overlay mounts only.
    """
    if not lower_dirs:
        flag = "ro" if kind is Kind.VIEW else "rw"
        return [Mount("bind", upper_dir(snapshot_id), (flag, "rbind"))]
    options: list[str] = []
    if kind is Kind.ACTIVE:
        options += [f"workdir={work_dir(snapshot_id)}", f"upperdir={upper_dir(snapshot_id)}"]
    elif len(lower_dirs) == 1:
        return [Mount("bind", lower_dirs[0], ("ro", "rbind"))]
    options += list(extra_options)
    options.append("lowerdir=" + ":".join(lower_dirs))
    return [Mount("overlay", "overlay", tuple(options))]
