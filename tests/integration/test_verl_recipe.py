"""The verl recipe's hooks against verl 0.9.1's own data structures (``docs/recipes/verl.md``).

verl cannot train on a CPU here, so the test runs verl's own code from its pinned wheel (``pip download --no-deps
verl==0.9.1``, unpacked; ``ray`` and ``verl.workers.utils.losses`` are stubbed, verl's package ``__init__`` files
are skipped): the step batch is a ``verl.protocol.DataProto``; the driver side is what
``RayPPOTrainer._update_actor`` does with it (``DataProto.to_tensordict`` then
``verl.workers.utils.padding.left_right_2_no_padding``); the model output is a jagged nested tensor over the
no-padding sequences, which the recipe's ``ppo_loss`` un-pads with verl's ``no_padding_2_padding``. The dump must
hold the tensors that went in.
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import re
import subprocess
import sys
import types
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.integration
try:
    import tensordict  # noqa: F401  # verl's data structures are TensorDicts
except ImportError as exc:
    pytest.skip(f"tensordict cannot be imported ({exc}); pip install -e '.[dev]' runs the verl checks",
                allow_module_level=True)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from dump_columns import f32s, read_columns  # noqa: E402
from online_recipe import FAULTS, behaviour, check, online_code, record_feeds  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "docs" / "recipes" / "verl.md"
VERL = "verl==0.9.1"
_PACKAGES = ("verl", "verl.utils", "verl.workers", "verl.workers.utils", "verl.trainer", "verl.trainer.ppo")


@pytest.fixture(scope="module")
def verl_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """verl's pinned wheel from the package index, unpacked (skips if the index cannot be reached)."""
    where = tmp_path_factory.mktemp("verl_wheel")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", VERL, "-d", str(where)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    wheels = sorted(where.glob("verl-*.whl"))
    if done.returncode != 0 or not wheels:
        pytest.skip(f"could not download {VERL} from the package index: {done.stderr.strip()[-200:]}")
    with zipfile.ZipFile(wheels[0]) as wheel:
        wheel.extractall(where / "src")
    return where / "src"


