"""The OpenRLHF recipe's hooks against OpenRLHF 0.11.2's own ``Experience`` (``docs/recipes/openrlhf.md``).

OpenRLHF needs Ray, DeepSpeed and vLLM, so the test takes its pinned wheel (``pip download --no-deps
openrlhf==0.11.2``, unpacked; package ``__init__`` files skipped) and uses its real
``openrlhf.trainer.ppo_utils.experience.Experience``: one experience per sample shaped as
``SamplesGenerator._process_response_into_experience`` shapes it (``action_mask = mask[1:]``: ``A = T − 1`` slots,
next-token aligned), batched by ``Experience.concat_experiences`` (right padding). ``ActorPPOTrainer`` is a stub
with 0.11.2's call signatures only (``ppo_train`` calls ``training_step(experience, kl_ctl, step,
loss_batch_info)``, which calls ``actor_loss_fn(new, old, advantages, action_mask=..., rollout_log_probs=...,
**loss_batch_info)``). The dump must hold the token-aligned tensors that went in.
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import types
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from dump_columns import f32s, read_columns

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "docs" / "recipes" / "openrlhf.md"
OPENRLHF = "openrlhf==0.11.2"
_PACKAGES = ("openrlhf", "openrlhf.utils", "openrlhf.trainer", "openrlhf.trainer.ppo_utils", "openrlhf.trainer.ray")


@pytest.fixture(scope="module")
def openrlhf_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """OpenRLHF's pinned wheel from the package index, unpacked (skips if the index cannot be reached)."""
    where = tmp_path_factory.mktemp("openrlhf_wheel")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", OPENRLHF, "-d", str(where)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    wheels = sorted(where.glob("openrlhf-*.whl"))
    if done.returncode != 0 or not wheels:
        pytest.skip(f"could not download {OPENRLHF} from the package index: {done.stderr.strip()[-200:]}")
    with zipfile.ZipFile(wheels[0]) as wheel:
        wheel.extractall(where / "src")
    purelib = sorted((where / "src").glob("openrlhf-*.data/purelib"))
    return purelib[0] if purelib else where / "src"


class ActorPPOTrainer:
    """0.11.2's ``ActorPPOTrainer`` call signatures (``openrlhf/trainer/ray/ppo_actor.py``), nothing else."""

    def __init__(self, experiences: list[Any], new_logps: list[torch.Tensor]) -> None:
        self.experiences, self.new_logps = experiences, new_logps
        self.actor_loss_fn = self._policy_loss
        self.losses: list[tuple[torch.Tensor, ...]] = []

    def _policy_loss(self, action_log_probs, old_action_log_probs, advantages, action_mask=None,
                     rollout_log_probs=None, **loss_batch_info):  # PolicyLoss returns five values
        self.losses.append((action_log_probs, old_action_log_probs, advantages, action_mask))
        zero = torch.zeros(())
        return zero, zero, zero, None, None

    def ppo_train(self, kl_ctl: float) -> None:
        for step, experience in enumerate(self.experiences):
            self.training_step(experience, kl_ctl, step, {"loss_scale": 1.0})  # ppo_actor.py: ppo_train

    def training_step(self, experience, kl_ctl, step, loss_batch_info=None):
        new = self.new_logps[step]  # self.actor(sequences, action_mask, ...) in OpenRLHF
        self.actor_loss_fn(new, experience.action_log_probs, experience.advantages,
                           action_mask=experience.action_mask, rollout_log_probs=experience.rollout_log_probs,
                           **(loss_batch_info or {}))
        return {}


