import pytest

from snapshotter.fetch.reference import InvalidReference, Reference, parse_reference

D = "sha256:" + "ab" * 32


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("busybox", Reference("docker.io", "library/busybox", "latest")),
        ("busybox:1.36", Reference("docker.io", "library/busybox", "1.36")),
        ("docker.io/busybox", Reference("docker.io", "library/busybox", "latest")),
        ("index.docker.io/library/busybox:1", Reference("docker.io", "library/busybox", "1")),
        ("user/app", Reference("docker.io", "user/app", "latest")),
        ("localhost/app", Reference("localhost", "app", "latest")),
        ("localhost:5000/a/b:t", Reference("localhost:5000", "a/b", "t")),
        ("127.0.0.1:5000/app@" + D, Reference("127.0.0.1:5000", "app", None, D)),
        ("ghcr.io/o/r:v1@" + D, Reference("ghcr.io", "o/r", "v1", D)),
        ("[::1]:5000/app:x", Reference("[::1]:5000", "app", "x")),
        ("registry.example.com/a-b/c_d/e.f:tag", Reference("registry.example.com", "a-b/c_d/e.f", "tag")),
    ],
)
def test_parse(text: str, expected: Reference) -> None:
    assert parse_reference(text) == expected


def test_object_and_str() -> None:
    r = parse_reference("127.0.0.1:5000/app:v1@" + D)
    assert r.object == D
    assert str(r) == "127.0.0.1:5000/app:v1@" + D
    assert parse_reference("app").object == "latest"


@pytest.mark.parametrize("text", ["", "UPPER/case", "a//b", "app:", "app@sha256:short", " app", "app:t@bad",
                                  "host:5000/", "a/../b"])
def test_invalid(text: str) -> None:
    with pytest.raises(InvalidReference):
        parse_reference(text)
