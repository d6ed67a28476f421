"""deploy/kubernetes: the manifests parse, and they match what the daemon expects (paths, socket,
config keys through snapshotter.config.parse_config, the containerd drop-in)."""

from __future__ import annotations

import json
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest

from snapshotter.config import DEFAULT_ADDRESS, DEFAULT_CONFIG_PATH, DEFAULT_ROOT, parse_config
from tests.ops.miniyaml import load_all

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"


def _docs() -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for path in sorted(DEPLOY.glob("*.yaml")):
        for doc in load_all(path.read_text()):
            assert isinstance(doc, dict) and "kind" in doc and "apiVersion" in doc, path
            assert doc["kind"] not in out, f"two {doc['kind']} manifests"
            out[doc["kind"]] = doc
    return out


def test_manifests_parse_like_pyyaml_would() -> None:
    """Our subset parser agrees with PyYAML where one is around (the venv has none; the system
    python may)."""
    script = "import json, sys, yaml; print(json.dumps([d for d in yaml.safe_load_all(open(sys.argv[1])) if d]))"
    python = shutil.which("python3", path="/usr/bin:/bin")
    if python is None or subprocess.run([python, "-c", "import yaml"], capture_output=True).returncode != 0:
        pytest.skip("no PyYAML on this machine to compare with (the structural tests below still run)")
    for path in sorted(DEPLOY.glob("*.yaml")):
        r = subprocess.run([python, "-c", script, str(path)], capture_output=True, text=True, timeout=30, check=True)
        assert load_all(path.read_text()) == json.loads(r.stdout), path


def test_kustomization_lists_every_manifest() -> None:
    docs = _docs()
    listed = set(docs["Kustomization"]["resources"])
    assert listed == {p.name for p in DEPLOY.glob("*.yaml")} - {"kustomization.yaml"}


def test_daemonset_runs_the_daemon_the_way_it_needs() -> None:
    docs = _docs()
    ns = docs["Namespace"]["metadata"]["name"]
    ds = docs["DaemonSet"]
    assert ds["metadata"]["namespace"] == ns and docs["ConfigMap"]["metadata"]["namespace"] == ns
    pod = ds["spec"]["template"]["spec"]
    assert ds["spec"]["selector"]["matchLabels"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    assert pod["hostPID"] is True
    # GPU nodes, tainted ones included.
    assert pod["nodeSelector"] and any(t["key"] == "nvidia.com/gpu" and t["operator"] == "Exists"
                                       for t in pod["tolerations"])
    (main,) = pod["containers"]
    assert main["securityContext"]["privileged"] is True
    assert main["command"][:2] == ["snapshotter", "serve"]
    config_arg = main["command"][main["command"].index("--config") + 1]
    assert config_arg == str(DEFAULT_CONFIG_PATH)

    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in main["volumeMounts"]}
    host_paths = {volumes[m["name"]]["hostPath"]["path"]: m for m in mounts.values()
                  if "hostPath" in volumes[m["name"]]}
    assert volumes[host_paths["/dev/fuse"]["name"]]["hostPath"]["type"] == "CharDevice"
    assert host_paths["/dev/fuse"]["mountPath"] == "/dev/fuse"
    # Same paths inside and outside: containerd (on the host) is handed mount paths under the root
    # and dials the socket by its host path.
    state = host_paths[str(DEFAULT_ROOT)]
    assert state["mountPath"] == str(DEFAULT_ROOT) and state["mountPropagation"] == "Bidirectional"
    assert host_paths[str(DEFAULT_ADDRESS.parent)]["mountPath"] == str(DEFAULT_ADDRESS.parent)

    # The config file the daemon reads comes from the ConfigMap.
    cfg_mount = mounts[str(DEFAULT_CONFIG_PATH.parent)]
    assert volumes[cfg_mount["name"]]["configMap"]["name"] == docs["ConfigMap"]["metadata"]["name"]

    # The metrics port is the one the config serves on.
    config = parse_config(docs["ConfigMap"]["data"][DEFAULT_CONFIG_PATH.name], path="configmap config.toml")
    port = int(config.metrics_address.rpartition(":")[2])
    assert {p["containerPort"] for p in main["ports"]} == {port}
    assert pod["containers"][0]["readinessProbe"]["exec"]["command"][:2] == ["snapshotter", "status"]

    # Credentials and registry hosts are mounted where the config says.
    assert any(config.registry.docker_config.startswith(path + "/") for path in mounts)
    assert config.registry.config_path in mounts


def test_configmap_config_and_containerd_drop_in_agree() -> None:
    data = _docs()["ConfigMap"]["data"]
    config = parse_config(data["config.toml"], path="configmap config.toml")  # unknown keys would raise
    assert config.root == str(DEFAULT_ROOT) and config.address == str(DEFAULT_ADDRESS)
    assert config.metrics_address and config.log_format in ("text", "json")
    drop_in = tomllib.loads(data["containerd-lazy.toml"])
    assert drop_in["version"] == 2
    plugin = drop_in["proxy_plugins"]["lazy"]
    assert plugin == {"type": "snapshot", "address": config.address}
    cri = drop_in["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]
    assert cri["snapshotter"] == "lazy" and cri["disable_snapshot_annotations"] is False
    # The init container installs exactly this file into the host's containerd conf.d.
    ds = _docs()["DaemonSet"]["spec"]["template"]["spec"]
    (init,) = ds["initContainers"]
    assert "containerd-lazy.toml" in " ".join(init["command"])
    assert any(m["mountPath"].endswith("/etc/containerd/conf.d") for m in init["volumeMounts"])


@pytest.mark.parametrize("text, expected", [
    ("a: 1\nb:\n  - x\n  - y: 2\n    z: 'q'\nc: |\n  line1\n\n  line2\nd: \"s\\n\"\n",
     {"a": 1, "b": ["x", {"y": 2, "z": "q"}], "c": "line1\n\nline2\n", "d": "s\n"}),
    ("k:\n- 1\n- true\n- null\n", {"k": [1, True, None]}),
])
def test_miniyaml_subset(text: str, expected: dict[str, Any]) -> None:
    assert load_all(text) == [expected]


@pytest.mark.parametrize("bad", ["a: &x 1\n", "a: 1 # c\n", "a: 1\n b: 2\n", "a: >\n  x\n"])
def test_miniyaml_refuses_what_it_does_not_support(bad: str) -> None:
    with pytest.raises(ValueError):
        load_all(bad)
