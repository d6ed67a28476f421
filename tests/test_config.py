"""Config parsing, and the example files in config/ agree with the code."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from snapshotter.config import Config, load_config, parse_config, schema_keys
from snapshotter.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]


def test_example_config_lists_every_key_with_its_default() -> None:
    text = (REPO / "config" / "config.toml").read_text()
    assert parse_config(text, path="config/config.toml") == Config()
    data = tomllib.loads(text)
    documented = {f"{k}.{kk}" if isinstance(v, dict) else k
                  for k, v in data.items() for kk in (v if isinstance(v, dict) else [None])}
    assert documented == set(schema_keys())


def test_containerd_snippet_names_plugin_lazy_and_default_socket() -> None:
    data = tomllib.loads((REPO / "config" / "containerd.toml").read_text())
    plugin = data["proxy_plugins"]["lazy"]
    assert plugin == {"type": "snapshot", "address": Config().address}
    cri = data["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]
    assert cri["snapshotter"] == "lazy" and cri["disable_snapshot_annotations"] is False


def test_systemd_unit_runs_serve_with_default_paths() -> None:
    unit = (REPO / "systemd" / "snapshotter.service").read_text()
    assert re.search(r"^Type=notify$", unit, re.M)
    assert re.search(r"^KillMode=process$", unit, re.M)
    assert "snapshotter serve --config /etc/snapshotter/config.toml" in unit
    assert re.search(r"^RuntimeDirectory=snapshotter$", unit, re.M)  # /run/snapshotter = default socket dir
    assert Path(Config().address).parent == Path("/run/snapshotter")


def test_values_and_sections() -> None:
    cfg = parse_config("fetch_timeout = 5\n[cache]\nmax_bytes = 1024\n[registry]\nconfig_path = '/etc/c/certs.d'\n")
    assert cfg.fetch_timeout == 5.0 and cfg.cache.max_bytes == 1024
    assert cfg.registry.config_path == "/etc/c/certs.d"
    assert cfg.root == Config().root


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("cache = 3\n", "must be a table"),
        ("[cache]\nmax_bytes = -1\n", "line 2: key 'cache.max_bytes': must not be negative"),
        ("[cache]\nmax_bytes = true\n", "expected an integer"),
        ("[limits]\n\nmax_toc = 1\n", "line 3: unknown key 'limits.max_toc'"),
    ],
)
def test_errors_name_line_and_key(text: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(text, path="/etc/x.toml")
    assert "/etc/x.toml" in str(err.value) and fragment in str(err.value)


def test_missing_default_file_gives_defaults(tmp_path: Path) -> None:
    assert load_config(tmp_path / "absent.toml") == Config()
    with pytest.raises(ConfigError):
        load_config(tmp_path / "absent.toml", required=True)
