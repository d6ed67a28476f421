"""A minimal client of containerd's CRI ImageService (runtime.v1), the kubelet's pull path.

Only what the lab needs: PullImage, ImageStatus and RemoveImage, on containerd's own socket. The
few protobuf messages are encoded by hand (field numbers from k8s.io/cri-api runtime/v1
api.proto) so no CRI stubs have to be generated; the call goes through grpcio's generic
unary-unary API.

Contract: `pull(sock, ref)` returns the image id (`sha256:<config digest>`) that containerd
reports; a gRPC error becomes `CRIError` with the status code and details.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

SERVICE = "/runtime.v1.ImageService/"


class CRIError(RuntimeError):
    pass


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _field_bytes(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _image_spec(ref: str, annotations: dict[str, str] | None = None) -> bytes:
    # ImageSpec { string image = 1; map<string,string> annotations = 2; }
    msg = _field_bytes(1, ref.encode())
    for k, v in (annotations or {}).items():
        entry = _field_bytes(1, k.encode()) + _field_bytes(2, v.encode())
        msg += _field_bytes(2, entry)
    return msg


def _read_fields(data: bytes) -> dict[int, list[bytes | int]]:
    """Top-level fields of a protobuf message: number -> values (bytes for LEN, int for VARINT)."""
    fields: dict[int, list[bytes | int]] = {}
    i = 0

    def varint() -> int:
        nonlocal i
        shift = result = 0
        while True:
            b = data[i]
            i += 1
            result |= (b & 0x7F) << shift
            if not b & 0x80:
                return result
            shift += 7

    while i < len(data):
        key = varint()
        number, wire = key >> 3, key & 7
        value: bytes | int
        if wire == 0:
            value = varint()
        elif wire == 2:
            n = varint()
            value = data[i : i + n]
            i += n
        elif wire == 1:
            value = int.from_bytes(data[i : i + 8], "little")
            i += 8
        elif wire == 5:
            value = int.from_bytes(data[i : i + 4], "little")
            i += 4
        else:
            raise CRIError(f"unsupported protobuf wire type {wire}")
        fields.setdefault(number, []).append(value)
    return fields


def _call(sock: Path, method: str, request: bytes, timeout: float) -> bytes:
    with grpc.insecure_channel(f"unix://{sock}") as channel:
        fn = channel.unary_unary(
            SERVICE + method,
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        )
        try:
            response: bytes = fn(request, timeout=timeout)
        except grpc.RpcError as e:
            code = e.code() if hasattr(e, "code") else None
            details = e.details() if hasattr(e, "details") else str(e)
            raise CRIError(f"CRI {method}: {code}: {details}") from None
    return response


def pull(sock: Path, ref: str, *, timeout: float = 120.0) -> str:
    """PullImage(ref) through containerd's CRI plugin; returns the image id it reports."""
    # PullImageRequest { ImageSpec image = 1; AuthConfig auth = 2; PodSandboxConfig sandbox_config = 3; }
    response = _call(sock, "PullImage", _field_bytes(1, _image_spec(ref)), timeout)
    # PullImageResponse { string image_ref = 1; }
    values = _read_fields(response).get(1, [b""])
    image_ref = values[0]
    assert isinstance(image_ref, bytes)
    return image_ref.decode()


@dataclass(frozen=True)
class Image:
    id: str
    repo_tags: list[str]
    repo_digests: list[str]
    size: int


def image_status(sock: Path, ref: str, *, timeout: float = 30.0) -> Image | None:
    """ImageStatus(ref): None when the CRI plugin does not know the image."""
    # ImageStatusRequest { ImageSpec image = 1; bool verbose = 2; }
    response = _call(sock, "ImageStatus", _field_bytes(1, _image_spec(ref)), timeout)
    # ImageStatusResponse { Image image = 1; map<string,string> info = 2; }
    images = _read_fields(response).get(1)
    if not images:
        return None
    image = images[0]
    assert isinstance(image, bytes)
    # Image { string id = 1; repeated string repo_tags = 2; repeated string repo_digests = 3; uint64 size = 4; }
    f = _read_fields(image)
    ident = f.get(1, [b""])[0]
    assert isinstance(ident, bytes)
    tags = [t.decode() for t in f.get(2, []) if isinstance(t, bytes)]
    digests = [t.decode() for t in f.get(3, []) if isinstance(t, bytes)]
    size = f.get(4, [0])[0]
    return Image(
        id=ident.decode(), repo_tags=tags, repo_digests=digests, size=int(size) if isinstance(size, int) else 0
    )


def remove(sock: Path, ref: str, *, timeout: float = 30.0) -> None:
    """RemoveImage(ref) through the CRI plugin."""
    # RemoveImageRequest { ImageSpec image = 1; }
    _call(sock, "RemoveImage", _field_bytes(1, _image_spec(ref)), timeout)
