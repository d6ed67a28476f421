"""Registry faults seen by the daemon and its mount processes (cases 1-3 of docs/faults.md)."""

from __future__ import annotations

import errno
import hashlib
import threading
import time

import pytest

from snapshotter.fusefs.ops import RECENT_FAILURE_SECONDS
from tests.faults import imagekit
from tests.faults.conftest import (
    FETCH_TIMEOUT,
    RESOLVE_TIMEOUT,
    FaultLab,
    assert_cache_holds_only_verified_bytes,
    cache_files,
    fallback_line,
    file_cache_keys,
)
from tests.faults.proxy import Rule

EIO_TEXT = "Input/output error"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# -- 1. registry down at resolve ------------------------------------------------------------------

@pytest.mark.parametrize("how", ["refused", "hang"])
def test_registry_down_at_resolve_falls_back_in_time(flab: FaultLab, how: str) -> None:
    seed = {"refused": 11, "hang": 12}[how]
    pushed = imagekit.push_lazy(flab.registry, f"down-resolve-{how}", imagekit.data_files(seed=seed, count=1))
    if how == "refused":
        flab.proxy.stop()
    else:
        flab.proxy.add(Rule("hang", path="/blobs/", method="HEAD", seconds=RESOLVE_TIMEOUT + 3))
        flab.proxy.add(Rule("hang", path="/blobs/", seconds=RESOLVE_TIMEOUT + 3))
    started = time.monotonic()
    flab.rpull(pushed.ref, timeout=60)
    took = time.monotonic() - started
    line = fallback_line(flab.daemon_log(), pushed.data_layer)
    assert line is not None, "no event=fallback line for the lazy layer"
    assert "level=warning" in line
    seconds = float(line.split("seconds=")[1].split()[0])
    assert seconds <= RESOLVE_TIMEOUT + 1.0, line
    assert ("reason=timeout" if how == "hang" else "reason=registry") in line, line
    assert took < 30, f"the pull took {took:.1f}s"
    # containerd downloaded and unpacked the layer itself: the container sees every byte.
    flab.proxy.start()
    flab.proxy.clear()
    code, out = flab.run(pushed.ref, f"down-resolve-{how}", "sha256sum", "/data/f0")
    assert code == 0 and out.split()[0] == sha(pushed.files["/data/f0"]), out


# -- 2. registry down after resolve ---------------------------------------------------------------

def test_registry_down_after_resolve_gives_eio_then_recovers(flab: FaultLab) -> None:
    pushed = imagekit.push_lazy(flab.registry, "down-read", imagekit.data_files(seed=21, count=3))
    flab.rpull(pushed.ref)
    assert fallback_line(flab.daemon_log(), pushed.data_layer) is None, "the data layer should be lazy"
    # One file read while the registry is up: cached.
    code, out = flab.run(pushed.ref, "down-read-warm", "sha256sum", "/data/f0")
    assert code == 0 and out.split()[0] == sha(pushed.files["/data/f0"]), out

    flab.proxy.stop()
    result: dict[str, tuple[int, str, float]] = {}

    def cold() -> None:
        t = time.monotonic()
        code, out = flab.run(pushed.ref, "down-read-cold", "sh", "-c", "cat /data/f1 > /dev/null")
        result["cold"] = (code, out, time.monotonic() - t)

    reader = threading.Thread(target=cold)
    reader.start()
    # Meanwhile another container of the image works: metadata and cached bytes need no registry.
    t = time.monotonic()
    code, out = flab.run(pushed.ref, "down-read-other", "sh", "-c", "ls /data && sha256sum /data/f0")
    other_took = time.monotonic() - t
    reader.join(60)
    assert not reader.is_alive()
    assert code == 0 and sha(pushed.files["/data/f0"]) in out and "f1" in out, out
    assert other_took < 20, f"an unrelated container waited {other_took:.1f}s"
    code, out, took = result["cold"]
    assert code != 0 and EIO_TEXT in out, out
    # ctr run itself costs a second or two; the read must give up within fetch_timeout.
    assert took < FETCH_TIMEOUT + 10, f"EIO took {took:.1f}s"

    flab.proxy.start()
    code, out = flab.run(pushed.ref, "down-read-again", "sha256sum", "/data/f1")
    assert code == 0 and out.split()[0] == sha(pushed.files["/data/f1"]), out

    # The bound, measured without ctr's overhead: a registry that accepts but never answers,
    # an uncached file read straight from the image's FUSE mount (a sleeping container keeps
    # the mount in use).
    flab.lab.ctr_run(pushed.ref, "down-read-holder", "sleep", "60", detach=True)
    try:
        mnt = next(p.parent / "mnt" for p in flab.root.glob("mounts/*/state.json")
                   if pushed.data_layer in p.read_text() and (p.parent / "pid").exists())
        target = next(mnt.glob("*/data/f2"))
        flab.proxy.add(Rule("hang", path=f"/blobs/{pushed.data_layer}", seconds=FETCH_TIMEOUT + 5))
        t = time.monotonic()
        with pytest.raises(OSError) as err:
            target.read_bytes()
        took = time.monotonic() - t
        assert err.value.errno == errno.EIO
        assert took < FETCH_TIMEOUT + 1.5, f"EIO after {took:.1f}s, fetch_timeout is {FETCH_TIMEOUT}s"
        flab.proxy.clear()
        time.sleep(RECENT_FAILURE_SECONDS + 0.1)  # a retry this soon would get the same EIO at once
        assert sha(target.read_bytes()) == sha(pushed.files["/data/f2"])
    finally:
        flab.kill_tasks("down-read-holder")


