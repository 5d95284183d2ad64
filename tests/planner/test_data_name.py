"""``data.name``: the configuration (subset) of a `datasets` dataset reaches ``load_dataset``.

A local dataset folder with two configurations declared in its README (the hub's own mechanism,
e.g. openai/gsm8k's ``main`` / ``socratic``) stands in for a hub dataset: nothing is downloaded.
"""
import json
import os

import pytest

from megaforge.config import DataConfig
from megaforge.data.sources import DataError, read_rows

README = """---
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train.jsonl
- config_name: socratic
  data_files:
  - split: train
    path: socratic/train.jsonl
---
"""


@pytest.fixture
def two_config_dataset(tmp_path):
    pytest.importorskip("datasets")
    for name in ("main", "socratic"):
        os.makedirs(tmp_path / name)
        with open(tmp_path / name / "train.jsonl", "w") as f:
            for i in range(3):
                f.write(json.dumps({"question": f"{name} q{i}", "answer": f"#### {i}"}) + "\n")
    (tmp_path / "README.md").write_text(README)
    return str(tmp_path)


@pytest.mark.parametrize("name", ["main", "socratic"])
def test_data_name_selects_the_configuration(two_config_dataset, name):
    rows = list(read_rows(DataConfig(path=two_config_dataset, format="hf", name=name), seed=0))
    assert [r.data["question"] for r in rows] == [f"{name} q{i}" for i in range(3)]


def test_unknown_configuration_is_named_in_the_error(two_config_dataset):
    with pytest.raises(DataError, match="data.name 'nope'"):
        list(read_rows(DataConfig(path=two_config_dataset, format="hf", name="nope"), seed=0))
