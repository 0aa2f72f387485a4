"""Findings while a real TRL ``GRPOTrainer`` trains (CPU, the tiny model of ``tiny.py``, nothing downloaded).

The python block of ``docs/recipes/trl-findings.md`` is executed as printed. Its ``train_with_findings`` trains a
subclass of its ``DiagnosedGRPOTrainer`` that plays a vLLM engine: each generation batch gets
``sampling_per_token_logps``, the log-probs of the sampled tokens under the weights that generated them, computed
outside TRL's fused head (the model's own logits, divided by the temperature). That is what vLLM returns, and TRL
without vLLM has no such tensor. Healthy, they agree with the training forward up to rounding. A fault injected from
a given step is one the detectors know: the engine reporting log-probs at temperature 0.7 against the trainer's 1.0,
or the dump code writing them one token late. It must be named at that step or the next, and
``stop_on="error"`` must stop the run there. A healthy run stays quiet at every step.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import tiny

pytestmark = pytest.mark.integration
tiny.import_trl()  # the whole tier skips with one line without TRL

import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "recipes" / "trl-findings.md"
FAULT_STEP = 3
"""The first optimizer step (as TRL logs it) whose completions carry the fault."""
MAX_STEPS = 6


def page_namespace() -> dict[str, Any]:
    """The one python block of docs/recipes/trl-findings.md, executed as printed."""
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)
    assert len(blocks) == 1, f"{PAGE} must have exactly one python block, found {len(blocks)}"
    namespace: dict[str, Any] = {"__name__": "trl_findings_page"}
    exec(compile(blocks[0], str(PAGE), "exec"), namespace)
    return namespace


def engine_trainer(base: type, fault: str | None) -> type:
    """``base`` with a vLLM-like engine's ``sampling_per_token_logps``, faulty from :data:`FAULT_STEP` on."""

    class EngineTrainer(base):  # type: ignore[misc,valid-type]
        def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
            out = super()._generate_and_score_completions(inputs)
            ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
            mask = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
            width = out["completion_ids"].shape[1]
            faulty = fault is not None and self.state.global_step + 1 >= FAULT_STEP  # the step it is trained in
            temperature = 0.7 if faulty and fault == "temperature" else self.temperature
            with torch.no_grad():
                logits = self.model(input_ids=ids, attention_mask=mask).logits[:, -width - 1:-1].float()
            logps = torch.log_softmax(logits / temperature, dim=-1)
            logps = logps.gather(-1, out["completion_ids"].unsqueeze(-1)).squeeze(-1)
            if faulty and fault == "shift":  # written one slot late, as a dump code off by one does
                logps = torch.cat([logps[:, :1], logps[:, :-1]], dim=1)
            out["sampling_per_token_logps"] = logps
            return out

    return EngineTrainer


def reward_spread(completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
    """A reward that differs between a prompt's completions (their token ids' sum mod 7, over 7): the tiny
    model's own rewards (``tiny.py``) are equal within most groups of 4 at this size, which GRP304 rightly reports as
    no learning signal."""
    return [sum(ids) % 7 / 7 for ids in completion_ids]


def train(root: Path, fault: str | None, stop_on: str | None) -> dict[str, Any]:
    from transformers import AutoTokenizer
    from trl import GRPOConfig

    model_dir = root / "model"
    if not model_dir.exists():
        tiny.build_model_dir(model_dir)
    namespace = page_namespace()
    args = GRPOConfig(
        output_dir=str(root / f"out-{fault}-{stop_on}"), per_device_train_batch_size=16,
        gradient_accumulation_steps=2, num_generations=4, max_completion_length=32, learning_rate=1e-3,
        # the random tiny model rarely samples EOS: past 12 tokens its EOS logit is raised (transformers'
        # ExponentialDecayLengthPenalty), or most completions would hit the limit, which GRP402 rightly reports
        generation_kwargs={"exponential_decay_length_penalty": (12, 1.5)},
        max_steps=MAX_STEPS, logging_steps=1, report_to="none", use_cpu=True, save_strategy="no", seed=0,
        bf16=False, disable_tqdm=True,
    )
    # on the one torch thread the tests' conftest pins: a second only spin-waits on 2 cores
    trainer, callback = namespace["train_with_findings"](
        str(model_dir), [tiny.reward_correct, reward_spread], tiny.make_dataset(64), args, stop_on=stop_on,
        trainer_cls=engine_trainer(namespace["DiagnosedGRPOTrainer"], fault),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
    )
    return {"trainer": trainer, "callback": callback, "log": [e for e in trainer.state.log_history if "loss" in e]}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("trl_online")


def loud(findings: list[dict[str, Any]]) -> list[tuple[str, str, Any]]:
    return [(f["code"], f["severity"], f["step"]) for f in findings if f["severity"] in ("warning", "error")]


def test_healthy_run_is_quiet_at_every_step(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = train(root, None, "error")
    assert run["trainer"].state.global_step == MAX_STEPS  # not stopped
    assert run["callback"].stopped_by is None
    assert loud(run["callback"].diagnoser.findings()) == []
    assert "grpo-cli GRP" not in capsys.readouterr().out  # no block printed at any step
    # the logs carry the counts at every step, beside TRL's own figures
    assert [e["findings/error"] for e in run["log"]] == [0] * MAX_STEPS
    assert all(e["findings/warning"] == 0 and "loss" in e and "reward" in e for e in run["log"])


@pytest.mark.parametrize(("fault", "code", "category"), [("temperature", "GRP102", "temperature"),
                                                         ("shift", "GRP101", "alignment")])
def test_fault_is_named_within_a_step_and_stops_the_run(
    root: Path, capsys: pytest.CaptureFixture[str], fault: str, code: str, category: str
) -> None:
    run = train(root, fault, "error")
    callback = run["callback"]
    stopped = callback.stopped_by
    assert stopped is not None, loud(callback.diagnoser.findings())
    assert (stopped["code"], stopped["category"], stopped["severity"]) == (code, category, "error")
    assert stopped["step"] in (FAULT_STEP, FAULT_STEP + 1)  # named at the fault's step or the next
    assert run["trainer"].state.global_step == stopped["step"] < MAX_STEPS  # stopped there
    # nothing was loud before the fault
    assert all(step >= FAULT_STEP for _, _, step in loud(callback.diagnoser.findings()))
    out = capsys.readouterr()
    assert out.out.count(f"grpo-cli {code} error") == 1  # its block, printed once
    assert f"stopping training at step {stopped['step']} on {code}" in out.err
    last = run["log"][-1]
    assert last["step"] == stopped["step"] and last[f"findings/{code}"] == 3 and last[f"findings/{category}"] >= 1
    assert all(e["findings/error"] == 0 for e in run["log"][:-1] if e["step"] < FAULT_STEP)
