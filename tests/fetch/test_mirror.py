"""hosts.toml mirrors: the real registry in pull-through (proxy) mode in front of the origin."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import pytest
import trio

from snapshotter.fetch import RegistryClient
from tests.fetch.conftest import FAST
from tests.fetch.registry import PushedImage, RegistryProcess, start_registry


def test_pull_through_mirror_then_fallback_to_origin(
    tmp_path: Path, origin: RegistryProcess, image: PushedImage, big_layer: tuple[str, bytes],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="snapshotter.fetch")
    digest, data = big_layer
    mirror = start_registry(tmp_path / "mirror", proxy_remote=origin.url)
    try:
        hosts_dir = tmp_path / "certs.d"
        d = hosts_dir / f"127.0.0.1_{origin.port}_"
        d.mkdir(parents=True)
        (d / "hosts.toml").write_text(
            f'server = "{origin.url}"\n\n'
            f'[host."{mirror.url}"]\n  capabilities = ["pull", "resolve"]\n')
        cfg = replace(FAST, hosts_config_path=hosts_dir, retries=1)

        async def main() -> None:
            async with RegistryClient(cfg) as c:
                assert [h.is_mirror for h in c.hosts(origin.host)] == [True, False]
                assert (await c.resolve(image.ref)).digest == image.manifest_digest
                # The pull-through cache's first answer for an uncached blob is the whole blob
                # (200, Range ignored); the client slices it.
                assert await c.read_range(image.ref, digest, 1000, 100) == data[1000:1100]
                # It stores the blob after answering; a read during that commit can get a 500
                # (the client would rightly go on to the origin), so wait until it is stored.
                await trio.to_thread.run_sync(mirror.wait_cached, image.repository, digest)
                assert await c.read_ranges(image.ref, digest, [(0, 10), (250_000, 20)]) == [
                    data[:10], data[250_000:250_020]]
                assert "server ignored Range and sent the whole blob" in caplog.text
                assert "served by mirror " + mirror.url in caplog.text
                assert "served by server" not in caplog.text

                mirror.stop()
                caplog.clear()
                assert await c.read_range(image.ref, digest, 5000, 100) == data[5000:5100]
                assert (await c.resolve(image.ref)).digest == image.manifest_digest
                assert f"served by server {origin.url}/v2" in caplog.text
                assert "cannot connect" in caplog.text and f"127.0.0.1:{mirror.port} (mirror for" in caplog.text

        trio.run(main)
    finally:
        mirror.stop()
    access = mirror.log_path.read_text()
    assert f"/v2/{image.repository}/blobs/{digest}" in access  # the mirror really served blob reads
    # ... and, once stored, the two ranges from its own storage (206), not the whole blob again.
    assert f"/v2/{image.repository}/blobs/{digest}?ns={origin.host} HTTP/1.1\" 206 " in access
