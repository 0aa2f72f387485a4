"""Findings calibrated on a real TRL ``GRPOTrainer`` (CPU, a tiny model built here, nothing downloaded).

The detectors that compare behaviour with training log-probs need the engine's log-probs (``old_logp``). Here the
engine is TRL's own ``rollout_func`` hook: :func:`engine` samples with the policy's ``generate`` at TRL's sampling
settings and returns the sampled tokens' log-probs, as vLLM does (``processed_logprobs``: after the temperature);
TRL carries them as ``sampling_per_token_logps``, which the recipe's ``DumpingGRPOTrainer`` writes as ``old_logp``
beside TRL's recompute (``prox_logp``, ``num_iterations=2``), the reference (``ref_logp``, ``beta=0.04``) and the
rows emptied by ``mask_truncated_completions``.

- **Healthy**: 4 generation batches of 64 completions (64 groups of 4, 512 dumped forwards) at temperature 0.7.
  ``analyze --format json`` reports nothing at warning or error and nothing inconclusive, and the evidence is
  conclusive (each interval clear of its warning threshold), so the quiet verdict is not a lack of data. The model
  is tilted towards EOS and one reward is graded so that the run is healthy by the detectors' own standards: few
  truncated completions (GRP402), rewards that differ within groups (GRP304), a learning rate whose updates stay
  within the clip range (GRP206: at 1e-4 Adam's first, sign-like step already clips 10–20 % of the
  next step's tokens).
- **Faults**, each driven through the trainer where real stacks break and named by its finding, the only one at
  warning or error: the engine reports pre-temperature log-probs (vLLM's default ``logprobs_mode=raw_logprobs``;
  TRL warns about it) → GRP102 with T_behaviour/T_train = 1/0.7; the engine samples at its own 0.7 while the trainer
  scores at ``GRPOConfig.temperature = 1`` → GRP102 with 0.7; the engine's log-probs placed one token late (the
  next-token alignment slip) → GRP101. A learning rate of 1e-3 (each update moves the policy too far) → GRP206.
- **Earlier false alarms, fixed** (their preconditions asserted by ordinary tests): the reference equal to the
  policy in the first steps (GRP106) stays quiet; rows emptied by ``mask_truncated_completions`` stay in their
  groups and leave GRP302/GRP303 quiet; the second iteration's ``new_logp`` of a fast policy is not read as
  re-tokenisation (GRP108), since the same-weights ``prox_logp`` still scores the token as the engine did.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import tiny

pytestmark = pytest.mark.integration
tiny.import_trl()  # the whole tier skips with one line without TRL

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "docs" / "recipes" / "trl.md"
TEMPERATURE = 0.7  # GRPOConfig.temperature: TRL samples and scores at it
#: Generation batches of the healthy run (num_iterations=2: two steps each). The binding statistics are the zero counts
#: graded by Wilson intervals: 0 of n sequences lies below GRP101's 2 % from n ≈ 190 sequences of at least 4 tokens,
#: below GRP108's 1 % from n ≈ 380. Measured: 2 batches leave both inconclusive (upper bounds 2.7 %, 1.5 %), 3 leave
#: GRP101's (2.3 %), 4 settle both (1.6 %, 0.75 %).
GENERATIONS = 4
FAULT_GENERATIONS = 2  # a fault is conclusive on half the data
PER_DEVICE = 32  # completions per micro-batch
GRAD_ACC = 2  # micro-batches per step: a generation batch is 64 completions, 16 groups
NUM_GENERATIONS = 4
LOUD = ("inconclusive", "warning", "error")


# -- the run ------------------------------------------------------------------------------------------------------
def recipe_trainer() -> type:
    """``DumpingGRPOTrainer``: the one python block of docs/recipes/trl.md, executed as printed."""
    blocks = re.findall(r"```python\n(.*?)```", RECIPE.read_text(), flags=re.S)
    assert len(blocks) == 1, f"{RECIPE} must have exactly one python block, found {len(blocks)}"
    namespace: dict[str, Any] = {"__name__": "trl_recipe"}
    exec(compile(blocks[0], str(RECIPE), "exec"), namespace)
    return namespace["DumpingGRPOTrainer"]


def build_model(path: Path, eos_weight: float = 110.0) -> Path:
    """``tiny``'s model with an EOS hazard: residual dimension 0 holds 1 on every token (no layer writes to it) and
    the EOS row of the LM head reads it, so EOS gets a logit bonus of ``eos_weight`` / rms(residual) at every
    position. The random model alone ends ~5 % of its completions within 16 tokens (GRP402 rightly reports the
    rest cut off); with the bonus ~99 % end within 24 (TRL's ``completions/clipped_ratio`` 0–2 %), most within a
    few tokens."""
    from transformers import LlamaForCausalLM

    tiny.build_model_dir(path)
    model = LlamaForCausalLM.from_pretrained(path)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 1.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0, :] = 0.0
            layer.mlp.down_proj.weight[0, :] = 0.0
        model.lm_head.weight[model.config.eos_token_id, 0] = eos_weight
    model.save_pretrained(path)
    return path


def reward_digits(completions: list[str], **kwargs: Any) -> list[float]:
    """The fraction of the first four words that are numbers: graded, so the samples of a prompt rarely tie."""
    return [sum(word.isdigit() for word in text.split()[:4]) / 4 for text in completions]


def engine(*, logprobs_mode: str = "processed", temperature: float | None = None, late: int = 0) -> Any:
    """A TRL ``rollout_func``: one completion per prompt from the policy's ``generate`` (TRL's sampling settings,
    or ``temperature``), with the sampled tokens' log-probs as an inference engine reports them.

    Args:
        logprobs_mode: ``"processed"`` (after the temperature, vLLM ``processed_logprobs``) or ``"raw"`` (the
            logits' own softmax, vLLM's default ``raw_logprobs``).
        temperature: the engine's own sampling temperature (default: the trainer's ``GRPOConfig.temperature``).
        late: place each log-prob this many tokens late (value t belongs to token t − late; rolled, so the
            first slots hold the last tokens' values).
    """

    def rollout(prompts: list[str], trainer: Any) -> dict[str, Any]:
        prompt_ids = trainer.processing_class(text=prompts)["input_ids"]  # as TRL tokenizes plain-text prompts
        pad = trainer.processing_class.pad_token_id
        width = max(len(p) for p in prompt_ids)
        ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompt_ids])
        attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids])
        config = copy.deepcopy(trainer.generation_config)  # TRL's sampling settings
        config.update(output_scores=True, output_logits=True, return_dict_in_generate=True)
        if temperature is not None:
            config.temperature = temperature
        model = trainer.accelerator.unwrap_model(trainer.model)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=attention, generation_config=config)
        completions = out.sequences[:, width:]
        per_step = out.scores if logprobs_mode == "processed" else out.logits  # processed: logits / T (top_k 0)
        logps = torch.log_softmax(torch.stack(per_step, dim=1).float(), dim=-1)
        logps = logps.gather(-1, completions.unsqueeze(-1)).squeeze(-1)
        eos = set(trainer.eos_token_ids)
        completion_ids, logprobs = [], []
        for tokens, values in zip(completions.tolist(), logps.tolist()):
            n = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))  # up to and including EOS
            values = values[:n]
            if late:
                values = values[-late:] + values[:-late]
            completion_ids.append(tokens[:n])
            logprobs.append(values)
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs}

    return rollout


def train(root: Path, model_dir: Path, name: str, rollout: Any, generations: int, **overrides: Any) -> Path:
    """Train the recipe's ``DumpingGRPOTrainer`` with ``rollout`` as its engine; returns the dump directory."""
    from transformers import AutoTokenizer
    from trl import GRPOConfig

    out = root / name
    config: dict[str, Any] = dict(
        output_dir=str(out / "trl"), per_device_train_batch_size=PER_DEVICE, gradient_accumulation_steps=GRAD_ACC,
        num_generations=NUM_GENERATIONS, max_completion_length=24, num_iterations=2, beta=0.04,
        learning_rate=3e-5, max_steps=2 * generations, temperature=TEMPERATURE, mask_truncated_completions=True,
        logging_steps=1, report_to="none", use_cpu=True, save_strategy="no", seed=0, bf16=False, disable_tqdm=True,
    )
    config.update(overrides)
    prompts = PER_DEVICE * GRAD_ACC // NUM_GENERATIONS * generations
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*'rollout_func', which is an experimental feature")
        trainer = recipe_trainer()(
            model=str(model_dir), reward_funcs=[tiny.reward_correct, reward_digits], args=GRPOConfig(**config),
            train_dataset=tiny.make_dataset(prompts), processing_class=AutoTokenizer.from_pretrained(model_dir),
            rollout_func=rollout, dump_dir=str(out / "dump"),
        )
    trainer.train()  # on the conftest's one thread: two threads only spin-wait on a shared machine
    return out / "dump"


def findings(dump: Path) -> list[dict[str, Any]]:
    """``grpo-cli analyze DUMP --format json``'s findings, run in-process through the CLI."""
    from grpo_cli.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["analyze", str(dump), "--format", "json", "-q"])
    assert code == 0
    return json.loads(out.getvalue())["findings"]


