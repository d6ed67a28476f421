"""TLS (custom CA, skip_verify), hosts.toml headers, and concurrency bounds."""

from __future__ import annotations

import shutil
import ssl
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import trio

from snapshotter.fetch import RegistryClient, RegistryError
from snapshotter.fetch.client import _ByteBudget, _tls_context
from tests.fetch.conftest import FAST
from tests.fetch.proxies import Fault, RegistryProxy
from tests.fetch.registry import PushedImage, RegistryProcess, make_self_signed, push_image, start_registry


@pytest.fixture(scope="module")
def tls_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RegistryProcess, PushedImage, Path]]:
    d = tmp_path_factory.mktemp("tls-registry")
    cert, key = make_self_signed(d)
    reg = start_registry(d / "reg", tls=(cert, key))
    try:
        yield reg, push_image(reg.url, "tls/app", "v1", [b"secure-bytes" * 1000]), cert
    finally:
        reg.stop()


def hosts_toml(root: Path, registry: str, text: str) -> Path:
    d = root / "hosts" / registry
    d.mkdir(parents=True)
    (d / "hosts.toml").write_text(text)
    return root / "hosts"


def test_tls_with_custom_ca(tls_registry: tuple[RegistryProcess, PushedImage, Path], tmp_path: Path) -> None:
    reg, img, cert = tls_registry
    digest, data = next(iter(img.layers.items()))
    shutil.copy(cert, tmp_path / "ca.pem")
    with_ca = hosts_toml(tmp_path / "a", reg.host, f'server = "https://{reg.host}"\nca = "{tmp_path / "ca.pem"}"\n')
    no_ca = hosts_toml(tmp_path / "b", reg.host, f'server = "https://{reg.host}"\n')
    skip = hosts_toml(tmp_path / "c", reg.host, f'server = "https://{reg.host}"\nskip_verify = true\n')

    async def main() -> None:
        async with RegistryClient(replace(FAST, hosts_config_path=with_ca)) as c:
            assert await c.read_range(img.ref, digest, 3, 9) == data[3:12]
        async with RegistryClient(replace(FAST, hosts_config_path=skip)) as c:
            assert await c.read_range(img.ref, digest, 3, 9) == data[3:12]
        async with RegistryClient(replace(FAST, hosts_config_path=no_ca, retries=0)) as c:
            with pytest.raises(RegistryError, match="CERTIFICATE_VERIFY_FAILED") as ei:
                await c.read_range(img.ref, digest, 3, 9)
            assert digest in str(ei.value)
        # No hosts.toml: a loopback registry is tried over HTTPS without verification first.
        async with RegistryClient(FAST) as c:
            assert await c.read_range(img.ref, digest, 0, 6) == data[:6]

    trio.run(main)


def test_a_context_that_verifies_nothing_loads_no_ca_store() -> None:
    # The system CA store costs ~20 ms and ~2 MiB to load; a skip_verify context never uses it.
    skip = _tls_context(True, (), ())
    assert skip.verify_mode is ssl.CERT_NONE and not skip.check_hostname
    assert skip.cert_store_stats()["x509_ca"] == 0
    assert skip.minimum_version >= ssl.TLSVersion.TLSv1_2
    verify = _tls_context(False, (), ())
    assert verify.verify_mode is ssl.CERT_REQUIRED and verify.check_hostname
    assert verify is _tls_context(False, (), ())  # one per setting, shared


def test_hosts_toml_headers_and_plain_http_server(origin: RegistryProcess, image: PushedImage,
                                                  big_layer: tuple[str, bytes], tmp_path: Path) -> None:
    digest, data = big_layer
    with RegistryProxy(origin.url) as p:
        root = hosts_toml(tmp_path, p.host, f'server = "{p.url}"\n[header]\n  X-Node = ["n1", "n2"]\n')
        ref = f"{p.host}/{image.repository}"

        async def main() -> None:
            async with RegistryClient(replace(FAST, hosts_config_path=root)) as c:
                assert await c.read_range(ref, digest, 0, 10) == data[:10]

        trio.run(main)
        (req,) = p.blob_requests()
        assert req.headers["x-node"] == "n1, n2"
        # `server = "http://..."` means plain HTTP straight away: no TLS probe reached the proxy.
        assert all(r.path.startswith("/v2/") for r in p.requests)


def test_parallelism_per_registry_is_bounded(origin: RegistryProcess, image: PushedImage,
                                             big_layer: tuple[str, bytes]) -> None:
    digest, data = big_layer
    cfg = replace(FAST, max_parallel_per_registry=2, max_ranges_per_request=1)
    with RegistryProxy(origin.url) as p:
        for _ in range(8):
            p.add_fault(Fault("delay", seconds=0.15))
        ref = f"{p.host}/{image.repository}"
        wanted = [(i * 10_000, 100) for i in range(8)]

        async def main() -> None:
            async with RegistryClient(cfg) as c:
                assert await c.read_ranges(ref, digest, wanted) == [data[o:o + n] for o, n in wanted]
                assert c.stats.range_requests == 8

        trio.run(main)
        assert p.max_inflight == 2


def test_byte_budget_bounds_inflight_bytes() -> None:
    budget = _ByteBudget(100)
    peak = 0

    async def user(n: int) -> None:
        nonlocal peak
        async with budget.hold(n):
            peak = max(peak, budget.used)
            await trio.sleep(0.01)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for n in (60, 30, 50, 150, 10, 90):
                nursery.start_soon(user, n)

    trio.run(main)
    assert peak == 150  # the oversized request ran alone; everything else stayed within 100
    assert budget.used == 0


def test_cancelled_read_releases_limits(origin: RegistryProcess, image: PushedImage,
                                        big_layer: tuple[str, bytes]) -> None:
    digest, data = big_layer
    cfg = replace(FAST, max_parallel_per_registry=1, max_inflight_bytes=1000)
    with RegistryProxy(origin.url) as p:
        p.add_fault(Fault("delay", seconds=1.0))
        ref = f"{p.host}/{image.repository}"

        async def main() -> None:
            async with RegistryClient(cfg) as c:
                with trio.move_on_after(0.3) as scope:
                    await c.read_range(ref, digest, 0, 1000)
                assert scope.cancelled_caught
                assert c._budget.used == 0
                assert c._limiter(p.host).borrowed_tokens == 0
                with trio.fail_after(5):  # the slot and the byte budget are free again
                    assert await c.read_range(ref, digest, 0, 1000) == data[:1000]

        trio.run(main)
