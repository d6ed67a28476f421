"""OCI image model and image IO for the `convert` tool.

- `model`: media types, JSON/descriptor helpers, `ImageError`.
- `oci_layout`: read and write an OCI image layout directory (`oci:DIR:TAG`).
- `registry_io`: stream whole blobs out of a registry; push blobs and manifests into one.
"""
