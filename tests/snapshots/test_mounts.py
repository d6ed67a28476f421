"""Mount computation matches containerd's overlay snapshotter."""

from __future__ import annotations

import pytest

from snapshotter.snapshots.model import Kind, Mount
from snapshotter.snapshots.mounts import compute_mounts


def _m(kind: Kind, lowers: list[str], extra: tuple[str, ...] = ()) -> list[Mount]:
    return compute_mounts(kind, "9", lowers, upper_dir=lambda i: f"/r/{i}/fs", work_dir=lambda i: f"/r/{i}/work",
                          extra_options=extra)


def test_no_parent_is_bind() -> None:
    assert _m(Kind.ACTIVE, []) == [Mount("bind", "/r/9/fs", ("rw", "rbind"))]
    assert _m(Kind.VIEW, []) == [Mount("bind", "/r/9/fs", ("ro", "rbind"))]


def test_view_of_one_parent_is_ro_bind_of_parent() -> None:
    assert _m(Kind.VIEW, ["/r/1/fs"]) == [Mount("bind", "/r/1/fs", ("ro", "rbind"))]


def test_active_over_parents_is_overlay_with_upper_and_work() -> None:
    (m,) = _m(Kind.ACTIVE, ["/r/2/fs", "/r/1/fs"], ("index=off",))
    assert m.type == "overlay" and m.source == "overlay"
    assert m.options == ("workdir=/r/9/work", "upperdir=/r/9/fs", "index=off", "lowerdir=/r/2/fs:/r/1/fs")


def test_view_of_many_parents_is_readonly_overlay() -> None:
    (m,) = _m(Kind.VIEW, ["/r/3/fs", "/r/2/fs", "/r/1/fs"])
    assert m.options == ("lowerdir=/r/3/fs:/r/2/fs:/r/1/fs",)
    assert not any(o.startswith(("upperdir", "workdir")) for o in m.options)


def test_data_only_layers_make_an_overlay_with_metacopy() -> None:
    """A metadata image over a lazy mount's data: always overlay (a bind of the image alone would
    show files without bytes), data layers after "::"."""
    def m(kind: Kind, lowers: list[str]) -> list[Mount]:
        return compute_mounts(kind, "9", lowers, upper_dir=lambda i: f"/r/{i}/fs",
                              work_dir=lambda i: f"/r/{i}/work", extra_options=("index=off",), data_dirs=["/m/7/mnt"])

    (view,) = m(Kind.VIEW, ["/m/7/meta/0"])
    assert view == Mount("overlay", "overlay", ("index=off", "metacopy=on", "lowerdir=/m/7/meta/0::/m/7/mnt"))
    (active,) = m(Kind.ACTIVE, ["/m/7/meta/1", "/r/2/fs", "/m/7/meta/0"])
    assert active.options == ("workdir=/r/9/work", "upperdir=/r/9/fs", "index=off", "metacopy=on",
                              "lowerdir=/m/7/meta/1:/r/2/fs:/m/7/meta/0::/m/7/mnt")
    with pytest.raises(ValueError):
        m(Kind.ACTIVE, [])
