"""Pushing converted images through the fetch package's auth: htpasswd Basic on the real registry,
and Bearer tokens (scope pull,push) from the test token server in front of it."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import trio

from snapshotter.convert import ConvertError, ConvertOptions, convert
from snapshotter.fetch import FetchConfig, RegistryClient
from tests.convert.conftest import Source
from tests.fetch.proxies import RegistryProxy
from tests.fetch.registry import RegistryProcess, start_registry, write_htpasswd

FAST = FetchConfig(retries=1, backoff_initial=0.01, backoff_max=0.05, connect_timeout=2.0, read_timeout=10.0,
                   request_timeout=30.0)


@pytest.fixture(scope="module")
def basic_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RegistryProcess]:
    d = tmp_path_factory.mktemp("convert-htpasswd")
    write_htpasswd(d / "htpasswd", {"alice": "s3cret"})
    reg = start_registry(d / "reg", htpasswd=d / "htpasswd")
    try:
        yield reg
    finally:
        reg.stop()


def with_credentials(tmp_path: Path, host: str, user: str, password: str) -> FetchConfig:
    f = tmp_path / "config.json"
    f.write_text(json.dumps({"auths": {host: {"auth": base64.b64encode(f"{user}:{password}".encode()).decode()}}}))
    return replace(FAST, docker_config=f)


def manifest_of(ref: str, cfg: FetchConfig) -> dict:
    async def main() -> dict:
        async with RegistryClient(cfg) as c:
            return json.loads((await c.fetch_manifest(ref)).content)

    return trio.run(main)


def test_push_with_basic_auth(source: Source, basic_registry: RegistryProcess, tmp_path: Path) -> None:
    dst = f"{basic_registry.host}/conv/basic:v1"
    good = with_credentials(tmp_path, basic_registry.host, "alice", "s3cret")
    result = convert(source.oci, dst, ConvertOptions("zstdchunked", progress=False), good)
    manifest = manifest_of(dst, good)
    assert [m["digest"] for m in manifest["layers"]] == [layer.digest for layer in result.manifests[0].layers]
    # again: every blob exists already (HEAD), only the manifest is written
    convert(source.oci, dst, ConvertOptions("zstdchunked", progress=False), good)
    bad = with_credentials(tmp_path / "..", basic_registry.host, "alice", "wrong")
    with pytest.raises(ConvertError, match=r"conv/basic.*401.*credentials"):
        convert(source.oci, f"{basic_registry.host}/conv/basic:v2", ConvertOptions("estargz", progress=False), bad)


def test_push_with_bearer_token_scope(source: Source, registry: RegistryProcess) -> None:
    with RegistryProxy(registry.url, bearer=True) as proxy:
        dst = f"{proxy.host}/conv/bearer:v1"
        convert(source.oci, dst, ConvertOptions("estargz", progress=False), FAST)
        scopes = [s for q in proxy.token_requests for s in q.get("scope", [])]
        assert scopes and all(s == "repository:conv/bearer:pull,push" for s in scopes)
        assert proxy.tokens_issued == 1  # one token for all pushes
        puts = [r for r in proxy.requests if r.method == "PUT"]
        assert len(puts) == 3 + 1 + 1  # layers, config, manifest
        assert all(r.headers.get("authorization", "").startswith("Bearer ") for r in puts)
    # it landed in the registry behind the proxy
    manifest = manifest_of(f"{registry.host}/conv/bearer:v1", FAST)
    assert len(manifest["layers"]) == 3
