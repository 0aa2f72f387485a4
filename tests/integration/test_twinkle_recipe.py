"""The twinkle recipe's metric against twinkle-kit 0.5.1's own training path (``docs/recipes/twinkle.md``).

twinkle cannot train a real model here, so the test runs twinkle's own code from its pinned wheel (``pip download
--no-deps twinkle-kit==0.5.1``, unpacked; heavy imports stubbed as in the peers tier): samples encoded as
``Template`` encodes them (its ``_roll_labels``: labels rolled by −1, −100 off the response), the real
``InputProcessor`` (collation, padding), ``TransformersModel.forward_backward`` / ``forward`` / ``calculate_loss`` /
``backward`` / ``calculate_metric`` and ``add_metric`` run on a model object that holds only what those methods
read, with twinkle's ``GRPOLoss`` and a lookup-table "model" (logits depend on the current token only). The metric
sees what twinkle hands it (one forward later, ``step=cur_step − 1``); the dump must hold the token-aligned tensors
that went in.
"""

from __future__ import annotations

import importlib
import itertools
import re
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _peer_wheels import STUBS, framework_modules, unpacked_wheel
from dump_columns import f32, read_columns
from online_recipe import FAULTS, behaviour, check, online_code, record_feeds

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "docs" / "recipes" / "twinkle.md"
VOCAB = 9
# Micro-batches of (prompt, response, sampler log-probs of the response tokens, advantage), each with the forms its
# keyword arguments take in that call (every form GRPOLoss._pad_and_align_to_batch reads).
MICRO_BATCHES = [
    ([([1, 2], [3, 4, 5], [-0.5, -0.25, -1.0], 1.0), ([6], [7, 8], [-0.125, -2.0], -1.0)],
     {"old": "response_lists", "adv": "scalars", "ref": "tensor"}),
    ([([2, 3, 4], [5], [-0.75], 0.5), ([8, 1], [2, 3, 4, 5], [-1.5, -0.0625, -0.375, -3.0], -0.5)],
     {"old": "full_rows", "adv": "response_lists", "ref": "response_lists"}),
    ([([7], [6, 5], [-0.625, -1.25], 0.25)], {"old": "tensor", "adv": "tensor", "ref": "tensor"}),
    ([([3], [1, 1], [-0.25, -0.5], -0.25)], {"old": "response_lists", "adv": "scalars", "ref": "full_rows"}),
    ([([4, 4], [2], [-2.5], 2.0)], {"old": "response_lists", "adv": "scalars", "ref": "tensor"}),
]
JUNK = 7.0  # on positions the loss never reads


class TableModel(torch.nn.Module):
    """The causal LM: logits at position t depend on token t only (a learnable table)."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(table.clone())

    def forward(self, input_ids: torch.Tensor, **kwargs: Any) -> dict[str, Any]:
        return {"logits": self.table[input_ids]}


@pytest.fixture(scope="module")
def twinkle_modules() -> Iterator[dict[str, Any]]:
    root = unpacked_wheel("twinkle-kit", "0.5.1")
    # megatron stays absent (not stubbed): twinkle's selective_log_softmax takes its vocab-parallel path when the
    # import succeeds.
    stubs = tuple(name for name in STUBS if name != "megatron")
    with framework_modules("twinkle", root, "0.5.1", ["transformers"], stubs=stubs) as (transformers,):
        # The stub's classes have a metaclass of their own; TransformersModel also derives from an ABC.
        transformers.PreTrainedModel = type("PreTrainedModel", (), {})
        # twinkle's package __init__ (a lazy module) is not run here; its Platform would pick a GPU: this is a CPU.
        importlib.import_module("twinkle").Platform = types.SimpleNamespace(
            get_local_device=lambda *a, **k: "cpu", device_prefix=lambda *a, **k: "cpu")
        names = ["twinkle.model.transformers.transformers", "twinkle.processor", "twinkle.template.base",
                 "twinkle.loss.grpo"]
        model_mod, processor, template, loss = (importlib.import_module(n) for n in names)
        yield {"model": model_mod, "processor": processor, "template": template, "loss": loss}


def _model(mods: dict[str, Any], table: torch.Tensor) -> Any:
    """A ``TransformersModel`` holding only what its forward/backward/metric methods read (no weights loaded)."""
    model_mod = mods["model"]
    model = object.__new__(model_mod.TransformersModel)
    group = model_mod.OptimizerGroup()  # twinkle's own, with its default train metrics
    # entropy_coef > 0: the loss requires entropies, so the forward adds outputs["entropies"]
    group.loss_instance = mods["loss"].GRPOLoss(epsilon=0.2, entropy_coef=0.01)
    group.processor = mods["processor"].InputProcessor(padding_free=False)
    attrs = {"optimizer_group": {"default": group}, "active_group": "default", "model": TableModel(table),
             "_model_wrapped": True, "sp_strategy": None, "hf_config": None, "device_mesh": None,
             "mixed_precision": "no", "_router_replay_enabled": False}
    for name, value in attrs.items():
        object.__setattr__(model, name, value)
    return model


def _encode(template: Any, prompt: list[int], response: list[int]) -> dict[str, Any]:
    """One sample as ``Template.encode`` leaves it: attention fields, then twinkle's own ``_roll_labels``."""
    seq = prompt + response
    feature = {"input_ids": np.array(seq), "labels": np.array([-100] * len(prompt) + response),
               "attention_mask": np.ones(len(seq), dtype=np.int64), "position_ids": np.arange(len(seq)),
               "length": len(seq)}
    (rolled,) = template.Template._roll_labels(None, feature)
    return rolled


