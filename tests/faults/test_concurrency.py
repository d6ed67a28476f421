"""Case 7 of docs/faults.md: 20 containers of one image started at once share one mount process
and fetch every chunk once (counted at the proxy)."""

from __future__ import annotations

import hashlib
import re
import threading
from collections import Counter

from integration.lab import wait_until
from tests.faults import imagekit
from tests.faults.conftest import FaultLab, fallback_line
from tests.faults.proxy import Rule

N = 20


def test_twenty_containers_share_one_mount_and_one_fetch_per_chunk(flab: FaultLab) -> None:
    files = {"/data/shared.bin": imagekit.images.deterministic_bytes(1_000_000, seed=7001)}
    pushed = imagekit.push_lazy(flab.registry, "crowd", files)
    log_before = len(flab.daemon_log())  # the mount may start with the pull (mount_on_pull)
    flab.rpull(pushed.ref)
    assert fallback_line(flab.daemon_log(), pushed.data_layer) is None
    layer_path = f"/blobs/{pushed.data_layer}"
    before = len(flab.proxy.seen(layer_path))
    # Slow answers, so the containers' reads of the same chunks overlap.
    flab.proxy.add(Rule("delay", path=layer_path, seconds=0.4))
    expected = hashlib.sha256(files["/data/shared.bin"]).hexdigest()
    ids = [f"crowd-{i}" for i in range(N)]
    errors: list[str] = []

    def start(cid: str) -> None:
        r = flab.lab.ctr_run(pushed.ref, cid, "sh", "-c", "sha256sum /data/shared.bin > /sum; sleep 120",
                             detach=True, check=False, timeout=90)
        if r.returncode != 0:
            errors.append(f"{cid}: {r.stderr}")

    threads = [threading.Thread(target=start, args=(cid,)) for cid in ids]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        uppers = {}
        for cid in ids:
            mounts = flab.lab.ctr("snapshots", "--snapshotter", "lazy", "mounts", "/x", cid).stdout
            m = re.search(r"upperdir=([^,\s]+)", mounts)
            assert m, mounts
            uppers[cid] = m.group(1)

        def all_done() -> bool:
            return all(_read(f"{u}/sum").strip() for u in uppers.values())

        wait_until("every container to checksum the file", all_done, 60)
        sums = {cid: _read(f"{u}/sum").split()[0] for cid, u in uppers.items()}
        assert set(sums.values()) == {expected}, sums

        # One mount process served them all.
        started = re.findall(r"event=mount_started mount=(\d+)", flab.daemon_log()[log_before:])
        assert len(started) == 1, started
        assert len(flab.mount_pids(started[0])) == 1
        # Every byte range of the layer was fetched once.
        got = flab.proxy.seen(layer_path)[before:]
        ranges = Counter(r.range for r in got)
        assert got and all(r.status == 206 for r in got), got
        assert max(ranges.values()) == 1, f"ranges fetched more than once: {ranges}"
        spans = sorted(tuple(int(x) for x in r.removeprefix("bytes=").split("-")) for r in ranges)
        assert all(a[1] < b[0] for a, b in zip(spans, spans[1:], strict=False)), f"overlapping ranges: {spans}"
    finally:
        flab.kill_tasks(*ids)


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


