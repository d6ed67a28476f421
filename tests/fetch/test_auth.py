"""Authentication against the real registry (htpasswd Basic) and a test token server (Bearer)."""

from __future__ import annotations

import base64
import json
import logging
import os
import random
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import trio

from snapshotter.fetch import FetchConfig, RegistryClient, RegistryError
from snapshotter.fetch.auth import HANDOFF_MIN_SECONDS
from tests.fetch.conftest import FAST
from tests.fetch.proxies import BlobServer, RegistryProxy
from tests.fetch.registry import PushedImage, RegistryProcess, push_image, start_registry, write_htpasswd

USER, PASSWORD = "alice", "wonder-land"


@pytest.fixture(scope="module")
def basic_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RegistryProcess, PushedImage]]:
    d = tmp_path_factory.mktemp("htpasswd-registry")
    write_htpasswd(d / "htpasswd", {USER: PASSWORD})
    reg = start_registry(d / "reg", htpasswd=d / "htpasswd")
    try:
        img = push_image(reg.url, "secret/app", "v1", [random.Random(3).randbytes(50_000)],
                         auth=(USER, PASSWORD))
        yield reg, img
    finally:
        reg.stop()


def docker_config(tmp_path: Path, auths: dict[str, dict[str, str]]) -> FetchConfig:
    f = tmp_path / "config.json"
    f.write_text(json.dumps({"auths": auths}))
    return replace(FAST, docker_config=f)


def b64(user: str, pw: str) -> str:
    return base64.b64encode(f"{user}:{pw}".encode()).decode()


def test_htpasswd_basic_auth(basic_registry: tuple[RegistryProcess, PushedImage], tmp_path: Path) -> None:
    reg, img = basic_registry
    digest, data = next(iter(img.layers.items()))
    good = docker_config(tmp_path, {reg.host: {"auth": b64(USER, PASSWORD)}})

    async def main() -> None:
        async with RegistryClient(good) as c:
            assert (await c.resolve(img.ref)).digest == img.manifest_digest
            assert await c.read_range(img.ref, digest, 100, 200) == data[100:300]
            assert await c.read_ranges(img.ref, digest, [(0, 10), (40_000, 10)]) == [data[:10],
                                                                                   data[40_000:40_010]]
            ch = c.authorizer.challenge_for(reg.host)
            assert ch is not None and ch.scheme == "basic"
        async with RegistryClient(FAST) as anon:
            with pytest.raises(RegistryError, match="401") as ei:
                await anon.read_range(img.ref, digest, 0, 10)
            assert digest in str(ei.value) and reg.host in str(ei.value)
        wrong = docker_config(tmp_path, {reg.host: {"username": USER, "password": "nope"}})
        async with RegistryClient(wrong) as c:
            with pytest.raises(RegistryError, match="401"):
                await c.blob_size(img.ref, digest)

    trio.run(main)


