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
from online_recipe import FAULTS, behaviour, check, online_code, record_feeds

from grpo_cli.io import RolloutWriter

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

    def __init__(self, experiences: list[Any], new_logps: list[torch.Tensor], max_epochs: int = 1) -> None:
        self.experiences, self.new_logps, self.max_epochs = experiences, new_logps, max_epochs
        self.actor_loss_fn = self._policy_loss
        self.losses: list[tuple[torch.Tensor, ...]] = []

    def _policy_loss(self, action_log_probs, old_action_log_probs, advantages, action_mask=None,
                     rollout_log_probs=None, **loss_batch_info):  # PolicyLoss returns five values
        self.losses.append((action_log_probs, old_action_log_probs, advantages, action_mask))
        zero = torch.zeros(())
        return zero, zero, zero, None, None

    def ppo_train(self, kl_ctl: float) -> None:
        for _ in range(self.max_epochs):  # ppo_actor.py: ppo_train numbers the micro-batches from 0 in every epoch
            for step, experience in enumerate(self.experiences):
                self.training_step(experience, kl_ctl, step, {"loss_scale": 1.0})

    def training_step(self, experience, kl_ctl, step, loss_batch_info=None):
        new = self.new_logps[step]  # self.actor(sequences, action_mask, ...) in OpenRLHF
        self.actor_loss_fn(new, experience.action_log_probs, experience.advantages,
                           action_mask=experience.action_mask, rollout_log_probs=experience.rollout_log_probs,
                           **(loss_batch_info or {}))
        return {}


@pytest.fixture(params=[False], ids=["dump"])
def openrlhf(openrlhf_root: Path, monkeypatch: pytest.MonkeyPatch,
             request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    """OpenRLHF's modules, the recipe's block installed (``request.param``: with the page's Diagnoser diff applied
    and the README's helper in the module)."""
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
        code = online_code(RECIPE, blocks[0]) if request.param else blocks[0]
        exec(compile(code, str(RECIPE), "exec"), hook.__dict__)
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


VOCAB = 11
TABLE = torch.linspace(-2.0, 2.0, VOCAB * VOCAB).reshape(VOCAB, VOCAB).sin() * 3.0  # the model's logits


def _sampled(fault: str | None, n: int = 24) -> list[tuple[list[int], list[int], dict[str, list[float]]]]:
    """``n`` samples an engine drew from :data:`TABLE` (healthy, or with ``fault``), with token-aligned values of the
    response tokens: the training forward and the actor's recompute (``TABLE``, float32), the engine's log-probs,
    a reference model's (another table) and group-normalised advantages (groups of 4)."""
    g = torch.Generator().manual_seed(11)
    out = []
    for i in range(n):
        prompt = torch.randint(0, VOCAB, (2 + i % 3,), generator=g).tolist()
        response, engine = behaviour(TABLE, prompt, 4 + i % 6, fault, g)
        seq = prompt + response

        def scored(table: torch.Tensor, seq: list[int] = seq, p: int = len(prompt)) -> list[float]:
            logp = torch.log_softmax(table, dim=-1)
            return [float(logp[a, b]) for a, b in zip(seq[p - 1:-1], seq[p:])]

        new = scored(TABLE)
        adv = [-1.5, -0.5, 0.5, 1.5][(i * 3) % 4]
        out.append((prompt, response, {"new": new, "prox": new, "old": engine, "ref": scored(TABLE * 0.8),
                                       "adv": [adv] * len(response)}))
    return out


@pytest.mark.parametrize("openrlhf", [True], ids=["online"], indirect=True)
@pytest.mark.parametrize("fault", [None, *FAULTS])
def test_openrlhf_recipe_findings_while_training(openrlhf: dict[str, Any], fault: str | None, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch):
    # The page's Diagnoser call (openrlhf.md, "Findings while training") in the recipe's actor_loss_fn, on
    # OpenRLHF's batched Experience (A = T - 1 next-token slots, right padding), over two PPO epochs.
    monkeypatch.setenv("GRPO_DUMP_DIR", str(tmp_path / "dump"))
    hook = openrlhf["hook"]
    # The page: with max_epochs > 1, give the writer dedupe=True (its dump then holds the first epoch)
    monkeypatch.setattr(hook, "RolloutWriter", lambda *a, **k: RolloutWriter(*a, dedupe=True, **k))
    feeds = record_feeds(hook)
    Experience = openrlhf["Experience"]
    samples = _sampled(fault)
    experiences, new_logps = [], []
    for start in range(0, len(samples), 4):  # micro-batches of 4, batched by OpenRLHF's own concat
        built = [_sample(Experience, p, r, v, index=start + k) for k, (p, r, v) in enumerate(samples[start:start + 4])]
        batch = Experience.concat_experiences([e for e, _ in built], pad_token_id=0)
        width = batch.action_mask.shape[1]
        experiences.append(batch)
        new_logps.append(torch.cat([torch.nn.functional.pad(n, (0, width - n.shape[1])) for _, n in built]))
    trainer = openrlhf["Trainer"](experiences, new_logps, max_epochs=2)
    trainer.ppo_train(0.0)
    assert len(trainer.losses) == 2 * len(experiences)  # OpenRLHF's loss ran in both epochs
    trainer._grpo_writer.close()
    hook.diagnoser.step_end(hook._open_step)  # the page: once more after the last step
    fed = sorted(int(i) for call in feeds for i in call["seq_id"])
    assert fed == list(range(len(samples))) and {call["step"] for call in feeds} == {0}  # the first epoch only
    check(hook.diagnoser, tmp_path / "dump", fault)
