"""``orchard tls init`` (``cluster.commands.tls``): the ``[frontend]`` keys it writes into
orchard.toml with ``--write`` or prints to merge by hand. The certificates themselves are
``cluster.tls``'s (``tests/cluster/test_tls.py``)."""
from __future__ import annotations

from cluster.cli import main as orchard
from cluster.commands.tls import frontend_settings
from cluster.config import load_config, write_default_config
from cluster.tls import TlsFiles


class TestTheFrontendSettings:
    def test_the_certificates_alone(self):
        assert frontend_settings([], mutual=False) == {
            "tls_cert": "tls/server.pem", "tls_key": "tls/server.key"}

    def test_the_first_host_is_served_and_mutual_tls_adds_the_client_ca(self):
        settings = frontend_settings(["10.0.0.5", "head.local"], mutual=True)
        assert settings == {"host": "10.0.0.5", "tls_cert": "tls/server.pem",
                            "tls_key": "tls/server.key", "client_ca": "tls/ca.pem"}
        assert list(settings) == ["host", "tls_cert", "tls_key", "client_ca"]


class TestWhatInitWrites:
    def test_init_write_merges_tls_into_the_default_config_and_a_rerun_adds_no_section(self, tmp_path,
                                                                                      capsys):
        write_default_config(tmp_path)
        path = tmp_path / "orchard.toml"
        path.write_text(path.read_text().replace("port = 0\n", "port = 0  # the operator's note\n")
                        + '\n[telemetry]\nexporter = "none"\n')
        original = path.read_text()
        keys = load_config(tmp_path).tenant_keys
        assert orchard(["tls", "init", "--run-dir", str(tmp_path), "--hosts", "10.0.0.5",
                        "--write"]) == 0
        assert "set in the [frontend] section of" in capsys.readouterr().out
        assert path.read_text() == original.replace(
            '[frontend]\nhost = "127.0.0.1"\nport = 0  # the operator\'s note\n',
            '[frontend]\nhost = "10.0.0.5"\nport = 0  # the operator\'s note\n'
            'tls_cert = "tls/server.pem"\ntls_key = "tls/server.key"\n')
        config = load_config(tmp_path)
        assert (config.host, config.tenant_keys) == ("10.0.0.5", keys)
        assert config.tls_files() == TlsFiles(tmp_path / "tls" / "server.pem",
                                              tmp_path / "tls" / "server.key", None)
        assert path.stat().st_mode & 0o777 == 0o600

        assert orchard(["tls", "init", "--run-dir", str(tmp_path), "--hosts", "10.0.0.5",
                        "--write", "--force", "--mutual"]) == 0
        text = path.read_text()
        assert text.count("[frontend]") == 1 and text.count("tls_cert") == 1
        assert text.endswith('tls_key = "tls/server.key"\nclient_ca = "tls/ca.pem"\n\n'
                             '[telemetry]\nexporter = "none"\n')
        assert load_config(tmp_path).tls_files().client_ca == tmp_path / "tls" / "ca.pem"

    def test_init_without_write_prints_keys_to_merge_not_a_second_section(self, tmp_path, capsys):
        assert orchard(["tls", "init", "--run-dir", str(tmp_path)]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert "[frontend]" not in lines
        assert ['tls_cert = "tls/server.pem"', 'tls_key = "tls/server.key"'] == [
            line for line in lines if line.startswith("tls_")]