def test_htpasswd_with_credential_helper(basic_registry: tuple[RegistryProcess, PushedImage], tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    reg, img = basic_registry
    digest, data = next(iter(img.layers.items()))
    bindir = tmp_path / "bin"
    bindir.mkdir()
    helper = bindir / "docker-credential-testhelper"
    helper.write_text("#!/bin/sh\nread host\n"
                      f'[ "$1" = get ] && [ "$host" = "{reg.host}" ] || exit 1\n'
                      f'echo \'{{"ServerURL":"{reg.host}","Username":"{USER}","Secret":"{PASSWORD}"}}\'\n')
    helper.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    f = tmp_path / "config.json"
    f.write_text(json.dumps({"credHelpers": {reg.host: "testhelper"}}))

    async def main() -> None:
        async with RegistryClient(replace(FAST, docker_config=f)) as c:
            assert await c.read_range(img.ref, digest, 7, 70) == data[7:77]

    trio.run(main)


@pytest.fixture
def bearer_proxy(origin: RegistryProcess) -> Iterator[RegistryProxy]:
    with RegistryProxy(origin.url, bearer=True) as p:
        yield p


def test_bearer_anonymous_and_reauth_on_401(bearer_proxy: RegistryProxy, image: PushedImage,
                                            big_layer: tuple[str, bytes]) -> None:
    digest, data = big_layer
    ref = f"{bearer_proxy.host}/{image.repository}:{image.tag}"

    async def main() -> None:
        async with RegistryClient(FAST) as c:
            assert (await c.resolve(ref)).digest == image.manifest_digest
            assert await c.read_range(ref, digest, 5, 5) == data[5:10]
            assert bearer_proxy.tokens_issued == 1  # cached across requests
            assert bearer_proxy.token_requests[0]["scope"] == [f"repository:{image.repository}:pull"]
            assert bearer_proxy.token_requests[0]["service"] == ["test-proxy"]
            bearer_proxy.revoke_tokens()  # server-side expiry: next request gets 401
            assert await c.read_range(ref, digest, 1000, 10) == data[1000:1010]
            assert bearer_proxy.tokens_issued == 2
            assert c.stats.retries == 0  # the re-auth is not a retry

    trio.run(main)
    statuses = [r.status for r in bearer_proxy.requests if r.path.startswith("/v2/")]
    assert statuses.count(401) == 2  # the first challenge and the revoked token, nothing more


def test_a_handed_off_token_spares_the_next_client_its_401_and_token_request(
        bearer_proxy: RegistryProxy, image: PushedImage, big_layer: tuple[str, bytes]) -> None:
    """What one client learned (the challenge, the pull token) taken over by another, as a mount
    process takes the daemon's: its first request carries the token. A hand-off for another
    repository carries the challenge but no token."""
    digest, data = big_layer
    ref = f"{bearer_proxy.host}/{image.repository}"

    async def main() -> None:
        async with RegistryClient(FAST) as daemon:
            assert await daemon.read_range(ref, digest, 0, 4) == data[:4]
            handoff = json.loads(json.dumps(daemon.auth_handoff([image.repository])))  # as over the pipe
            elsewhere = daemon.auth_handoff(["some/other-repo"])
        assert [t["scope"] for t in handoff["tokens"]] == [f"repository:{image.repository}:pull"]
        assert elsewhere["tokens"] == [] and elsewhere["challenges"] == handoff["challenges"]
        async with RegistryClient(FAST) as mount:
            assert mount.adopt_auth(handoff) == 1
            assert await mount.read_range(ref, digest, 8, 4) == data[8:12]

    trio.run(main)
    assert bearer_proxy.tokens_issued == 1
    statuses = [r.status for r in bearer_proxy.requests if r.path.startswith("/v2/")]
    assert statuses == [401, 206, 206]  # the first client's challenge, its read, the second's read


def test_a_token_about_to_expire_is_not_handed_off(origin: RegistryProcess, image: PushedImage,
                                                   big_layer: tuple[str, bytes]) -> None:
    """Less than HANDOFF_MIN_SECONDS left: the next client gets the challenge only, and fetches
    a token of its own before its first request (no 401)."""
    digest, data = big_layer
    cfg = replace(FAST, token_expiry_margin=0.0)
    with RegistryProxy(origin.url, bearer=True, token_lifetime=int(HANDOFF_MIN_SECONDS) - 2) as p:
        ref = f"{p.host}/{image.repository}"

        async def main() -> None:
            async with RegistryClient(cfg) as daemon:
                assert await daemon.read_range(ref, digest, 0, 4) == data[:4]
                handoff = daemon.auth_handoff([image.repository])
            assert handoff["tokens"] == [] and p.host in handoff["challenges"]
            async with RegistryClient(cfg) as mount:
                assert mount.adopt_auth(handoff) == 0
                assert await mount.read_range(ref, digest, 4, 4) == data[4:8]

        trio.run(main)
        assert p.tokens_issued == 2
        assert [r.status for r in p.requests if r.path.startswith("/v2/")] == [401, 206, 206]


def test_bearer_token_expiry_refreshes_before_401(origin: RegistryProcess, image: PushedImage,
                                                  big_layer: tuple[str, bytes]) -> None:
    digest, data = big_layer
    cfg = replace(FAST, token_expiry_margin=0.0)
    with RegistryProxy(origin.url, bearer=True, token_lifetime=1) as p:
        ref = f"{p.host}/{image.repository}"

        async def main() -> None:
            async with RegistryClient(cfg) as c:
                assert await c.read_range(ref, digest, 0, 4) == data[:4]
                await trio.sleep(1.2)
                assert await c.read_range(ref, digest, 4, 4) == data[4:8]

        trio.run(main)
        assert p.tokens_issued == 2
        assert [r.status for r in p.requests if r.path.startswith("/v2/")].count(401) == 1


def test_bearer_with_credentials(origin: RegistryProcess, image: PushedImage, tmp_path: Path,
                                 big_layer: tuple[str, bytes]) -> None:
    digest, data = big_layer
    with RegistryProxy(origin.url, bearer=True, token_credentials=("bob", "pw"), refresh_token="rt-1") as p:
        ref = f"{p.host}/{image.repository}"
        basic = docker_config(tmp_path, {p.host: {"auth": b64("bob", "pw")}})
        ident = docker_config(tmp_path / "..", {f"https://{p.host}/v1/": {"identitytoken": "rt-1"}})

        async def main() -> None:
            async with RegistryClient(basic) as c:
                assert await c.read_range(ref, digest, 0, 4) == data[:4]
            async with RegistryClient(ident) as c:
                assert await c.read_range(ref, digest, 9, 4) == data[9:13]
            async with RegistryClient(FAST) as c:
                with pytest.raises(RegistryError, match="token server .* answered 401"):
                    await c.read_range(ref, digest, 0, 4)

        trio.run(main)
        assert p.tokens_issued == 2
        assert p.token_requests[1]["grant_type"] == ["refresh_token"]


def test_redirect_never_leaks_authorization(origin: RegistryProcess, image: PushedImage,
                                            big_layer: tuple[str, bytes], caplog: pytest.LogCaptureFixture) -> None:
    """The registry answers blob GETs with 307 to storage on another port; the storage must not
    see the registry's bearer token."""
    digest, data = big_layer
    caplog.set_level(logging.DEBUG, logger="snapshotter.fetch")
    with BlobServer(image.layers) as storage, \
            RegistryProxy(origin.url, bearer=True, redirect_blobs_to=storage.url) as p:
        ref = f"{p.host}/{image.repository}"

        async def main() -> None:
            async with RegistryClient(FAST) as c:
                assert await c.read_range(ref, digest, 300, 700) == data[300:1000]
                assert await c.read_ranges(ref, digest, [(0, 10), (200_000, 10)]) == [
                    data[:10], data[200_000:200_010]]
                assert await c.blob_size(ref, digest) == len(data)

        trio.run(main)
        assert storage.requests, "the redirect was not followed"
        for r in storage.requests:
            assert "authorization" not in r.headers, r
        # ...while the registry itself did get the token.
        assert any(r.headers.get("authorization", "").startswith("Bearer ") for r in p.blob_requests())
    assert "redirected to http://127.0.0.1" in caplog.text


def test_no_push_tokens_requested(bearer_proxy: RegistryProxy, image: PushedImage) -> None:
    """Pull-only scopes: a lazily pulling node never asks for push rights."""
    async def main() -> None:
        async with RegistryClient(FAST) as c:
            await c.resolve(f"{bearer_proxy.host}/{image.repository}:{image.tag}")

    trio.run(main)
    assert all(s.endswith(":pull") for q in bearer_proxy.token_requests for s in q.get("scope", []))
