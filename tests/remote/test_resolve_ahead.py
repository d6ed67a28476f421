"""ResolveAhead's choice of layers and roles (the resolve itself is a recording fake here; the
backend tests run the real one against the registry)."""

from __future__ import annotations

import dataclasses
import threading

from snapshotter.remote.labels import LayerRef
from snapshotter.remote.resolve_ahead import LABEL_MAX, MAX_AHEAD, ResolveAhead, may_be_cut


def _digest(i: int) -> str:
    return f"sha256:{i:064x}"


def _nydus_ref(n_layers: int) -> LayerRef:
    layers = tuple(_digest(i) for i in range(n_layers))
    return LayerRef(image_ref="registry.test/img:v1", layer_digest=layers[0], image_layers=layers,
                    manifest_digest=None, toc_digest=None, nydus_blob=True, nydus_bootstrap=False, client="cri")


def _resolved_ahead(ref: LayerRef) -> list[LayerRef]:
    """The refs ResolveAhead hands to its resolve for `ref`'s Prepare, in the order it started them."""
    seen: list[LayerRef] = []
    lock = threading.Lock()

    def resolve(r: LayerRef) -> None:
        with lock:
            seen.append(r)

    ahead = ResolveAhead(resolve, lambda digest: False, workers=1)  # one worker: started order is run order
    try:
        for digest in ahead.start(ref):
            ahead.wait(digest, 10)
    finally:
        ahead.close()
    return seen


def test_a_nydus_images_bootstrap_goes_first_even_past_the_ahead_cap() -> None:
    ref = _nydus_ref(MAX_AHEAD + 8)
    seen = _resolved_ahead(ref)
    assert len(seen) == MAX_AHEAD
    boot = seen[0]
    assert boot.layer_digest == ref.image_layers[-1] and boot.nydus_bootstrap and not boot.nydus_blob
    assert boot.image_layers == (ref.image_layers[-1],)
    assert all(r.nydus_blob and not r.nydus_bootstrap for r in seen[1:])
    assert [r.layer_digest for r in seen[1:]] == list(ref.image_layers[1:MAX_AHEAD])
    assert seen[1].image_layers == ref.image_layers[1:]


def test_a_layer_list_the_label_limit_may_have_cut_gets_no_bootstrap_guess() -> None:
    """Its last digest need not be the image's top: every layer above is taken as a blob."""
    # Under the longer label key (43 bytes), 56 digests fit in LABEL_MAX and a 57th does not: a
    # list of 56 may have been cut, one of 55 cannot have been (a 56th would have fitted).
    assert 43 + 72 * 56 - 1 <= LABEL_MAX < 43 + 72 * 57 - 1
    assert may_be_cut(_nydus_ref(56).image_layers) and not may_be_cut(_nydus_ref(55).image_layers)
    assert not any(r.nydus_bootstrap for r in _resolved_ahead(_nydus_ref(56)))
    whole = _resolved_ahead(_nydus_ref(55))
    assert whole[0].nydus_bootstrap and whole[0].layer_digest == _digest(54)


def test_layers_above_an_estargz_layer_keep_their_order_and_no_nydus_role() -> None:
    layers = tuple(_digest(i) for i in range(4))
    ref = LayerRef(image_ref="registry.test/img:v1", layer_digest=layers[0], image_layers=layers,
                   manifest_digest=None, toc_digest="sha256:" + "e" * 64, nydus_blob=False, nydus_bootstrap=False,
                   client="stargz")
    seen = _resolved_ahead(ref)
    assert [r.layer_digest for r in seen] == list(layers[1:])
    assert all(not r.nydus_blob and not r.nydus_bootstrap and r.toc_digest is None for r in seen)


def test_layers_resolved_ahead_carry_no_tail_size_hint_and_no_toc_digest() -> None:
    """Both labels belong to the Prepare's own layer, not to the layers above it."""
    ref = dataclasses.replace(_nydus_ref(4), nydus_blob=False, toc_digest="sha256:" + "a" * 64, tail_size=576_636)
    seen = _resolved_ahead(ref)
    assert [r.layer_digest for r in seen] == list(ref.image_layers[1:])
    assert all(r.tail_size is None and r.toc_digest is None for r in seen)