@pytest.fixture
def verl(verl_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """verl's modules from the wheel, with stubs for what cannot run here; the recipe's two blocks executed."""
    with _verl(verl_root, tmp_path, monkeypatch, online=False) as modules:
        yield modules


@pytest.fixture
def verl_online(verl_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """As :func:`verl`, the worker block with the page's Diagnoser diff applied and the README's helper."""
    with _verl(verl_root, tmp_path, monkeypatch, online=True) as modules:
        yield modules


@contextlib.contextmanager
def _verl(verl_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, online: bool) -> Iterator[dict[str, Any]]:
    saved = {k: v for k, v in sys.modules.items() if k == "ray" or k.startswith(("verl", "grpo_dump_verl"))}
    for name in list(saved):
        del sys.modules[name]
    try:
        for name in _PACKAGES:  # skip verl's __init__ files (they import ray, transformers, omegaconf, ...)
            package = types.ModuleType(name)
            package.__path__ = [str(verl_root / name.replace(".", "/"))]
            sys.modules[name] = package
        ray = types.ModuleType("ray")
        ray.ObjectRef = object  # type: ignore[attr-defined]  # only an annotation in verl.protocol
        sys.modules["ray"] = ray
        calls: list[Any] = []
        losses = types.ModuleType("verl.workers.utils.losses")  # the real one imports the whole trainer config

        def ppo_loss(config: Any, model_output: Any, data: Any, dp_group: Any = None) -> str:
            calls.append(data)
            return "verl's ppo_loss"

        losses.ppo_loss = ppo_loss  # type: ignore[attr-defined]
        sys.modules["verl.workers.utils.losses"] = losses
        protocol = importlib.import_module("verl.protocol")
        padding = importlib.import_module("verl.workers.utils.padding")
        tensordict_utils = importlib.import_module("verl.utils.tensordict_utils")

        class RayPPOTrainer:  # verl.trainer.ppo.ray_trainer.RayPPOTrainer._update_actor's conversion, nothing else
            global_steps = 0

            def _update_actor(self, batch: Any) -> Any:
                batch_td = padding.left_right_2_no_padding(batch.to_tensordict())
                self.sent = batch_td  # what actor_rollout_wg.update_actor receives
                return batch_td

        ray_trainer = types.ModuleType("verl.trainer.ppo.ray_trainer")
        ray_trainer.RayPPOTrainer = RayPPOTrainer  # type: ignore[attr-defined]
        sys.modules["verl.trainer.ppo.ray_trainer"] = ray_trainer

        blocks = re.findall(r"```python\n(.*?)```", RECIPE.read_text(), flags=re.S)
        assert len(blocks) == 2, "verl.md: the worker module block and the driver block"
        monkeypatch.setenv("GRPO_DUMP_DIR", str(tmp_path / "dump"))
        hook = types.ModuleType("grpo_dump_verl")
        sys.modules["grpo_dump_verl"] = hook
        worker = online_code(RECIPE, blocks[0]) if online else blocks[0]
        exec(compile(worker, f"{RECIPE}#1", "exec"), hook.__dict__)
        driver: dict[str, Any] = {"__name__": "verl_driver"}
        exec(compile(blocks[1], f"{RECIPE}#2", "exec"), driver)
        yield {"protocol": protocol, "padding": padding, "tu": tensordict_utils, "hook": hook, "driver": driver,
               "calls": calls, "dump": tmp_path / "dump"}
    finally:
        for name in [k for k in sys.modules if k == "ray" or k.startswith(("verl", "grpo_dump_verl"))]:
            del sys.modules[name]
        sys.modules.update(saved)


def test_verl_recipe_on_verl_structures(verl: dict[str, Any]):
    protocol, hook = verl["protocol"], verl["hook"]
    # Step batch as the driver holds it: left-padded prompts [b, P], right-padded responses [b, R] (0 = pad).
    prompts = torch.tensor([[0, 0, 11, 12], [0, 13, 14, 15], [16, 17, 18, 19]])
    responses = torch.tensor([[21, 22, 23, 0, 0], [24, 25, 26, 27, 28], [29, 0, 0, 0, 0]])
    response_lengths = [3, 5, 1]
    prompt_mask, response_mask = (prompts != 0).long(), (responses != 0).long()
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    truth_new = [[-0.1, -0.2, -0.3], [-0.4, -0.5, -0.6, -0.7, -0.8], [-0.9]]
    old_log_probs = torch.tensor([[-0.11, -0.21, -0.31, 0.0, 0.0], [-0.41, -0.51, -0.61, -0.71, -0.81],
                                  [-0.91, 0.0, 0.0, 0.0, 0.0]])
    rollout_log_probs = old_log_probs - 0.05 * response_mask
    advantages = torch.tensor([[1.0] * 5, [-1.0] * 5, [0.5] * 5]) * response_mask
    batch = protocol.DataProto.from_dict(
        tensors={
            "prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attention_mask, "position_ids": (attention_mask.cumsum(1) - 1).clamp(min=0),
            "response_mask": response_mask.float(), "old_log_probs": old_log_probs,
            "rollout_log_probs": rollout_log_probs, "advantages": advantages,
        },
        non_tensors={"uid": np.array(["u-a", "u-a", "u-b"], dtype=object)},
    )
    trainer = verl["driver"]["DumpingTrainer"]()
    trainer.global_steps = 7
    data = trainer._update_actor(batch)  # ids added on the DataProto, then verl's conversion to a TensorDict
    assert data["input_ids"].is_nested
    # Model output: per-token log-probs over each no-padding sequence, next-token aligned (value j scores token
    # j + 1); response token k of a sequence with p prompt tokens sits at position p + k - 1. 9.0 = never read.
    offsets = data["input_ids"].offsets()
    values = torch.full((int(offsets[-1]),), 9.0)
    for i, truth in enumerate(truth_new):
        p = int(prompt_mask[i].sum())
        start = int(offsets[i]) + p - 1
        values[start:start + len(truth)] = torch.tensor(truth)
    model_output = {"log_probs": torch.nested.nested_tensor_from_jagged(values, offsets=offsets)}
    assert hook.ppo_loss(None, model_output, data) == "verl's ppo_loss"
    assert verl["calls"] == [data]  # verl's own loss still runs, on the unchanged micro-batch
    hook._get_writer().close()

    got = read_columns(verl["dump"])
    assert got["lengths"] == response_lengths
    assert got["new_logp"] == f32s(truth_new)
    assert got["prox_logp"] == f32s([row[:n] for row, n in zip(old_log_probs.tolist(), response_lengths)])
    assert got["old_logp"] == f32s([row[:n] for row, n in zip(rollout_log_probs.tolist(), response_lengths)])
    assert got["advantages"] == [[1.0] * 3, [-1.0] * 5, [0.5]]
    assert got["step"] == [7, 7, 7]
    assert got["seq_id"] == [7_000_000, 7_000_001, 7_000_002]
    assert got["group_id"] == [7_000_000, 7_000_000, 7_000_001]  # uids u-a, u-a, u-b
    assert "ref_logp" not in got["columns"]


def test_verl_recipe_ids_would_miss_a_tensordict(verl: dict[str, Any]):
    # verl 0.9.1's worker group receives a TensorDict, not a DataProto: ids must be added before the conversion.
    protocol, padding = verl["protocol"], verl["padding"]
    ids = torch.tensor([[5, 6, 7]])
    batch = protocol.DataProto.from_dict(
        tensors={"prompts": ids[:, :1], "responses": ids[:, 1:], "input_ids": ids,
                 "attention_mask": torch.ones_like(ids), "position_ids": torch.arange(3).unsqueeze(0),
                 "response_mask": torch.ones(1, 2)},
        non_tensors={"uid": np.array(["u"], dtype=object)},
    )
    as_sent = padding.left_right_2_no_padding(batch.to_tensordict())
    with pytest.raises(AttributeError):
        verl["hook"].add_ids(as_sent, 1)


VOCAB = 11
TABLE = torch.linspace(-2.0, 2.0, VOCAB * VOCAB).reshape(VOCAB, VOCAB).sin() * 3.0  # the model's logits (1-based ids)


def _step_batch(protocol: Any, fault: str | None, groups: int = 6, n: int = 4) -> Any:
    """A GRPO step batch as the driver holds it after rollout, reference forward and advantages: ``groups`` prompts
    x ``n`` responses sampled from :data:`TABLE` (token id k + 1 is row k: 0 is the pad), left-padded prompts,
    right-padded responses; advantages group-normalised (verl's ``compute_grpo_outcome_advantage``)."""
    g = torch.Generator().manual_seed(5)
    width_p, width_r = 4, 10
    rows: dict[str, list[Any]] = {k: [] for k in ("prompts", "responses", "rollout", "prox", "ref", "reward")}
    uids = []
    for group in range(groups):
        prompt = (torch.randint(0, VOCAB, (2 + group % 3,), generator=g) + 1).tolist()
        for k in range(n):
            response, logps = behaviour(TABLE, [t - 1 for t in prompt], 4 + (group + k) % 6, fault, g)
            seq = [t - 1 for t in prompt] + response
            pad = width_r - len(response)
            rows["prompts"].append([0] * (width_p - len(prompt)) + prompt)
            rows["responses"].append([t + 1 for t in response] + [0] * pad)
            rows["rollout"].append(logps + [0.0] * pad)
            for key, table in (("prox", TABLE), ("ref", TABLE * 0.8)):  # actor recompute, reference model
                logp = torch.log_softmax(table, dim=-1)
                scored = [float(logp[a, b]) for a, b in itertools.pairwise(seq)][len(prompt) - 1:]
                rows[key].append(scored + [0.0] * pad)
            rows["reward"].append(float((group + 2 * k) % 3 == 0) + 0.1 * k)
            uids.append(f"uid-{group}")
    prompts, responses = torch.tensor(rows["prompts"]), torch.tensor(rows["responses"])
    prompt_mask, response_mask = (prompts != 0).long(), (responses != 0).long()
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    reward = torch.tensor(rows["reward"]).reshape(groups, n)
    advantages = ((reward - reward.mean(1, keepdim=True)) / (reward.std(1, keepdim=True) + 1e-6)).reshape(-1)
    return protocol.DataProto.from_dict(
        tensors={
            "prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attention_mask, "position_ids": (attention_mask.cumsum(1) - 1).clamp(min=0),
            "response_mask": response_mask.float(), "old_log_probs": torch.tensor(rows["prox"]),
            "ref_log_prob": torch.tensor(rows["ref"]), "rollout_log_probs": torch.tensor(rows["rollout"]),
            "advantages": advantages[:, None] * response_mask,
        },
        non_tensors={"uid": np.array(uids, dtype=object)},
    )


def _forward(micro_batch: Any) -> dict[str, Any]:
    """The model's output on a no-padding micro-batch: per-token log-probs, next-token aligned (value j scores token
    j + 1; the last value has no token and is 0), float32 from :data:`TABLE`."""
    ids = micro_batch["input_ids"]
    values = []
    logp = torch.log_softmax(TABLE, dim=-1)
    for seq in ids.unbind():
        rows = seq.long() - 1
        values.append(torch.cat([logp[rows[:-1], rows[1:]], torch.zeros(1)]))
    return {"log_probs": torch.nested.nested_tensor_from_jagged(torch.cat(values), offsets=ids.offsets())}


@pytest.mark.parametrize("fault", [None, *FAULTS])
def test_verl_recipe_findings_while_training(verl_online: dict[str, Any], fault: str | None):
    # The page's Diagnoser call (verl.md, "Findings while training") in the worker's ppo_loss, on what verl's actor
    # update hands the loss: the driver's TensorDict, shuffled into mini-batches for two PPO epochs
    # (engine_workers.py: train_mini_batch, tu.make_iterator) and chunked into micro-batches
    # (engine/utils.py: prepare_micro_batches, tu.chunk_tensordict).
    hook, tu = verl_online["hook"], verl_online["tu"]
    feeds = record_feeds(hook)
    trainer = verl_online["driver"]["DumpingTrainer"]()
    trainer.global_steps = 3
    data = trainer._update_actor(_step_batch(verl_online["protocol"], fault))
    mini_batches = tu.make_iterator(data, mini_batch_size=12, epochs=2, seed=42, dataloader_kwargs={"shuffle": True})
    for mini_batch in mini_batches:
        for micro_batch in tu.chunk_tensordict(mini_batch, 3):
            assert hook.ppo_loss(None, _forward(micro_batch), micro_batch) == "verl's ppo_loss"
    assert len(verl_online["calls"]) == 2 * 24 // 4  # verl's loss ran on every micro-batch of both epochs
    hook._get_writer().close()
    hook.diagnoser.step_end(hook._open_step)  # the page: once more after the last step
    # the first epoch only, each sequence once (the writer's dedupe count), at the driver's step
    fed = sorted(int(i) for call in feeds for i in call["seq_id"])
    assert fed == [3_000_000 + i for i in range(24)] and {call["step"] for call in feeds} == {3}
    check(hook.diagnoser, verl_online["dump"], fault)
