"""The tail-size hint end to end: our converters' annotation, the Prepare label it becomes, and
the resolver fetching footer + TOC in one request from a real registry when it has it."""

from __future__ import annotations

import io
import random
import tarfile

import pytest
import trio

from snapshotter.fetch.client import RegistryClient
from snapshotter.fetch.config import FetchConfig
from snapshotter.formats import estargz, zstdchunked
from snapshotter.formats.estargz_writer import write_estargz
from snapshotter.formats.tail_hint import TAIL_SIZE_ANNOTATION, parse_tail_size, tail_size_annotation
from snapshotter.formats.zstdchunked import write_zstdchunked
from snapshotter.remote.labels import STARGZ_DIGEST, STARGZ_LAYERS, STARGZ_REFERENCE, layer_ref_from_labels
from snapshotter.remote.resolver import TAIL_BYTES, resolve_layer, tail_request_bytes
from tests.fetch.registry import RegistryProcess, push_image


def _many_files_tar(n: int = 2500) -> bytes:
    """A tar whose TOC, compressed, is far larger than TAIL_BYTES (random names and contents:
    every entry carries its own digest)."""
    rng = random.Random(3)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for i in range(n):
            data = rng.randbytes(40)
            info = tarfile.TarInfo(f"d{i % 50:02d}/{rng.randbytes(12).hex()}-{i}")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_the_annotation_names_the_bytes_from_the_toc_to_the_end() -> None:
    raw = _many_files_tar(300)
    out = io.BytesIO()
    er = write_estargz(io.BytesIO(raw), out)
    blob = out.getvalue()
    tail = int(er.annotations()[TAIL_SIZE_ANNOTATION])
    assert estargz.parse_footer(blob[-estargz.FOOTER_SIZE:]).toc_offset == len(blob) - tail

    out = io.BytesIO()
    zr = write_zstdchunked(io.BytesIO(raw), out)
    blob = out.getvalue()
    tail = int(zr.annotations[TAIL_SIZE_ANNOTATION])
    assert zstdchunked.parse_footer(blob[-TAIL_BYTES:], blob_size=len(blob)).offset == len(blob) - tail

    with pytest.raises(ValueError, match="outside"):
        tail_size_annotation(100, 100)


def test_a_bad_hint_is_ignored() -> None:
    assert parse_tail_size("123456") == 123456
    for bad in (None, "", "0", "-5", "12k", "１２", "9" * 30):
        assert parse_tail_size(bad) is None, bad


def _resolve(registry_image: str, digest: str, layers: tuple[str, ...], hint: str | None) -> tuple[int, list[str]]:
    """(registry requests made, entry names) of resolving the layer with these Prepare labels."""
    labels = {STARGZ_REFERENCE: registry_image, STARGZ_DIGEST: digest, STARGZ_LAYERS: ",".join(layers)}
    if hint is not None:
        labels[TAIL_SIZE_ANNOTATION] = hint
    ref = layer_ref_from_labels(labels)
    assert ref is not None

    async def main() -> tuple[int, list[str]]:
        async with RegistryClient(FetchConfig()) as client:
            await client.blob_size(ref.image_ref, ref.layer_digest)  # learn the scheme first
            before = client.stats.requests
            with trio.fail_after(30):
                resolved = await resolve_layer(client, ref, max_toc_bytes=16 << 20)
            return client.stats.requests - before, [e.name for e in resolved.index.entries]

    return trio.run(main)


@pytest.mark.parametrize("fmt", ["estargz", "zstdchunked"])
def test_a_hinted_layer_resolves_in_one_request(registry: RegistryProcess, fmt: str) -> None:
    raw = _many_files_tar()
    out = io.BytesIO()
    if fmt == "estargz":
        annotations = write_estargz(io.BytesIO(raw), out).annotations()
    else:
        annotations = dict(write_zstdchunked(io.BytesIO(raw), out).annotations)
    blob = out.getvalue()
    hint = annotations[TAIL_SIZE_ANNOTATION]
    assert int(hint) > 2 * TAIL_BYTES, "the TOC must not fit the default tail for this test to mean anything"
    image = push_image(registry.url, f"tail/{fmt}", "v1", [blob])
    layers = tuple(image.layers)
    digest = layers[0]

    requests, names = _resolve(image.ref, digest, layers, hint)
    assert requests == 1
    unhinted_requests, unhinted_names = _resolve(image.ref, digest, layers, None)
    assert unhinted_requests == 2 and unhinted_names == names
    assert sum(1 for n in names if "/" in n) == 2500

    # A wrong hint costs the second request, never a wrong index; a huge one is capped.
    assert _resolve(image.ref, digest, layers, "100") == (2, names)
    assert _resolve(image.ref, digest, layers, str(1 << 40)) == (1, names)


def test_the_first_request_is_the_hint_within_bounds() -> None:
    labels = {STARGZ_REFERENCE: "r.test/i:v1", STARGZ_DIGEST: "sha256:" + "a" * 64}
    for hint, expected in ((None, TAIL_BYTES), ("1000", TAIL_BYTES), ("500000", 500_000),
                           (str(1 << 40), (1 << 20) + TAIL_BYTES)):
        ref = layer_ref_from_labels(labels if hint is None else {**labels, TAIL_SIZE_ANNOTATION: hint})
        assert ref is not None and tail_request_bytes(ref, max_toc_bytes=1 << 20) == expected, hint