def evidence(dump: Path) -> dict[str, Any]:
    """Every ``diag/*`` figure of the dump (the library: the CLI prints only the figures of reported findings)."""
    from grpo_cli import AnalyzeConfig, RolloutDataset, analyze
    from grpo_cli.findings import DetectConfig

    result = analyze(RolloutDataset(sorted(dump.glob("*.parquet"))), AnalyzeConfig(), findings=DetectConfig())
    return dict(result.evidence)


def read_dump(dump: Path) -> pa.Table:
    return pa.concat_tables([pq.read_table(f) for f in sorted(dump.glob("*.parquet"))])


def loud(found: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    return [(f["code"], f["severity"], f["title"]) for f in found if f["severity"] in LOUD]


def named(found: list[dict[str, Any]], code: str) -> dict[str, Any]:
    hits = [f for f in found if f["code"] == code]
    assert hits, f"{code} is not reported; findings: {[(f['code'], f['severity']) for f in found]}"
    return hits[0]


# -- fixtures -----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("trl_findings")


@pytest.fixture(scope="module")
def model_dir(root: Path) -> Path:
    return build_model(root / "model")


@pytest.fixture(scope="module")
def healthy(root: Path, model_dir: Path) -> dict[str, Any]:
    dump = train(root, model_dir, "healthy", engine(), GENERATIONS)
    return {"dump": dump, "findings": findings(dump), "evidence": evidence(dump)}


#: name → (engine, GRPOConfig overrides, the injected T_behaviour/T_train)
TEMPERATURE_FAULTS = {
    # sampled at GRPOConfig.temperature = 0.7, reported before it (T = 1); TRL scores at 0.7
    "raw_logprobs": (dict(logprobs_mode="raw"), {}, 1 / TEMPERATURE),
    # the engine's own temperature 0.7; the trainer left at GRPOConfig's default 1 scores at 1
    "engine_colder": (dict(temperature=TEMPERATURE), dict(temperature=1.0), TEMPERATURE),
}


@pytest.fixture(scope="module", params=sorted(TEMPERATURE_FAULTS))
def temperature_fault(request: pytest.FixtureRequest, root: Path, model_dir: Path) -> dict[str, Any]:
    kwargs, overrides, ratio = TEMPERATURE_FAULTS[request.param]
    dump = train(root, model_dir, request.param, engine(**kwargs), FAULT_GENERATIONS, **overrides)
    return {"name": request.param, "ratio": ratio, "findings": findings(dump)}


@pytest.fixture(scope="module")
def fast(root: Path, model_dir: Path) -> dict[str, Any]:
    """A healthy engine and a learning rate of 1e-3: each update moves the policy too far (GRP206)."""
    dump = train(root, model_dir, "fast", engine(), FAULT_GENERATIONS, learning_rate=1e-3)
    return {"dump": dump, "findings": findings(dump)}


@pytest.fixture(scope="module")
def shifted(root: Path, model_dir: Path) -> dict[str, Any]:
    dump = train(root, model_dir, "late", engine(late=1), FAULT_GENERATIONS)
    return {"dump": dump, "findings": findings(dump)}


# -- healthy ------------------------------------------------------------------------------------------------------
def test_healthy_dump_holds_every_column_the_detectors_compare(healthy: dict[str, Any]):
    table = read_dump(healthy["dump"])
    assert {"old_logp", "prox_logp", "ref_logp", "entropy", "rewards", "advantages"} <= set(table.column_names)
    rows = table.to_pylist()
    assert len(rows) == 2 * GENERATIONS * GRAD_ACC * PER_DEVICE  # every completion, once per iteration
    assert sorted({r["step"] for r in rows}) == list(range(1, 2 * GENERATIONS + 1))
    empty = [r for r in rows if not r["new_logp"]]
    assert empty and all(r["eos"] == 0 and not r["old_logp"] for r in empty)  # mask_truncated_completions
    assert len(empty) < 0.1 * len(rows)  # and few: the run is not cut at its length limit


def test_healthy_run_has_nothing_at_warning_or_error_and_nothing_inconclusive(healthy: dict[str, Any]):
    assert loud(healthy["findings"]) == []


def test_healthy_evidence_is_conclusive(healthy: dict[str, Any]):
    """Each statistic's 95 % interval lies on the healthy side of its warning threshold: the run is long enough
    that the quiet verdict is a finding, not a lack of data."""
    from grpo_cli._intervals import wilson
    from grpo_cli.findings.thresholds import (
        MULT_ERROR_WARNING,
        ONESIDED_WARNING,
        RETOK_WARNING,
        SHIFT_SEQ_WARNING,
        TAIL_WARNING,
        TEMPERATURE_WARNING,
    )

    ev = healthy["evidence"]
    ratio = ev["diag/temperature_ratio"]
    assert 1 / (1 + TEMPERATURE_WARNING) < ratio["low"] <= ratio["high"] < 1 + TEMPERATURE_WARNING, ratio
    assert ev["diag/pair_onesided"]["high"] < ONESIDED_WARNING, ev["diag/pair_onesided"]
    assert ev["diag/pair_mult_prob_error"]["high"] < MULT_ERROR_WARNING, ev["diag/pair_mult_prob_error"]
    assert ev["diag/pair_tail_frac"]["high"] < TAIL_WARNING, ev["diag/pair_tail_frac"]
    assert ev["diag/retok_seq_frac"]["high"] < RETOK_WARNING, ev["diag/retok_seq_frac"]
    n_seq = ev["diag/shift_n_seq"]
    for side in ("late", "early"):
        frac = ev[f"diag/shift_seq_{side}_frac"]
        assert wilson(round(frac * n_seq), n_seq)[1] < SHIFT_SEQ_WARNING, (side, frac, n_seq)


def test_reference_equal_to_the_policy_in_the_first_steps_is_not_flagged(healthy: dict[str, Any]):
    """``beta=0.04``: TRL's reference is the initial policy, bitwise equal to the recompute until the first update.
    Dump-wide that is above GRP106's threshold; the detector must judge the later steps only."""
    from grpo_cli.findings.thresholds import REF_EQUAL_WARNING

    assert healthy["evidence"]["diag/equal_frac/prox_ref"] >= REF_EQUAL_WARNING  # the situation is there
    assert [f for f in healthy["findings"] if f["code"] == "GRP106"] == []


def advantage_groups(dump: Path) -> list[list[dict[str, Any]]]:
    groups: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for r in read_dump(dump).to_pylist():
        groups.setdefault((r["step"], r["group_id"]), []).append(r)
    return list(groups.values())


def test_trl_centres_groups_over_the_rows_mask_truncated_completions_empties(healthy: dict[str, Any]):
    groups = advantage_groups(healthy["dump"])
    assert any(any(not r["new_logp"] for r in g) and any(r["new_logp"] for r in g) for g in groups)
    for g in groups:  # TRL centres every group over all its completions, the emptied ones included
        assert abs(sum(r["advantages"] for r in g)) < 1e-4


def test_rows_emptied_by_mask_truncated_completions_leave_advantage_findings_quiet(healthy: dict[str, Any]):
    assert [(f["code"], f["severity"]) for f in healthy["findings"] if f["code"] in ("GRP302", "GRP303")] == []


# -- faults -------------------------------------------------------------------------------------------------------
def test_temperature_fault_is_named_with_its_ratio(temperature_fault: dict[str, Any]):
    found = temperature_fault["findings"]
    finding = named(found, "GRP102")
    assert finding["category"] == "temperature" and finding["severity"] in ("warning", "error")
    ratio, injected = finding["evidence"]["diag/temperature_ratio"], temperature_fault["ratio"]
    assert ratio["low"] <= injected <= ratio["high"], (ratio, injected)
    assert abs(ratio["value"] / injected - 1) < 0.03, (ratio, injected)
    assert [code for code, _, _ in loud(found) if code != "GRP102"] == [], loud(found)


def test_log_probs_one_token_late_are_named(shifted: dict[str, Any]):
    found = shifted["findings"]
    finding = named(found, "GRP101")
    assert finding["category"] == "alignment" and finding["severity"] in ("warning", "error")
    assert "late" in finding["title"]
    assert finding["evidence"]["diag/shift_seq_late_frac"]["low"] > 0.9, finding["evidence"]
    assert [code for code, _, _ in loud(found) if code != "GRP101"] == [], loud(found)


def test_a_policy_moving_too_far_per_step_is_named(fast: dict[str, Any]):
    finding = named(fast["findings"], "GRP206")
    assert finding["category"] == "clipping" and finding["severity"] in ("warning", "error")


def test_the_fast_policy_moves_likely_tokens_by_five_nats_in_its_updates_only(fast: dict[str, Any]):
    """What GRP108 reads as re-tokenisation: tokens the engine found likely that ``new_logp`` scores ≥ 5 nats lower,
    all in the second iteration over a generation batch (even steps, one update after sampling), every one scored
    as the engine did (to 1e-4 nats) by TRL's same-weights recompute (``prox_logp``)."""
    hits = []
    for r in read_dump(fast["dump"]).to_pylist():
        for new, old, prox, valid in zip(r["new_logp"], r["old_logp"], r["prox_logp"], r["loss_mask"]):
            if valid and old >= math.log(0.2) and new <= old - 5:
                hits.append((r["step"], old, prox))
    assert hits
    assert all(step % 2 == 0 and abs(prox - old) < 1e-4 for step, old, prox in hits), hits


def test_a_policy_moving_too_far_is_not_read_as_retokenisation(fast: dict[str, Any]):
    assert [(code, severity) for code, severity, _ in loud(fast["findings"]) if code == "GRP108"] == []
