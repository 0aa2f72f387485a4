"""The TRL recipe inside a real TRL ``GRPOTrainer`` (CPU, a tiny model built here, nothing downloaded).

The python block of ``docs/recipes/trl.md`` is executed as printed to get ``DumpingGRPOTrainer``; a 2-layer Llama
is trained for 4 steps (``num_iterations=2``, ``beta=0.04``, two reward functions: two generations, each trained
twice) without evaluation, for 4 steps with evaluation every 2 steps, and for 2 steps with
``mask_truncated_completions``. Then
``grpo-cli analyze DUMP --names trl --group-by step --format json``, run through the CLI, must equal
``trainer.state.log_history`` for every key both have, to 1e-4 relative: the per-micro-batch keys
(``clip_ratio/*``, ``kl``, ``entropy``) through the dump's ``micro_batch`` column; a reference computation from
the ``micro_batch`` column shows the dump holds what TRL averaged.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import tiny

pytestmark = pytest.mark.integration
trl = tiny.import_trl()  # the whole tier skips with one line without TRL

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "docs" / "recipes" / "trl.md"
REL = 1e-4
STEPS = 4  # two generations: the second iteration of each already clips and has a nonzero kl (as 8 steps did)
GRAD_ACC = 2  # micro-batches per optimizer step
PER_DEVICE = 8  # completions per micro-batch
NUM_GENERATIONS = 4
EPSILON = 0.2  # TRL's default clip range, also grpo-cli's default --epsilon

#: Keys both TRL and ``--names trl`` report with the same convention, logged once per generation (tested equal).
AGREE = (
    "reward", "reward_std", "frac_reward_zero_std", "completions/mean_length", "completions/min_length",
    "completions/max_length", "completions/clipped_ratio",
)
#: Keys TRL averages per micro-batch (``GRPOTrainer._compute_loss``, then ``GRPOTrainer.log``), logged every step:
#: with the dump's ``micro_batch`` column ``--names trl`` averages them the same way (tested equal).
PER_MICRO_BATCH = (
    "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min",
    "clip_ratio/high_max", "kl", "entropy",
)


# -- helpers ------------------------------------------------------------------------------------------------------
def close(a: float, b: float) -> bool:
    """Equal to 1e-4 relative (and 1e-9 absolute, for values that are zero up to float32 rounding)."""
    return math.isclose(float(a), float(b), rel_tol=REL, abs_tol=1e-9)


def recipe_namespace() -> dict[str, Any]:
    """The one python block of docs/recipes/trl.md, executed as printed."""
    blocks = re.findall(r"```python\n(.*?)```", RECIPE.read_text(), flags=re.S)
    assert len(blocks) == 1, f"{RECIPE} must have exactly one python block, found {len(blocks)}"
    namespace: dict[str, Any] = {"__name__": "trl_recipe"}
    exec(compile(blocks[0], str(RECIPE), "exec"), namespace)
    return namespace


def analyze(dump: Path) -> dict[str, Any]:
    """``grpo-cli analyze DUMP --names trl --group-by step --format json`` through the CLI (in this process:
    a subprocess would import torch again, seconds per dump on a small machine)."""
    from grpo_cli.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["analyze", str(dump), "--names", "trl", "--group-by", "step", "--format", "json"])
    assert code == 0, err.getvalue()
    return json.loads(out.getvalue())


def by_step(result: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {int(group["key"]): group["metrics"] for group in result["groups"]}


def read_dump(directory: Path) -> pa.Table:
    files = sorted(directory.glob("*.parquet"))
    assert files, f"no part files in {directory}"
    return pa.concat_tables([pq.read_table(f) for f in files])


def train(root: Path, name: str, *, evaluate: bool, **overrides: Any) -> dict[str, Any]:
    """Train ``DumpingGRPOTrainer`` (the recipe) for a few steps; returns its dirs, log history and trainer facts."""
    from trl import GRPOConfig

    out = root / name
    model_dir = tiny.build_model_dir(root / "model") if not (root / "model").exists() else root / "model"
    config: dict[str, Any] = dict(
        output_dir=str(out / "trl"), per_device_train_batch_size=PER_DEVICE, gradient_accumulation_steps=GRAD_ACC,
        num_generations=NUM_GENERATIONS, max_completion_length=16, num_iterations=2, beta=0.04, learning_rate=1e-3,
        max_steps=STEPS, logging_steps=1, report_to="none", use_cpu=True, save_strategy="no", seed=0, bf16=False,
        disable_tqdm=True, eval_strategy="steps" if evaluate else "no", eval_steps=4, per_device_eval_batch_size=8,
    )
    config.update(overrides)
    from transformers import AutoTokenizer

    trainer_cls = recipe_namespace()["DumpingGRPOTrainer"]
    kwargs: dict[str, Any] = {"dump_dir": str(out / "dump")}
    if evaluate:
        kwargs["eval_dump_dir"] = str(out / "eval_dump")
    trainer = trainer_cls(
        model=str(model_dir), reward_funcs=[tiny.reward_correct, tiny.reward_short], args=GRPOConfig(**config),
        train_dataset=tiny.make_dataset(64), eval_dataset=tiny.make_dataset(4, seed=1) if evaluate else None,
        processing_class=AutoTokenizer.from_pretrained(model_dir), **kwargs,
    )
    trainer.train()  # on the one torch thread the tests' conftest pins: a second only spin-waits on 2 cores
    return {
        "dump": out / "dump", "eval_dump": out / "eval_dump", "log": trainer.state.log_history,
        "steps": config["max_steps"],
        "eos_token_ids": list(trainer.eos_token_ids), "pad_token_id": trainer.processing_class.pad_token_id,
    }


def train_log(run: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {int(e["step"]): e for e in run["log"] if "loss" in e}


def eval_log(run: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {int(e["step"]): e for e in run["log"] if "eval_loss" in e}


def per_micro_batch_reference(table: pa.Table, epsilon: float = EPSILON) -> dict[int, dict[str, float]]:
    """TRL's ``entropy``, ``clip_ratio/*`` and ``kl`` per step, rebuilt from the dump (float64).

    ``GRPOTrainer._compute_loss`` computes each as a masked token mean over one micro-batch (``global_masked_mean``)
    and ``GRPOTrainer.log`` averages the micro-batch values of the logging window; coef = exp(new − old) with
    TRL's old = ``prox_logp`` (1 when absent); kl = k3(ref, new) × coef (``use_bias_correction_kl``).
    """
    rows = table.to_pylist()
    per_mb: dict[tuple[int, int], dict[str, list[float]]] = {}
    for row in rows:
        key = (row["step"], row["micro_batch"])
        acc = per_mb.setdefault(key, {"n": [0.0], "entropy": [0.0], "low": [0.0], "high": [0.0], "kl": [0.0]})
        mask = np.asarray(row["loss_mask"], dtype=bool)
        new = np.asarray(row["new_logp"], dtype=np.float64)[mask]
        prox = np.asarray(row["prox_logp"], dtype=np.float64)[mask] if "prox_logp" in row else new
        coef = np.exp(new - prox)
        adv = row["advantages"]
        acc["n"][0] += mask.sum()
        acc["entropy"][0] += np.asarray(row["entropy"], dtype=np.float64)[mask].sum()
        acc["low"][0] += ((coef < 1 - epsilon) & (adv < 0)).sum()
        acc["high"][0] += ((coef > 1 + epsilon) & (adv > 0)).sum()
        if "ref_logp" in row:
            d = np.asarray(row["ref_logp"], dtype=np.float64)[mask] - new
            acc["kl"][0] += ((np.exp(d) - d - 1) * coef).sum()
    steps: dict[int, dict[str, list[float]]] = {}
    for (step, _), acc in sorted(per_mb.items()):
        n = max(acc["n"][0], 1.0)
        values = {"entropy": acc["entropy"][0] / n, "clip_ratio/low_mean": acc["low"][0] / n,
                  "clip_ratio/high_mean": acc["high"][0] / n, "kl": acc["kl"][0] / n}
        values["clip_ratio/region_mean"] = values["clip_ratio/low_mean"] + values["clip_ratio/high_mean"]
        for key, value in values.items():
            steps.setdefault(step, {}).setdefault(key, []).append(value)
    return {step: {k: float(np.mean(v)) for k, v in keys.items()} for step, keys in steps.items()}


def mismatches(ours: dict[int, dict[str, Any]], theirs: dict[int, dict[str, Any]], key: str, prefix: str = ""
               ) -> tuple[int, list[str]]:
    """(number of steps compared, descriptions of the steps where ``key`` differs)."""
    compared, bad = 0, []
    for step, logged in sorted(theirs.items()):
        if prefix + key not in logged or logged[prefix + key] is None:
            continue
        assert step in ours, f"step {step}: TRL logged {prefix + key} but the dump has no rows for it"
        assert key in ours[step], f"step {step}: grpo-cli has no {key}"
        compared += 1
        if not close(ours[step][key], logged[prefix + key]):
            bad.append(f"step {step}: grpo-cli {ours[step][key]!r} vs TRL {logged[prefix + key]!r}")
    return compared, bad


# -- fixtures -----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("trl")


@pytest.fixture(scope="module")
def plain(root: Path) -> dict[str, Any]:
    run = train(root, "plain", evaluate=False)
    run["analysis"] = analyze(run["dump"])
    return run


@pytest.fixture(scope="module")
def with_eval(root: Path) -> dict[str, Any]:
    run = train(root, "eval", evaluate=True, max_steps=4, eval_steps=2)
    run["analysis"] = analyze(run["dump"])
    run["eval_analysis"] = analyze(run["eval_dump"])
    return run


@pytest.fixture(params=["plain", "with_eval"])
def run(request: pytest.FixtureRequest) -> dict[str, Any]:
    return request.getfixturevalue(request.param)


# -- the recipe ---------------------------------------------------------------------------------------------------
def test_recipe_block_is_a_grpo_trainer_using_the_integration():
    from trl import GRPOTrainer

    from grpo_cli.integrations.trl import GRPODumpMixin

    cls = recipe_namespace()["DumpingGRPOTrainer"]
    assert issubclass(cls, GRPOTrainer) and issubclass(cls, GRPODumpMixin)
    assert cls.__mro__.index(GRPODumpMixin) < cls.__mro__.index(GRPOTrainer)  # the hooks run before TRL's


def test_grpo_cli_import_does_not_import_trl():
    code = "import sys, grpo_cli, grpo_cli.io, grpo_cli.cli, grpo_cli.integrations; print('trl' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_completion_eos_follows_trl():
    from grpo_cli.integrations.trl import completion_eos

    eos, pad = 3, 0
    ids = torch.tensor([
        [5, 6, 3, 0],  # EOS inside: ended
        [5, 6, 7, 3],  # EOS at the last allowed position: ended, not cut off
        [5, 6, 7, 8],  # no EOS at the maximum length: cut off
        [5, 6, 7, 8],  # cut off and zeroed by mask_truncated_completions: an empty row, cut off
    ])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1], [0, 0, 0, 0]])
    assert completion_eos(ids, mask, [eos], pad).tolist() == [1, 1, 0, 0]
    assert completion_eos(ids, mask, [9], pad).tolist() == [0, 0, 0, 0]


def test_eval_dump_dir_inside_dump_dir_is_refused(tmp_path: Path):
    cls = recipe_namespace()["DumpingGRPOTrainer"]
    with pytest.raises(ValueError, match="must not contain each other"):
        cls(model="unused", dump_dir=str(tmp_path), eval_dump_dir=str(tmp_path / "eval"))


# -- the training dump --------------------------------------------------------------------------------------------
def test_dump_steps_ids_and_forwards(run: dict[str, Any]):
    table = read_dump(run["dump"])
    logged = train_log(run)
    steps = table.column("step").to_pylist()
    n_steps = run["steps"]
    assert sorted(set(steps)) == sorted(logged) == list(range(1, n_steps + 1))  # the steps TRL logged
    rows = table.to_pylist()
    for step in range(1, n_steps + 1):
        in_step = [r for r in rows if r["step"] == step]
        assert len(in_step) == GRAD_ACC * PER_DEVICE
        # two micro-batches per step, numbered across the run
        assert sorted({r["micro_batch"] for r in in_step}) == [GRAD_ACC * (step - 1) + i for i in range(GRAD_ACC)]
        # num_iterations=2: steps 2k-1 and 2k train the same 16 completions of generation k
        generation = (step - 1) // 2
        first = generation * GRAD_ACC * PER_DEVICE
        assert sorted(r["seq_id"] for r in in_step) == list(range(first, first + GRAD_ACC * PER_DEVICE))
        assert all(r["group_id"] == r["seq_id"] // NUM_GENERATIONS for r in in_step)
        for r in in_step:
            assert len(r["new_logp"]) == len(r["entropy"]) == len(r["prox_logp"]) == len(r["ref_logp"])
            assert r["eos"] in (0, 1) and r["rewards"] in (0.0, 0.5, 1.0, 1.5)
            if r["eos"] == 0:
                assert len(r["new_logp"]) == 16  # cut off at max_completion_length
    # the second iteration's forward is a different forward (after an optimizer step), written under its own step
    first_pass = {r["seq_id"]: r["new_logp"] for r in rows if r["step"] == 1}
    second_pass = {r["seq_id"]: r["new_logp"] for r in rows if r["step"] == 2}
    assert first_pass.keys() == second_pass.keys()
    assert any(first_pass[k] != second_pass[k] for k in first_pass)
    assert run["analysis"]["metrics"]["groups/n"] == n_steps // 2 * GRAD_ACC * PER_DEVICE // NUM_GENERATIONS


def test_keys_in_common_are_the_known_ones(run: dict[str, Any]):
    ours = set().union(*(m.keys() for m in by_step(run["analysis"]).values()))
    theirs = set().union(*(e.keys() for e in train_log(run).values()))
    assert ours & theirs == set(AGREE) | set(PER_MICRO_BATCH)


@pytest.mark.parametrize("key", AGREE)
def test_analyze_equals_trl_log(run: dict[str, Any], key: str):
    compared, bad = mismatches(by_step(run["analysis"]), train_log(run), key)
    assert compared == run["steps"] // 2  # TRL logs these on the steps that generate (every other one)
    assert not bad, bad


@pytest.mark.parametrize("key", PER_MICRO_BATCH)
def test_analyze_equals_trl_log_per_micro_batch_keys(run: dict[str, Any], key: str):
    compared, bad = mismatches(by_step(run["analysis"]), train_log(run), key)
    assert compared == run["steps"]  # TRL logs these on every step (_compute_loss runs on every micro-batch)
    assert not bad, bad


@pytest.mark.parametrize("key", PER_MICRO_BATCH)
def test_eval_analyze_equals_trl_eval_log_per_micro_batch_keys(with_eval: dict[str, Any], key: str):
    compared, bad = mismatches(by_step(with_eval["eval_analysis"]), eval_log(with_eval), key, prefix="eval_")
    assert compared == 2
    assert not bad, bad


@pytest.mark.parametrize("key", [k for k in PER_MICRO_BATCH if k not in ("clip_ratio/low_min", "clip_ratio/high_max")])
def test_micro_batch_column_rebuilds_trl_averages(run: dict[str, Any], key: str):
    reference = per_micro_batch_reference(read_dump(run["dump"]))
    compared, bad = mismatches(reference, train_log(run), key)
    assert compared == run["steps"]
    assert not bad, bad


def test_metadata(plain: dict[str, Any]):
    from grpo_cli.io import read_metadata

    meta = read_metadata(sorted(plain["dump"].glob("*.parquet"))[0])
    assert meta["framework"] == "trl" and meta["framework_version"] == trl.__version__
    assert meta["split"] == "train" and meta["window"] == "response" and meta["num_iterations"] == 2
    assert meta["temperature"] == 1.0 and meta["logprobs_mode"] == "none"
    assert meta["use_bias_correction_kl"] is True and meta["generation_batch_size"] == GRAD_ACC * PER_DEVICE
    rows = read_dump(plain["dump"]).to_pylist()  # one generation batch per pair of steps (num_iterations=2)
    assert all(r["seq_id"] // meta["generation_batch_size"] == (r["step"] - 1) // 2 for r in rows)


# -- evaluation ---------------------------------------------------------------------------------------------------
def test_eval_dump_is_its_own_split(with_eval: dict[str, Any]):
    from grpo_cli.io import read_metadata

    logged = eval_log(with_eval)
    assert sorted(logged) == [2, 4]
    files = sorted(with_eval["eval_dump"].glob("*.parquet"))
    assert {read_metadata(f)["split"] for f in files} == {"eval"}
    assert {read_metadata(f)["generation_batch_size"] for f in files} == {8}  # one eval batch
    table = read_dump(with_eval["eval_dump"])
    assert sorted(set(table.column("step").to_pylist())) == [2, 4]  # the steps of the eval_* log entries
    # 4 prompts x 4 generations per evaluation, in batches of 8: 2 micro-batches each
    for step in (2, 4):
        rows = [r for r in table.to_pylist() if r["step"] == step]
        assert len(rows) == 16 and len({r["micro_batch"] for r in rows}) == 2
    assert {read_metadata(f)["split"] for f in with_eval["dump"].glob("*.parquet")} == {"train"}


@pytest.mark.parametrize("key", ["reward", "frac_reward_zero_std", "completions/mean_length",
                                 "completions/clipped_ratio"])
def test_eval_analyze_equals_trl_eval_log(with_eval: dict[str, Any], key: str):
    # TRL averages eval metrics over equal-sized eval batches: for these means that equals the pooled value
    compared, bad = mismatches(by_step(with_eval["eval_analysis"]), eval_log(with_eval), key, prefix="eval_")
    assert compared == 2
    assert not bad, bad


@pytest.mark.parametrize("key", [k for k in PER_MICRO_BATCH if k not in ("clip_ratio/low_min", "clip_ratio/high_max")])
def test_eval_micro_batch_column_rebuilds_trl_averages(with_eval: dict[str, Any], key: str):
    reference = per_micro_batch_reference(read_dump(with_eval["eval_dump"]))
    compared, bad = mismatches(reference, eval_log(with_eval), key, prefix="eval_")
    assert compared == 2
    assert not bad, bad


# -- mask_truncated_completions -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def masked(root: Path) -> dict[str, Any]:
    run = train(root, "masked", evaluate=False, mask_truncated_completions=True, num_iterations=1, max_steps=2)
    run["analysis"] = analyze(run["dump"])
    return run


def test_mask_truncated_rows_are_empty_and_cut_off(masked: dict[str, Any]):
    rows = read_dump(masked["dump"]).to_pylist()
    assert len(rows) == 2 * GRAD_ACC * PER_DEVICE
    cut = [r for r in rows if r["eos"] == 0]
    assert cut and all(len(r["new_logp"]) == 0 for r in cut)  # zeroed by TRL: not trained on, stored empty
    assert all(len(r["new_logp"]) > 0 for r in rows if r["eos"] == 1)
    assert "prox_logp" not in read_dump(masked["dump"]).column_names  # TRL skips the recompute here


@pytest.mark.parametrize("key", ["reward", "frac_reward_zero_std", "completions/clipped_ratio"])
def test_mask_truncated_analyze_equals_trl_log(masked: dict[str, Any], key: str):
    compared, bad = mismatches(by_step(masked["analysis"]), train_log(masked), key)
    assert compared == 2
    assert not bad, bad


def test_close_dumps_finishes_the_part_files_and_forgets_the_writers(tmp_path: Path):
    """``close_dumps`` writes what the writers hold, closes them, and leaves none open (a later forward opens new)."""
    from grpo_cli.integrations.trl import GRPODumpMixin
    from grpo_cli.io import RolloutWriter

    trainer = object.__new__(GRPODumpMixin)  # no GRPOTrainer needed: close_dumps only touches the writers
    writer = RolloutWriter(tmp_path / "train")
    writer.add(step=1, new_logp=torch.tensor([[-0.5, -1.0]]))
    trainer._grpo_writers = {"train": writer}
    assert not list((tmp_path / "train").glob("*.parquet"))  # still buffered
    trainer.close_dumps()
    assert trainer._grpo_writers == {}
    parts = sorted((tmp_path / "train").glob("*.parquet"))
    assert len(parts) == 1 and pq.read_table(parts[0]).num_rows == 1
    with pytest.raises(ValueError, match="closed"):
        writer.add(step=2, new_logp=torch.tensor([[-0.5]]))
