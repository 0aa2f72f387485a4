"""A dump's recorded options (``RolloutWriter(metadata=…)``) are its defaults; an explicit option wins; files that
disagree are refused. JSON lines are recognised by their extension."""

from __future__ import annotations

import json

import torch

from grpo_cli.cli import main
from grpo_cli.io import RolloutWriter


def run(capsys, *args):
    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _dump(directory, rank=0, **metadata):
    new = torch.tensor([[-0.1, -0.5, -2.0, -0.3]])
    old = torch.tensor([[-0.3, -0.1, -1.0, -0.3]])
    with RolloutWriter(directory, rank=rank, metadata=metadata) as writer:
        writer.add(step=0, new_logp=new, old_logp=old, loss_mask=torch.ones_like(new, dtype=torch.bool),
                   advantages=torch.tensor([1.0]))
    return directory


def _analyze(capsys, *args):
    code, out, err = run(capsys, "analyze", *args, "-f", "json")
    assert code == 0, err
    return json.loads(out)


def test_metadata_options_are_the_dumps_defaults(capsys, tmp_path):
    path = _dump(tmp_path / "a", temperature=0.5, clip_ratio=0.1, framework="verl")
    doc = _analyze(capsys, path)
    assert doc["config"]["temperature"] == 0.5 and doc["config"]["epsilon"] == 0.1
    assert doc["config"]["from_metadata"] == {"temperature": 0.5, "epsilon": 0.1, "framework": "verl"}
    same = _analyze(capsys, _dump(tmp_path / "b"), "--temperature", "0.5", "--epsilon", "0.1")
    assert same["metrics"]["clip/ratio"] == doc["metrics"]["clip/ratio"]
    assert same["metrics"]["logp/new_mean"] == doc["metrics"]["logp/new_mean"]
    explicit = _analyze(capsys, path, "--epsilon", "0.3")
    assert explicit["config"]["epsilon"] == 0.3 and explicit["config"]["temperature"] == 0.5
    assert "epsilon" not in explicit["config"]["from_metadata"]


def test_files_whose_metadata_disagree_are_refused(capsys, tmp_path):
    _dump(tmp_path / "d", rank=0, temperature=0.5)
    _dump(tmp_path / "d", rank=1, temperature=0.7)
    code, _, err = run(capsys, "analyze", tmp_path / "d")
    assert code == 2 and "metadata 'temperature' = 0.7 differs from 0.5" in err
    code, _, err = run(capsys, "analyze", tmp_path / "d", "--temperature", "1.0")
    assert code == 0, err


def test_jsonl_is_detected_from_the_extension(capsys, tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"new_logp": [-0.1, -0.2], "old_logp": [-0.2, -0.2], "step": 0}) + "\n")
    code, _, err = run(capsys, "convert", path, "-o", tmp_path / "out")
    assert code == 0 and "1 sequences" in err