@pytest.fixture
def openrlhf(openrlhf_root: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    saved = {k: v for k, v in sys.modules.items() if k.startswith(("openrlhf", "grpo_dump_openrlhf"))}
    for name in list(saved):
        del sys.modules[name]
    try:
        for name in _PACKAGES:  # skip the package __init__ files (they import deepspeed, ray, vllm, ...)
            package = types.ModuleType(name)
            package.__path__ = [str(openrlhf_root / name.replace(".", "/"))]
            sys.modules[name] = package
        try:
            importlib.import_module("transformers")
        except ImportError:  # openrlhf.utils.utils imports AutoTokenizer at the top; the test never tokenizes
            monkeypatch.setitem(sys.modules, "transformers", types.SimpleNamespace(AutoTokenizer=None))
        experience = importlib.import_module("openrlhf.trainer.ppo_utils.experience")
        ppo_actor = types.ModuleType("openrlhf.trainer.ray.ppo_actor")
        ppo_actor.ActorPPOTrainer = type("ActorPPOTrainer", (ActorPPOTrainer,), {})  # type: ignore[attr-defined]
        sys.modules["openrlhf.trainer.ray.ppo_actor"] = ppo_actor
        monkeypatch.setattr(torch.distributed, "get_rank", lambda *a, **k: 0)
        blocks = re.findall(r"```python\n(.*?)```", RECIPE.read_text(), flags=re.S)
        assert len(blocks) == 1
        hook = types.ModuleType("grpo_dump_openrlhf")
        sys.modules["grpo_dump_openrlhf"] = hook
        exec(compile(blocks[0], str(RECIPE), "exec"), hook.__dict__)
        hook.install()
        yield {"Experience": experience.Experience, "Trainer": ppo_actor.ActorPPOTrainer, "hook": hook}
    finally:
        for name in [k for k in sys.modules if k.startswith(("openrlhf", "grpo_dump_openrlhf"))]:
            del sys.modules[name]
        sys.modules.update(saved)


def _sample(Experience: Any, prompt: list[int], response: list[int], values: dict[str, list[float]], index: int):
    """One sample as ``SamplesGenerator._process_response_into_experience`` builds it (``values`` token-aligned
    over the response tokens; slot j of an ``[1, T − 1]`` tensor scores token j + 1)."""
    tokens = prompt + response
    t = len(tokens)
    action_mask = torch.zeros(t, dtype=torch.long)
    action_mask[len(prompt):] = 1

    def slots(per_response_token: list[float]) -> torch.Tensor:
        full = torch.zeros(t)
        full[len(prompt):] = torch.tensor(per_response_token)
        return full[1:].unsqueeze(0)  # token-aligned → next-token slots

    return Experience(
        sequences=torch.tensor([tokens]), attention_mask=torch.ones(1, t, dtype=torch.long),
        action_mask=action_mask[1:].unsqueeze(0).bool(), action_log_probs=slots(values["prox"]),
        base_action_log_probs=slots(values["ref"]), rollout_log_probs=slots(values["old"]),
        advantages=slots(values["adv"]), index=[index],
    ), slots(values["new"])


def test_openrlhf_recipe_on_openrlhf_experience(openrlhf: dict[str, Any], tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("GRPO_DUMP_DIR", str(tmp_path / "dump"))
    Experience = openrlhf["Experience"]
    samples = [  # (prompt, response, token-aligned values of the response tokens)
        ([11, 12], [21, 22, 23], {"new": [-0.1, -0.2, -0.3], "prox": [-0.11, -0.21, -0.31],
                                  "old": [-0.12, -0.22, -0.32], "ref": [-0.13, -0.23, -0.33], "adv": [1.0] * 3}),
        ([13, 14, 15], [24], {"new": [-0.4], "prox": [-0.41], "old": [-0.42], "ref": [-0.43], "adv": [-1.0]}),
    ]
    built = [_sample(Experience, p, r, v, index=40 + i) for i, (p, r, v) in enumerate(samples)]
    batch = Experience.concat_experiences([e for e, _ in built], pad_token_id=0)  # right padding, OpenRLHF's own
    from torch.nn.functional import pad

    width = batch.action_mask.shape[1]
    new = torch.cat([pad(n, (0, width - n.shape[1])) for _, n in built])
    trainer = openrlhf["Trainer"]([batch], [new])
    trainer.ppo_train(0.0)  # step 0
    trainer.ppo_train(0.0)  # step 1: the same experience again
    assert len(trainer.losses) == 2  # OpenRLHF's loss still runs
    trainer._grpo_writer.close()

    got = read_columns(tmp_path / "dump")
    lengths = [len(p) + len(r) for p, r, _ in samples]
    assert got["lengths"] == lengths + lengths  # attention_mask: right padding is not a token

    def token_aligned(key: str) -> list[list[float]]:  # prompt tokens 0.0; token 0 has no slot (fill 0.0)
        return [[0.0] * len(p) + v[key] for p, _, v in samples]

    assert got["new_logp"] == f32s(token_aligned("new")) * 2
    assert got["prox_logp"] == f32s(token_aligned("prox")) * 2
    assert got["old_logp"] == f32s(token_aligned("old")) * 2
    assert got["ref_logp"] == f32s(token_aligned("ref")) * 2
    assert got["loss_mask"] == [[False] * len(p) + [True] * len(r) for p, r, _ in samples] * 2
    assert got["seq_id"] == [40, 41, 40, 41]
    assert got["step"] == [0, 0, 1, 1]
