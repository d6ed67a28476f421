"""LayerClaims: what a Prepare in progress or a resolve ahead protects from GC, and for how long."""

from __future__ import annotations

import time

from snapshotter.remote.claims import LayerClaims


def test_a_prepare_claims_its_layer_until_it_ends_even_when_two_overlap() -> None:
    claims = LayerClaims()
    with claims.preparing("sha256:a"):
        with claims.preparing("sha256:a"):
            assert claims.claimed() == {"sha256:a"}
        assert claims.claimed() == {"sha256:a"}  # the other Prepare of it still runs
    assert claims.claimed() == set()


def test_an_ahead_claim_lasts_the_grace_or_until_the_prepare_takes_it_over() -> None:
    claims = LayerClaims(ahead_grace=0.2)
    claims.resolved_ahead("sha256:b")
    claims.resolved_ahead("sha256:c")
    assert claims.claimed() == {"sha256:b", "sha256:c"}
    with claims.preparing("sha256:b"):
        pass
    assert claims.claimed() == {"sha256:c"}  # b is a snapshot now (or fell back): GC decides
    time.sleep(0.3)
    assert claims.claimed() == set()
