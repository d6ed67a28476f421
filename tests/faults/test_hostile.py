"""Case 8 of docs/faults.md: a registry serving eStargz layers whose TOC is hostile.

Each blob is made by hand: a benign first gzip member (what containerd unpacks when we fall
back), a TOC member with the hostile JSON (or tar header), a valid footer. The daemon must
reject the TOC with a clear error in its fallback line (containerd then pulls the layer itself),
never write anything outside its root, and never hang.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from tests.faults import imagekit
from tests.faults.conftest import MAX_TOC_BYTES, RESOLVE_TIMEOUT, FaultLab, fallback_line

MARK = f"faultmark-{uuid.uuid4().hex[:12]}"


def _toc(entries: list[dict[str, object]]) -> dict[str, object]:
    return {"version": 1, "entries": entries}


# name -> (TOC doc, hostile_estargz kwargs, expected reason, words the error must contain, the
# benign tar is valid so the fallback pull and a container must work)
CASES: dict[str, tuple[dict[str, object], dict[str, int], str, tuple[str, ...], bool]] = {
    "dotdot": (_toc([{"name": f"../../../../../../tmp/{MARK}-dotdot", "type": "reg", "size": 0}]),
               {}, "bad_format", ("'..'",), True),
    "absolute": (_toc([{"name": f"/tmp/{MARK}-abs", "type": "reg", "size": 0}]),
                 {}, "bad_format", ("absolute",), True),
    "through-symlink": (_toc([{"name": "esc", "type": "symlink", "linkName": "../../../../../../tmp"},
                              {"name": f"esc/{MARK}-sym", "type": "reg", "size": 0}]),
                        {}, "bad_format", ("inside", "symlink"), True),
    "hardlink-cycle": (_toc([{"name": "a", "type": "hardlink", "linkName": "b"},
                             {"name": "b", "type": "hardlink", "linkName": "a"}]),
                       {}, "bad_format", ("cycle",), True),
    "10GB-file": (_toc([{"name": f"{MARK}-huge", "type": "reg", "size": 10 << 30, "offset": 1}]),
                  {}, "bad_format", ("10737418240",), True),
    "1GB-toc-claimed": (_toc([]), {"claimed_json_size": 1 << 30}, "limit_exceeded", ("1073741824",), False),
    "toc-bomb": (_toc([]), {"trailing_zeros": 4 * MAX_TOC_BYTES}, "bad_format", ("TOC",), True),
}


def _marks_anywhere(flab: FaultLab) -> list[str]:
    """Files named after MARK where a hostile name could have landed: next to the lab and in
    /tmp (where the '..' and absolute names point), and anywhere in the daemon root but the
    FUSE mountpoints."""
    found: list[str] = []
    for d in (Path("/"), Path("/tmp"), flab.lab.dir, flab.lab.dir.parent):
        found += [str(p) for p in d.glob(f"{MARK}*")]
    for dirpath, dirnames, filenames in os.walk(flab.root):
        if Path(dirpath) == flab.root / "mounts":
            dirnames.clear()
        found += [os.path.join(dirpath, n) for n in dirnames + filenames if n.startswith(MARK)]
    return found


@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_toc_is_rejected_and_falls_back(flab: FaultLab, case: str) -> None:
    toc, kwargs, reason, words, runnable = CASES[case]
    layer = imagekit.hostile_estargz(toc, **kwargs)  # type: ignore[arg-type]
    repo = f"hostile-{case.lower()}"
    ref = imagekit.push_image(flab.registry, repo, [imagekit.busybox_layer(), layer])
    r = flab.lab.ctr_remote("image", "rpull", "--plain-http", "--snapshotter", "lazy", ref, check=False, timeout=60)
    line = fallback_line(flab.daemon_log(), layer.digest)
    assert line is not None, f"no fallback for the hostile layer; rpull said {r.stderr}"
    assert f"reason={reason}" in line, line
    assert all(w in line for w in words), line
    assert float(line.split("seconds=")[1].split()[0]) < RESOLVE_TIMEOUT
    if runnable:
        assert r.returncode == 0, r.stderr
        code, out = flab.run(ref, f"hostile-{case.lower()}", "cat", "/ok.txt")
        assert code == 0 and out == "benign\n", out
    else:
        # The blob is broken for any puller (its tar header lies): containerd's unpack fails, promptly.
        assert r.returncode != 0
    kept = flab.root / "layers" / layer.digest.split(":")[1]
    assert not any((kept / n).exists() for n in ("index.bin", "index.json", "meta.json")), \
        "an index of the rejected layer was kept"
    assert not _marks_anywhere(flab), "a hostile name was written"


def test_symlink_loop_is_served_and_reads_fail_with_eloop(flab: FaultLab) -> None:
    """A symlink loop is legal in a tar (overlayfs pulls give the same tree): it is not rejected,
    and resolving it fails with ELOOP in the kernel, without hanging the mount."""
    toc = _toc([{"name": "loop1", "type": "symlink", "linkName": "loop2"},
                {"name": "loop2", "type": "symlink", "linkName": "loop1"},
                {"name": "ok.txt", "type": "reg", "size": 0}])
    layer = imagekit.hostile_estargz(toc)
    ref = imagekit.push_image(flab.registry, "hostile-symloop", [imagekit.busybox_layer(), layer])
    flab.rpull(ref)
    assert fallback_line(flab.daemon_log(), layer.digest) is None, "a symlink loop is a valid layer"
    code, out = flab.run(ref, "hostile-symloop", "sh", "-c", "cat /loop1; echo rc=$?; readlink /loop1; ls /")
    assert code == 0, out
    assert "Symbolic link loop" in out or "Too many levels of symbolic links" in out, out
    assert "rc=1" in out and "loop2" in out and "bin" in out
