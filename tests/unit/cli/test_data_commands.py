"""p2ptrain data prepare|show: a summary with the experiment lines, JSON, and errors that
exit 2 with a message."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from p2ptrain.cli.main import main


def test_prepare_then_show(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "a.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 20)
    out = tmp_path / "prepared"
    assert (
        main(["data", "prepare", str(tmp_path / "a.txt"), "--out", str(out), "--block-size", "16"])
        == 0
    )
    printed = capsys.readouterr().out
    assert printed.startswith("prepared 1 shards, 55 samples, ")
    assert "column   input_ids: int64 [16]" in printed
    assert f'[data]\nprepared = "{out}"\n' in printed

    code = main(["data", "show", str(out), "--verify", "--json"])
    shown = json.loads(capsys.readouterr().out)
    assert code == 0
    assert (shown["kind"], shown["name"], shown["samples"], shown["verified"]) == (
        "sharded",
        "a",
        55,
        True,
    )
    assert shown["descriptor"]["tokenizer"] == {"kind": "bytes", "vocab_size": 256}
    assert main(["data", "show", str(out)]) == 0
    assert "55 samples" in capsys.readouterr().out


def test_prepare_json_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    np.save(tmp_path / "x.npy", np.zeros((10, 4), np.int32))
    out = tmp_path / "out"
    arguments = ["data", "prepare", str(tmp_path / "x.npy"), "--out", str(out)]
    assert main([*arguments, "--samples-per-shard", "3", "--name", "zeros", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["shards"], result["samples"], result["name"]) == (4, 10, "zeros")
    assert result["columns"] == [{"key": "input_ids", "dtype": "int32", "shape": [4]}]
    assert result["experiment"] == f'[data]\nprepared = "{out}"'
    assert result["seconds"] >= 0

    assert main(arguments) == 2
    assert "exists; pass --overwrite" in capsys.readouterr().err
    assert main([*arguments, "--overwrite", "--shard-mb", "0"]) == 2
    assert "--shard-mb 0" in capsys.readouterr().err
    assert main(["data", "show", str(tmp_path)]) == 2
    assert "has no dataset.json" in capsys.readouterr().err
    assert main(["data"]) == 2
