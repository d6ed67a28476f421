"""containerd filter syntax as sent by ctr and containerd's metadata layer."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from snapshotter.errors import InvalidArgument
from snapshotter.snapshots.filters import match_any, parse_filter, parse_filters
from snapshotter.snapshots.model import Info, Kind

INFO = Info("default/5/sha256:abc", "default/4/sha256:def", Kind.COMMITTED, 0, 0,
            {"containerd.io/snapshot.ref": "sha256:abc", "plain": "x y"})


def matches(*filters: str) -> bool:
    return match_any(parse_filters(filters), INFO.field)


def test_metadata_layer_target_filter() -> None:
    # Exactly what containerd 1.6 metadata/snapshot.go sends after ALREADY_EXISTS.
    f = 'labels."containerd.io/snapshot.ref"==sha256:abc,parent=="default/4/sha256:def"'
    assert matches(f)
    assert not matches('labels."containerd.io/snapshot.ref"==sha256:abc,parent=="other"')


def test_operators() -> None:
    assert matches("kind==committed")
    assert not matches("kind==active")
    assert matches("kind!=active")
    assert matches("name~=^default/5/")
    assert matches("name~=/sha256:[a-f]+$/")
    assert matches("labels.plain")
    assert not matches("labels.missing")
    assert matches('labels.plain=="x y"')
    assert matches("labels.missing!=foo")  # containerd: != compares the empty value


def test_any_of_filters_all_of_selectors() -> None:
    assert matches("kind==active", "kind==committed")
    assert not matches("kind==committed,name==other")
    assert matches()


@pytest.mark.parametrize("bad", ["==x", "name==", 'labels."unterminated', "name~=(", "a b", "name=x"])
def test_bad_filters_are_invalid_argument(bad: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        parse_filter(bad)
    assert repr(bad) in str(err.value)


@given(st.text(max_size=40))
def test_parser_never_crashes(text: str) -> None:
    try:
        parse_filter(text)
    except InvalidArgument:
        pass
