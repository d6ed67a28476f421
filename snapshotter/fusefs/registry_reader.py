"""The "registry" reader kind of the mount process: chunks fetched lazily from the registry
through the verified, single-flight layer reader and the shared on-disk chunk cache.

State-file reader spec: {"kind": "registry", "image_ref": REF, "layer_digest": D, "blob_size": N,
"format": F}; the state's "config" object is the daemon's Config (registry hosts, credentials,
cache cap, timeouts). One registry client and one cache are shared by all layers of the mount;
the client starts with the daemon's auth hand-off when the spare was given one (`ReaderEnv.auth`).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from snapshotter.cache import ChunkCache
from snapshotter.config import Config, config_from_mapping
from snapshotter.fetch.client import RegistryClient
from snapshotter.formats.index import LayerIndex
from snapshotter.fusefs.ops import LayerReader
from snapshotter.fusefs.process import LayerSpec, ReaderEnv
from snapshotter.reader import BlobOrder, ReaderConfig, RegistryRangeSource, open_layer_reader
from snapshotter.remote.settings import fetch_config_from
from snapshotter.remote.store import blob_digests

log = logging.getLogger(__name__)


async def _shared(env: ReaderEnv) -> tuple[Config, RegistryClient, ChunkCache]:
    if "registry_client" not in env.shared:
        config = config_from_mapping(dict(env.state.doc.get("config") or {}), path="mount state config")
        client = RegistryClient(fetch_config_from(config))
        hosts = env.state.doc.get("plain_http_hosts") or []
        if isinstance(hosts, list):
            client.assume_plain_http(h for h in hosts if isinstance(h, str))
        await env.stack.enter_async_context(client)
        if env.auth:
            tokens = client.adopt_auth(env.auth)
            log.info("event=auth_handoff tokens=%d", tokens)
        cache = ChunkCache(Path(config.root) / "cache", config.cache.max_bytes)
        env.stack.callback(cache.close)
        env.shared.update(config=config, registry_client=client, chunk_cache=cache)
    return env.shared["config"], env.shared["registry_client"], env.shared["chunk_cache"]


@asynccontextmanager
async def registry_reader(spec: LayerSpec, index: LayerIndex, env: ReaderEnv) -> AsyncIterator[LayerReader]:
    config, client, cache = await _shared(env)
    digests = blob_digests(index, str(spec.reader["layer_digest"]))
    source = RegistryRangeSource(client, str(spec.reader["image_ref"]), digests)
    reader_config = ReaderConfig(fetch_timeout=config.fetch_timeout,
                                 max_inflight_bytes=config.cache.max_inflight_bytes,
                                 max_merge_bytes=config.registry.max_merge_bytes,
                                 amplify_bytes=config.registry.amplify_bytes)
    async with open_layer_reader(source, blobs=digests, cache=cache, config=reader_config,
                                 order=BlobOrder(index.entries, reader_config.unit_bytes)) as reader:
        yield reader
