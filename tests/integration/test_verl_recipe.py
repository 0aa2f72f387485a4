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

pytestmark = pytest.mark.integration
try:
    import tensordict  # noqa: F401  # verl's data structures are TensorDicts
except ImportError as exc:
    pytest.skip(f"tensordict cannot be imported ({exc}); pip install -e '.[dev]' runs the verl checks",
                allow_module_level=True)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from dump_columns import f32s, read_columns  # noqa: E402

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
        exec(compile(blocks[0], f"{RECIPE}#1", "exec"), hook.__dict__)
        driver: dict[str, Any] = {"__name__": "verl_driver"}
        exec(compile(blocks[1], f"{RECIPE}#2", "exec"), driver)
        yield {"protocol": protocol, "padding": padding, "hook": hook, "driver": driver, "calls": calls,
               "dump": tmp_path / "dump"}
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
