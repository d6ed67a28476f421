"""The daemon's shared resolve loop: one client for every job, jobs from many threads at once,
bytes counted per job, and a clean stop (a later job starts it again)."""

from __future__ import annotations

import base64
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import trio

from snapshotter.fetch.client import RegistryClient, counting_bytes
from snapshotter.fetch.config import FetchConfig
from snapshotter.formats import estargz
from snapshotter.remote.labels import LayerRef
from snapshotter.remote.resolve_loop import ResolveLoop
from snapshotter.remote.resolver import resolve_layer
from tests.fetch.registry import RegistryProcess, push_image, start_registry, write_htpasswd
from tests.remote.test_backend import _estargz


def test_jobs_from_many_threads_share_one_client_and_count_their_own_bytes(registry: RegistryProcess) -> None:
    sizes = [10_000, 300_000, 1_000_000]
    image = push_image(registry.url, "loop/one", "v1", [bytes([i]) * n for i, n in enumerate(sizes)])
    loop = ResolveLoop(FetchConfig())
    results: dict[int, tuple[int, int, bytes]] = {}
    errors: list[BaseException] = []

    def caller(i: int, digest: str) -> None:
        async def job(client: RegistryClient) -> tuple[int, int, bytes]:
            with counting_bytes() as fetched:
                await trio.sleep(0.05)  # overlap the three jobs
                data = await client.read_range(image.ref, digest, 0, sizes[i])
            return id(client), fetched[0], data

        try:
            results[i] = loop.run(job)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=caller, args=(i, d)) for i, d in enumerate(image.layers)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not errors, errors
        assert len({client for client, _, _ in results.values()}) == 1, "one client for all jobs"
        for i, n in enumerate(sizes):
            _, fetched, data = results[i]
            assert data == bytes([i]) * n and fetched == n, (i, fetched)
    finally:
        loop.close()


def test_a_job_error_reaches_the_caller_and_close_is_not_final(tmp_path: Path) -> None:
    loop = ResolveLoop(FetchConfig())

    async def fails(client: RegistryClient) -> None:
        raise KeyError("boom")

    async def ok(client: RegistryClient) -> str:
        return "ok"

    try:
        with pytest.raises(KeyError, match="boom"):
            loop.run(fails)
        assert loop.run(ok) == "ok"
        running = {t for t in threading.enumerate() if t.name == "resolve-loop"}
        loop.close()
        assert {t for t in threading.enumerate() if t.name == "resolve-loop"} < running, "its thread ended"
        assert loop.run(ok) == "ok", "a job after close starts the loop again"
    finally:
        loop.close()


def test_later_jobs_reuse_what_the_client_learned(tmp_path: Path) -> None:
    """Against a registry that wants credentials: the first job meets the 401 challenge, later
    jobs (later layers) send credentials at once; with a client per job each would meet it."""
    d = tmp_path / "reg"
    d.mkdir()
    write_htpasswd(d / "htpasswd", {"alice": "wonder-land"})
    reg = start_registry(d / "data", htpasswd=d / "htpasswd")
    try:
        image = push_image(reg.url, "secret/layers", "v1", [b"a" * 1000, b"b" * 1000, b"c" * 1000],
                           auth=("alice", "wonder-land"))
        creds = tmp_path / "config.json"
        token = base64.b64encode(b"alice:wonder-land").decode()
        creds.write_text(json.dumps({"auths": {reg.host: {"auth": token}}}))
        loop = ResolveLoop(FetchConfig(docker_config=creds))
        try:
            for digest in image.layers:
                async def job(client: RegistryClient, digest: str = digest) -> bytes:
                    return await client.read_range(image.ref, digest, 0, 10)

                assert loop.run(job) == image.layers[digest][:10]
        finally:
            loop.close()
        access = [line for line in reg.log_path.read_text().splitlines() if '"GET /v2/secret/layers/blobs/' in line]
        statuses = [line.split('" ')[1].split()[0] for line in access]  # the access log's status field
        assert statuses == ["401", "206", "206", "206"], access
    finally:
        reg.stop()


def test_start_in_background_starts_the_loop_before_any_job() -> None:
    loop = ResolveLoop(FetchConfig())
    try:
        loop.start_in_background()
        deadline = time.monotonic() + 10
        while not any(t.name == "resolve-loop" for t in threading.enumerate()):
            assert time.monotonic() < deadline, "the loop thread did not start"
            time.sleep(0.01)

        async def ok(client: RegistryClient) -> str:
            return "ok"

        assert loop.run(ok) == "ok"
        assert sum(t.name == "resolve-loop" for t in threading.enumerate()) == 1, "the job used that loop"
    finally:
        loop.close()


def test_a_slow_parse_does_not_hold_up_another_layers_resolve(registry: RegistryProcess,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Layers of one image resolve at once in the shared loop; the TOC parse (CPU work) runs on a
    worker thread, so a big layer's parse does not stall a small layer's requests behind it."""
    slow_blob, slow_toc = _estargz({"slow": b"s" * 1000})
    fast_blob, fast_toc = _estargz({"fast": b"f" * 1000})
    image = push_image(registry.url, "loop/parse", "v1", [slow_blob, fast_blob])
    slow_digest, fast_digest = image.layers
    real_parse = estargz.parse_toc

    def parse(member: bytes, **kw: Any) -> Any:
        if kw["layer_digest"] == slow_digest:
            time.sleep(1.0)  # what a TOC of 100,000 entries costs
        return real_parse(member, **kw)

    monkeypatch.setattr(estargz, "parse_toc", parse)
    loop = ResolveLoop(FetchConfig())
    done: dict[str, float] = {}

    def resolve(digest: str, toc: str) -> None:
        ref = LayerRef(image.ref, digest, tuple(image.layers), None, toc, False, False, "stargz")

        async def job(client: RegistryClient) -> None:
            resolved = await resolve_layer(client, ref, max_toc_bytes=1 << 20)
            assert [e.name for e in resolved.index.entries if e.name] == [("slow" if digest == slow_digest
                                                                           else "fast")]
            done[digest] = time.monotonic()

        loop.run(job)

    try:
        slow = threading.Thread(target=resolve, args=(slow_digest, slow_toc))
        start = time.monotonic()
        slow.start()
        time.sleep(0.2)  # the slow layer is parsing
        resolve(fast_digest, fast_toc)
        slow.join(30)
        assert set(done) == {slow_digest, fast_digest}
        assert done[fast_digest] - start < 0.8, "the fast layer waited for the slow layer's parse"
        assert done[slow_digest] - start >= 1.0
    finally:
        loop.close()
