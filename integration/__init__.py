"""The local lab: registry + our daemon + containerd, test images, demo (see README.md)."""
