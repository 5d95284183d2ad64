"""How the config file itself is read (megaforge.configtree.load): undecodable input is one
``megaforge: config error:`` line naming the file and where, not a traceback."""
import pytest

from megaforge.config import load_config
from megaforge.configtree import ConfigError


def test_non_utf8_yaml_names_the_file_and_the_byte_offset(tmp_path, capsys):
    p = tmp_path / "latin1.yaml"
    p.write_bytes("max_steps: 1\nrun_name: café\n".encode("latin-1"))  # é is byte 0xe9 at offset 26
    with pytest.raises(ConfigError, match=rf"^--config {p}: not valid UTF-8 \(invalid continuation byte at byte "
                                          r"offset 26\); save the file as UTF-8$"):
        load_config(["--config", str(p)])
    from megaforge.launch import main

    with pytest.raises(SystemExit) as e:  # what the launcher prints: one line, exit 2
        main("grpo", ["--config", str(p)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err == f"megaforge: config error: --config {p}: not valid UTF-8 (invalid " \
                                        f"continuation byte at byte offset 26); save the file as UTF-8\n"
    p.write_text("max_steps: 1\nrun_name: café\n", encoding="utf-8")  # the same text as UTF-8 loads
    assert load_config(["--config", str(p), "--model.config", "configs/models/tiny-qwen2",
                        "--data.path", "arithmetic"]).run_name == "café"