@pytest.fixture(params=[False], ids=["dump"])
def recipe(twinkle_modules: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
           request: pytest.FixtureRequest) -> types.ModuleType:
    """The recipe's metric module (``request.param``: with the page's Diagnoser diff applied and the README's helper
    in the module)."""
    blocks = re.findall(r"```python\n(.*?)```", RECIPE.read_text(), flags=re.S)
    assert len(blocks) == 1, "twinkle.md: one metric module"
    monkeypatch.setenv("GRPO_DUMP_DIR", str(tmp_path / "dump"))
    hook = types.ModuleType("grpo_dump_twinkle")
    monkeypatch.setitem(sys.modules, "grpo_dump_twinkle", hook)
    code = online_code(RECIPE, blocks[0]) if request.param else blocks[0]
    exec(compile(code, str(RECIPE), "exec"), hook.__dict__)
    return hook


def _ref_truth(seq: list[int]) -> list[float]:
    """Token-aligned reference-model log-probs of a sequence (value t belongs to token t)."""
    return [0.0] + [-0.01 * (7 * a + b) for a, b in itertools.pairwise(seq)]


def _kwargs(batch: list[tuple[Any, ...]], forms: dict[str, Any], width: int) -> dict[str, Any]:
    """The keyword arguments of one ``forward_backward`` call, in the forms ``forms`` names; ``[B, T]`` values are
    next-token aligned like twinkle's labels (slot j scores token j + 1)."""

    def slots(prompt: list[int], per_response_token: list[float], fill: float) -> list[float]:
        row = [fill] * width
        row[len(prompt) - 1:len(prompt) - 1 + len(per_response_token)] = per_response_token
        return row

    kwargs: dict[str, Any] = {}
    old = {"response_lists": [lp for _, _, lp, _ in batch],
           "full_rows": [slots(p, lp, JUNK) for p, _, lp, _ in batch],  # e.g. a Tinker datum's logprobs
           "tensor": torch.tensor([slots(p, lp, JUNK) for p, _, lp, _ in batch])}
    kwargs["old_logps"] = old[forms["old"]]
    adv = {"scalars": [a for *_, a in batch], "response_lists": [[a] * len(r) for _, r, _, a in batch],
           "tensor": torch.tensor([a for *_, a in batch])}
    kwargs["advantages"] = adv[forms["adv"]]
    ref_rows = [(_ref_truth(p + r)[1:] + [JUNK] * width)[:width] for p, r, _, _ in batch]
    ref = {"tensor": torch.tensor(ref_rows),  # a reference model's forward_only over the same micro-batch
           "full_rows": ref_rows, "response_lists": [_ref_truth(p + r)[len(p):] for p, r, _, _ in batch]}
    kwargs["ref_logps"] = ref[forms["ref"]]
    return kwargs


TABLE = torch.linspace(-2.0, 2.0, VOCAB * VOCAB).reshape(VOCAB, VOCAB).cos() * 2.5  # the model's logits


