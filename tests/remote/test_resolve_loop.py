"""The daemon's shared resolve loop: one client for every job, jobs from many threads at once,
bytes counted per job, and a clean stop (a later job starts it again)."""

from __future__ import annotations

import base64
import json
import threading
from pathlib import Path

import pytest
import trio

from snapshotter.fetch.client import RegistryClient, counting_bytes
from snapshotter.fetch.config import FetchConfig
from snapshotter.remote.resolve_loop import ResolveLoop
from tests.fetch.registry import RegistryProcess, push_image, start_registry, write_htpasswd


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
