"""The online :class:`~grpo_cli.Diagnoser` against ``analyze`` on the physically real corpus
(:mod:`grpo_cli.commands.corpus`): each dump replayed step by step, one ``update`` per reader batch and a
``step_end`` per part file (one per step), ends with the codes and severities ``analyze`` gives for the whole dump;
each fault is named at the first step, and a healthy control ends quiet."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from grpo_cli import Diagnoser
from grpo_cli.commands.analyze import analyze
from grpo_cli.commands.corpus import RunSpec, generate_run
from grpo_cli.commands.corpus_catalog import CONTROLS, FAULTS, Case
from grpo_cli.commands.diagnoser import diagnoser_groups
from grpo_cli.findings import DetectConfig
from grpo_cli.io import RolloutDataset
from grpo_cli.metrics import AnalyzeConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from _corpus_eval import COLUMNS, graded, replay

SEED = 7
SIZE = {"steps": 4, "prompts_per_step": 8}
"""Small dumps: 4 steps of 64 sequences (every realistic fault below is still conclusive at this size)."""
DETECT_OPTIONS = ("max_staleness", "prox_approximation")

_CASES = {c.name: c for cases in FAULTS.values() for c in cases} | CONTROLS
REPLAYED = [_CASES[name] for name in ("temperature@0.7", "shift@1", "prompt_in_loss@1", "adv_sign@1",
                                      "duplicates@1", "top_k@2", "async", "async_lag6")]
_DUMPS: dict[str, list[Path]] = {}


def dump(case: Case, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """The case's part files (one per step), generated once per session."""
    if case.name not in _DUMPS:
        path = tmp_path_factory.mktemp(case.name.replace("@", "-"))
        _DUMPS[case.name] = generate_run(RunSpec(seed=SEED, **{**SIZE, **case.spec}), path).files
    return _DUMPS[case.name]


def offline(files: list[Path], options: dict[str, Any]) -> list[dict[str, Any]]:
    """``analyze`` with findings over the whole dump."""
    config = AnalyzeConfig(**{k: v for k, v in options.items() if k not in DETECT_OPTIONS})
    detect = DetectConfig(**{k: v for k, v in options.items() if k in DETECT_OPTIONS})
    return analyze(RolloutDataset(files), config, findings=detect).findings


@pytest.mark.parametrize("case", REPLAYED, ids=lambda c: c.name)
def test_replay_ends_with_analyze_findings(case: Case, tmp_path_factory: pytest.TempPathFactory) -> None:
    files = dump(case, tmp_path_factory)
    diagnoser, per_step = replay(files, case.options)
    assert graded(diagnoser.findings()) == graded(offline(files, case.options))
    loud = [f for f in diagnoser.findings() if f["severity"] in ("warning", "error")]
    if case.category is None:
        assert loud == []
        return
    named = [f for f in loud if f["category"] == case.category]
    assert named, f"{case.name}: {graded(diagnoser.findings())}"
    # the corpus's faults are present from the first step: named by the first step_end, and returned there
    assert named[0]["step"] == 0
    assert named[0]["code"] in [f["code"] for f in per_step[0]]


def test_padded_rows_give_the_packed_findings(tmp_path_factory: pytest.TempPathFactory) -> None:
    files = dump(_CASES["temperature@0.7"], tmp_path_factory)
    packed, _ = replay(files, {})
    padded, _ = replay(files, {}, padded=True)
    assert [(f["code"], f["severity"], f["evidence"]) for f in padded.findings()] == \
        [(f["code"], f["severity"], f["evidence"]) for f in packed.findings()]
    (temperature,) = [f for f in padded.findings() if f["code"] == "GRP102"]
    assert abs(temperature["evidence"]["diag/temperature_ratio"]["value"] - 0.7) < 0.1  # the engine's 0.7


def test_a_finding_is_returned_once_and_counted_for_the_logs(tmp_path_factory: pytest.TempPathFactory) -> None:
    files = dump(_CASES["temperature@0.7"], tmp_path_factory)
    diagnoser, per_step = replay(files, {})
    returned = [f["code"] for step in per_step for f in step]
    assert returned.count("GRP102") == 1 and [f["code"] for f in per_step[0]] == ["GRP102"]
    counts = diagnoser.counts()
    assert counts["findings/GRP102"] == 3  # its severity: error
    assert counts["findings/temperature"] == 1
    assert counts["findings/error"] == sum(f["severity"] == "error" for f in diagnoser.findings())


