from pathlib import Path

import pytest

from snapshotter.errors import ConfigError
from snapshotter.fetch.hosts import RegistryHost, is_loopback, load_hosts


def test_defaults_without_config() -> None:
    assert load_hosts(None, "docker.io") == (RegistryHost("https", "registry-1.docker.io"),)
    assert load_hosts(None, "ghcr.io") == (RegistryHost("https", "ghcr.io"),)
    local = load_hosts(None, "127.0.0.1:5000")[0]
    assert (local.scheme, local.http_fallback, local.skip_verify) == ("https", True, True)
    assert load_hosts(None, "localhost:5000")[0].http_fallback
    assert load_hosts(None, "[::1]:5000")[0].http_fallback
    assert not load_hosts(None, "10.0.0.1:5000")[0].http_fallback


def test_loopback() -> None:
    assert is_loopback("127.0.0.2:1") and is_loopback("localhost") and is_loopback("[::1]:80")
    assert not is_loopback("example.com:5000") and not is_loopback("10.1.1.1")


def test_mirrors_in_order_then_server(tmp_path: Path) -> None:
    d = tmp_path / "example.com_5000_"
    d.mkdir()
    (d / "hosts.toml").write_text(
        'server = "https://example.com:5000"\n'
        'capabilities = ["pull", "resolve"]\n'
        '[host."http://zz-mirror:1"]\n  capabilities = ["pull"]\n  header = { X-A = "1", X-B = ["2", "3"] }\n'
        '[host."https://aa-mirror:2/sub"]\n  skip_verify = true\n  ca = "ca.pem"\n'
        '  client = [["c.pem", "k.pem"]]\n'
    )
    hosts = load_hosts(tmp_path, "example.com:5000")
    assert [h.base_url for h in hosts] == ["http://zz-mirror:1/v2", "https://aa-mirror:2/sub/v2",
                                           "https://example.com:5000/v2"]
    assert [h.is_mirror for h in hosts] == [True, True, False]
    assert hosts[0].capabilities == {"pull"}
    assert hosts[0].header == (("X-A", "1"), ("X-B", "2"), ("X-B", "3"))
    assert hosts[1].skip_verify is True and hosts[1].ca == (d / "ca.pem",)
    assert hosts[1].client_certs == ((d / "c.pem", d / "k.pem"),)
    assert hosts[2].capabilities == {"pull", "resolve"}


def test_colon_dir_and_default_dir(tmp_path: Path) -> None:
    (tmp_path / "reg:5000").mkdir()
    (tmp_path / "reg:5000" / "hosts.toml").write_text('[host."http://m:1"]\n')
    assert [h.host for h in load_hosts(tmp_path, "reg:5000")] == ["m:1", "reg:5000"]
    (tmp_path / "_default").mkdir()
    (tmp_path / "_default" / "hosts.toml").write_text('[host."http://all-mirror:1"]\n')
    hosts = load_hosts(tmp_path, "other.io")
    assert [h.base_url for h in hosts] == ["http://all-mirror:1/v2", "https://other.io/v2"]
    # No server in the file: the origin keeps the loopback defaults.
    (tmp_path / "_default" / "hosts.toml").write_text('skip_verify = false\n')
    origin = load_hosts(tmp_path, "127.0.0.1:9")[-1]
    assert origin.http_fallback and origin.skip_verify is False


def test_override_path_and_plain_host(tmp_path: Path) -> None:
    (tmp_path / "r.io").mkdir()
    (tmp_path / "r.io" / "hosts.toml").write_text(
        'server = "r.io"\n[host."https://m.io/api/v2/x"]\n  override_path = true\n')
    hosts = load_hosts(tmp_path, "r.io")
    assert [h.base_url for h in hosts] == ["https://m.io/api/v2/x", "https://r.io/v2"]


@pytest.mark.parametrize("text", ['server = 5', '[host."ftp://x"]\n', '[host."http://x"]\ncapabilities=["fly"]\n',
                                  'not toml =', '[host."http://x"]\nskip_verify = "yes"\n'])
def test_bad_files_name_the_file(tmp_path: Path, text: str) -> None:
    (tmp_path / "r.io").mkdir()
    f = tmp_path / "r.io" / "hosts.toml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=str(f)):
        load_hosts(tmp_path, "r.io")


def test_certs_dir_without_hosts_toml(tmp_path: Path) -> None:
    d = tmp_path / "r.io"
    d.mkdir()
    (d / "ca.crt").write_text("x")
    (d / "client.cert").write_text("x")
    (d / "client.key").write_text("x")
    (h,) = load_hosts(tmp_path, "r.io")
    assert h.ca == (d / "ca.crt",) and h.client_certs == ((d / "client.cert", d / "client.key"),)