# -- 3. corrupt or wrong answers ------------------------------------------------------------------

def _chunk_keys(files: dict[str, bytes], name: str) -> set[str]:
    """The keys the file's bytes are cached under (its chunks are grouped into one read unit)."""
    return file_cache_keys(files[name])


# action, rule extras, whether a single fault is survived (retried/refetched) by the reader
FAULTS = [
    ("flip", {}, "refetch"),
    ("range", {"shift": 1}, "retry"),
    ("short", {"cut": 100}, "retry"),
    ("reset", {}, "retry"),
    ("status", {"status": 500}, "retry"),
    ("status", {"status": 503}, "retry"),
    ("status", {"status": 404}, "fail"),
    ("status", {"status": 401}, "fail"),
]


@pytest.fixture(scope="module")
def corrupt_image(flab: FaultLab) -> imagekit.Pushed:
    files = imagekit.data_files(seed=31, count=2 * len(FAULTS), size=150_000)
    pushed = imagekit.push_lazy(flab.registry, "corrupt", files)
    flab.rpull(pushed.ref)
    assert fallback_line(flab.daemon_log(), pushed.data_layer) is None
    return pushed


@pytest.mark.parametrize(("n", "action", "extra", "once"), [(i, *f) for i, f in enumerate(FAULTS)],
                         ids=[f"{a}{e.get('status', '')}" for a, e, _ in FAULTS])
def test_bad_answers_never_reach_the_cache(flab: FaultLab, corrupt_image: imagekit.Pushed, n: int, action: str,
                                           extra: dict[str, int], once: str) -> None:
    pushed = corrupt_image
    layer_path = f"/blobs/{pushed.data_layer}"
    always, single = f"/data/f{2 * n}", f"/data/f{2 * n + 1}"

    # A fault on every answer: the read fails with EIO, after a refetch for corrupt bytes.
    before = len(flab.proxy.seen(layer_path))
    flab.proxy.add(Rule(action, path=layer_path, **extra))  # type: ignore[arg-type]
    code, out = flab.run(pushed.ref, f"bad-{n}-always", "sh", "-c", f"cat {always} > /dev/null")
    assert code != 0 and EIO_TEXT in out, out
    tried = len(flab.proxy.seen(layer_path)) - before
    assert tried >= (2 if once in ("refetch", "retry") else 1), f"{tried} requests"
    flab.proxy.clear()
    # Bad bytes never land in the cache; chunks of the same answer that verified may (flip
    # corrupts one chunk of a merged range), but not all of the failed file is there.
    assert_cache_holds_only_verified_bytes(flab.root, pushed.files)
    keys = _chunk_keys(pushed.files, always)
    cached = keys & set(cache_files(flab.root))
    assert cached != keys, "every chunk of the failed read is in the cache"
    if action != "flip":
        assert not cached, "a chunk of a failed answer is in the cache"
    if action == "flip":
        logs = "".join(p.read_text(errors="replace") for p in flab.root.glob("mounts/*/log"))
        assert "fetching it again" in logs

    # A single fault: retried or refetched, the read succeeds with the right bytes.
    if once != "fail":
        flab.proxy.add(Rule(action, path=layer_path, times=1, **extra))  # type: ignore[arg-type]
        code, out = flab.run(pushed.ref, f"bad-{n}-once", "sha256sum", single)
        assert code == 0 and out.split()[0] == sha(pushed.files[single]), out
        assert _chunk_keys(pushed.files, single) <= set(cache_files(flab.root))
    # The registry healthy again: the file that failed reads correctly.
    code, out = flab.run(pushed.ref, f"bad-{n}-healed", "sha256sum", always)
    assert code == 0 and out.split()[0] == sha(pushed.files[always]), out
    assert assert_cache_holds_only_verified_bytes(flab.root, pushed.files) > 0


def test_fallback_reason_comes_from_the_status_not_the_message() -> None:
    """Found by case 1: a refused connection was reported as reason=auth whenever the message
    (ports, digests) happened to contain "401" or "403"."""
    from snapshotter.fetch.auth import AuthError
    from snapshotter.fetch.client import RegistryError
    from snapshotter.remote.backend import fallback_reason

    msg = "registry 127.0.0.1:40113 (server for 127.0.0.1:54403), blob sha256:401403: cannot connect"
    assert fallback_reason(RegistryError(msg)) == "registry"
    assert fallback_reason(RegistryError("not found (404)", status=404)) == "registry"
    assert fallback_reason(RegistryError("unauthorized", status=401)) == "auth"
    assert fallback_reason(RegistryError("forbidden (403)", status=403)) == "auth"
    assert fallback_reason(AuthError("no credentials")) == "auth"