def test_states_are_bounded_between_steps(tmp_path_factory: pytest.TempPathFactory) -> None:
    files = dump(_CASES["async"], tmp_path_factory)
    sizes: list[int] = []
    hashes: list[int] = []

    def entries(diagnoser: Diagnoser) -> None:
        assert diagnoser._step is None  # nothing of a step is kept past its step_end but the merged states
        per_group = {g.name: sum(v.numel() for v in s.values.values())
                     for g, s in zip(diagnoser.groups, diagnoser._run or [])}
        hashes.append(per_group.pop("diag/duplicates"))
        sizes.append(sum(per_group.values()))

    # window=1: the duplicate hashes of earlier steps leave memory (the default keeps 16 steps of them)
    short, _ = replay(files, {"window": 1}, on_step=entries)
    per_step = SIZE["prompts_per_step"] * 8  # sequences per step (group size 8)
    growth = [b - a for a, b in itertools.pairwise(sizes)]
    # no token buffer: what a step adds is one row per step and per GRPO group (8 groups: 112 entries, the per-step
    # and per-(step, lag) rows: about 50), the same every step
    assert max(growth) <= 3 * per_step
    assert max(growth) - min(growth) <= 16
    # the duplicate hashes: one step's keys, at most 4 entries for each of the step's sequences in each table
    assert max(hashes) <= 2 * 4 * per_step + 4
    (theirs,) = [s for g, s in zip(short.groups, short._run or []) if g.name == "diag/duplicates"]
    assert int(theirs["ids_retired"]) == 3 * per_step
    assert theirs["ids"].shape[0] == per_step  # the last step's (step, seq_id) keys only
    diagnoser, _ = replay(files, {})
    (mine,) = [s for g, s in zip(diagnoser.groups, diagnoser._run or []) if g.name == "diag/duplicates"]
    assert int(mine["ids_retired"]) == 0 and mine["ids"].shape[0] == 4 * per_step
    # the same findings and evidence; where names the repeats of the kept steps only
    assert [{**f, "where": None} for f in short.findings()] == [{**f, "where": None} for f in diagnoser.findings()]


def test_a_duplicate_within_the_window_is_found(tmp_path_factory: pytest.TempPathFactory) -> None:
    files = dump(_CASES["duplicates@1"], tmp_path_factory)
    diagnoser, per_step = replay(files, {"window": 1})
    assert [f["code"] for f in per_step[0]] == ["GRP107"]
    assert graded(diagnoser.findings()) == graded(offline(files, {}))


def test_options_are_analyze_options() -> None:
    assert Diagnoser(epsilon=0.1, epsilon_high=0.3, max_staleness=6).detect_config.max_staleness == 6
    with pytest.raises(TypeError, match="unknown option"):
        Diagnoser(epsilonn=0.2)
    with pytest.raises(TypeError, match="unknown option"):
        Diagnoser(group_by="step")


def test_validation_is_analyze_validation() -> None:
    from grpo_cli.errors import InputError

    diagnoser = Diagnoser()
    with pytest.raises(InputError):
        diagnoser.update(new_logp=torch.tensor([[-1.0, 0.5]]), loss_mask=torch.ones(1, 2))
    skipping = Diagnoser(on_invalid="skip")
    skipping.update(new_logp=torch.tensor([[-1.0, 0.5], [-1.0, -2.0]]), loss_mask=torch.ones(2, 2))
    skipping.update(new_logp=torch.tensor([[-1.0, -0.5]]), loss_mask=torch.ones(1, 2))
    assert skipping.step_end(0) == [] and skipping.findings() == []