def _train(twinkle_modules: dict[str, Any], recipe: types.ModuleType, micro_batches: list[Any],
           accumulation: int) -> list[int]:
    """twinkle's GRPO cookbook loop, one ``forward_backward`` per micro-batch, with the recipe's metric added;
    returns each sample's expected ``step`` (the updates applied before its forward)."""
    model = _model(twinkle_modules, TABLE)
    model.add_metric(recipe.DumpRollouts, is_training=True)
    group = model.optimizer_group["default"]
    optimizer_steps, expected_steps = 0, []
    for batch, forms in micro_batches:
        inputs = [_encode(twinkle_modules["template"], p, r) for p, r, _, _ in batch]
        width = max(len(p) + len(r) for p, r, _, _ in batch)
        model.forward_backward(inputs=inputs, gradient_accumulation_steps=accumulation,
                               **_kwargs(batch, forms, width))
        expected_steps += [optimizer_steps] * len(batch)
        if group.do_grad_sync(accumulation):  # twinkle's own rule for when clip_grad_and_step updates
            optimizer_steps += 1
    model.calculate_metric(is_training=True)  # accumulates the last micro-batch, then calculate() flushes
    group.train_status.metrics[-1].writer.close()
    return expected_steps


@pytest.mark.parametrize("accumulation", [1, 2])
def test_twinkle_recipe_on_twinkle_training_path(twinkle_modules: dict[str, Any], recipe: types.ModuleType,
                                                 tmp_path: Path, accumulation: int):
    table = TABLE
    expected_steps = _train(twinkle_modules, recipe, MICRO_BATCHES, accumulation)

    logp = torch.log_softmax(table.double(), dim=-1)  # float64 reference: logp[a, b] = log p(next = b | a)
    entropy_of = -(logp.exp() * logp).sum(-1)
    samples = [s for batch, _ in MICRO_BATCHES for s in batch]
    got = read_columns(tmp_path / "dump")
    assert got["lengths"] == [len(p) + len(r) for p, r, _, _ in samples]  # padding is not a token
    assert got["step"] == expected_steps
    for k, (prompt, response, sampled, advantage) in enumerate(samples):
        seq = prompt + response
        mask = [False] * len(prompt) + [True] * len(response)

        def on_mask(column: str, row: int = k, where: list[bool] = mask) -> list[float]:
            return [v for v, m in zip(got[column][row], where) if m]

        assert got["loss_mask"][k] == mask
        assert got["old_logp"][k] == f32([0.0] * len(prompt) + sampled)  # as GRPOLoss aligned it (0 elsewhere)
        assert on_mask("advantages") == [advantage] * len(response)
        new = [float(logp[a, b]) for a, b in itertools.pairwise(seq)]
        assert on_mask("new_logp") == pytest.approx(new[len(prompt) - 1:], abs=1e-5)
        ent = [float(entropy_of[a]) for a in seq[:-1]]
        assert on_mask("entropy") == pytest.approx(ent[len(prompt) - 1:], abs=1e-5)
        assert on_mask("ref_logp") == f32(_ref_truth(seq)[len(prompt):])


def _sampled(fault: str | None, n: int = 24) -> list[Any]:
    """Micro-batches of 4 samples an engine drew from :data:`TABLE` (healthy, or with ``fault``), the keyword forms
    cycling through :data:`MICRO_BATCHES`' (every form ``GRPOLoss._pad_and_align_to_batch`` reads)."""
    g = torch.Generator().manual_seed(13)
    samples = []
    for i in range(n):
        prompt = torch.randint(0, VOCAB, (1 + i % 3,), generator=g).tolist()
        response, logps = behaviour(TABLE, prompt, 3 + i % 5, fault, g)
        samples.append((prompt, response, logps, [-1.5, -0.5, 0.5, 1.5][(i * 3) % 4]))
    return [(samples[k:k + 4], MICRO_BATCHES[(k // 4) % len(MICRO_BATCHES)][1]) for k in range(0, n, 4)]


@pytest.mark.parametrize("recipe", [True], ids=["online"], indirect=True)
@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("fault", [None, *FAULTS])
def test_twinkle_recipe_findings_while_training(twinkle_modules: dict[str, Any], recipe: types.ModuleType,
                                                tmp_path: Path, accumulation: int, fault: str | None):
    # The page's Diagnoser call (twinkle.md, "Findings while training") in the metric's accumulate, on what
    # twinkle's training path hands it (next-token aligned [B, T], old_logps/advantages in every form the loss
    # reads); each optimizer step is a Diagnoser step, ended by the README helper when the next begins.
    feeds = record_feeds(recipe)
    micro_batches = _sampled(fault)
    expected_steps = _train(twinkle_modules, recipe, micro_batches, accumulation)
    recipe.diagnoser.step_end(recipe._open_step)  # the page: once more after the last step
    assert [call["step"] for call in feeds for _ in range(call["new_logp"].shape[0])] == expected_steps
    check(recipe.diagnoser, tmp_path / "dump", fault)