def test_next_token_inputs_are_read_as_the_writer_reads_them(tmp_path_factory: pytest.TempPathFactory,
                                                             tmp_path: Path) -> None:
    from grpo_cli.io import RolloutWriter

    files = dump(_CASES["shift@1"], tmp_path_factory)
    diagnoser = Diagnoser()
    wanted = {"loss_mask"}.union(*(g.columns() for g in diagnoser_groups()))
    with RolloutWriter(tmp_path, fsync=False) as writer:
        for path in files:
            step = None
            for batch in RolloutDataset([path]).iter_batches(columns=wanted, batch_tokens=2000):
                given = {name: getattr(batch, name) for name in COLUMNS if getattr(batch, name) is not None}
                step = int(batch.step[0])
                del given["step"]
                for name in ("new_logp", "old_logp", "prox_logp", "ref_logp", "entropy", "advantages"):
                    # AReaL's convention: value t belongs to token t + 1 (torch.roll(x, -1) per sequence)
                    given[name] = torch.cat([torch.roll(given[name][a:b], -1) for a, b in
                                             itertools.pairwise(batch.cu_seqlens.tolist())])
                mask = torch.cat([torch.roll(batch.loss_mask[a:b], -1)
                                  for a, b in itertools.pairwise(batch.cu_seqlens.tolist())])
                common = {"cu_seqlens": batch.cu_seqlens, "loss_mask": mask, "alignment": "next_token",
                          "column_alignment": {"versions": "token"}}
                diagnoser.update(step=step, **given, **common)
                writer.add(step=step, **given, **common)
            diagnoser.step_end(step)  # type: ignore[arg-type]  # every file has rows
    written = offline(sorted(tmp_path.glob("*.parquet")), {})
    assert graded(diagnoser.findings()) == graded(written)
    assert ("GRP101", "error") in graded(written)  # the shift is still there after the round trip


def test_the_recipes_helper_ends_a_step_when_the_next_begins(tmp_path_factory: pytest.TempPathFactory,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    import re

    page = Path(__file__).resolve().parents[1] / "docs" / "recipes" / "README.md"
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S) if "def diagnose" in b]
    namespace: dict[str, Any] = {}
    exec(compile(block, str(page), "exec"), namespace)
    files = dump(_CASES["temperature@0.7"], tmp_path_factory)
    for path in files[:2]:
        for batch in RolloutDataset([path]).iter_batches(batch_tokens=2000):
            given = {name: getattr(batch, name) for name in COLUMNS if getattr(batch, name) is not None}
            step = int(given.pop("step")[0])
            # lists of 1-D tensors, one per sequence (slime's form)
            cuts = batch.cu_seqlens.tolist()
            for name in ("new_logp", "old_logp", "prox_logp", "ref_logp", "entropy", "versions"):
                given[name] = [given[name][a:b] for a, b in itertools.pairwise(cuts)]
            given["advantages"] = given["advantages"][batch.cu_seqlens[:-1]]
            namespace["diagnose"](step, loss_mask=[batch.loss_mask[a:b] for a, b in itertools.pairwise(cuts)],
                                  **given)
    # the first step ended when the second began: the engine's temperature was named there
    assert "grpo-cli GRP102 error at step 0:" in capsys.readouterr().out
    assert namespace["_open_step"] == 1 and namespace["diagnoser"].findings()[0]["step"] == 0


@pytest.mark.slow
def test_two_gloo_ranks_judge_as_one_process(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    import json
    import os
    import socket
    import subprocess
    import sys

    files = dump(_CASES["temperature@0.7"], tmp_path_factory)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    here = Path(__file__).resolve().parent
    launch = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
              "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", str(here / "diagnoser_job.py"),
              str(tmp_path), json.dumps([str(f) for f in files])]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(here.parent)}
    proc = subprocess.run(launch, capture_output=True, text=True, timeout=300, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    one, per_step = replay(files, {})
    expected = [[[f["code"], f["severity"]] for f in step] for step in per_step]
    for result in ranks:  # every rank: the one process's judgement at every step, and its evidence
        assert result["per_step"] == expected
        assert graded(result["findings"]) == graded(one.findings())
        for theirs, mine in zip(result["findings"], one.findings()):
            for key, ev in mine["evidence"].items():
                assert theirs["evidence"][key]["value"] == pytest.approx(ev["value"], rel=1e-9, abs=1e-12), key
