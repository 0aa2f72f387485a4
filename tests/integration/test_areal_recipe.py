"""The AReaL recipe's hook against AReaL 1.0.4's own data path (``docs/recipes/areal.md``).

AReaL cannot train on a CPU here, so the test runs AReaL's own code from its pinned wheel (``pip download --no-deps
areal==1.0.4``, unpacked; heavy imports stubbed as in the peers tier): trajectories shaped as
``RLVRWorkflow.arun_episode`` shapes them (``areal/workflow/rlvr.py``: token-aligned ``logprobs``, ``loss_mask``,
``versions`` −1 on prompt tokens, ``[1, L]`` each), the proximal and reference log-probs as the trainer attaches
them (``rl_trainer.py``: one forward, next-token aligned), then the real ``PPOActor.compute_advantages`` (the −1
rolls) and ``PPOActor.ppo_update`` (mini-batch split, the module-level ``grpo_loss_fn`` by name). The engine is a
stand-in for ``FSDPEngine.train_batch``'s data path built from AReaL's own helpers (``amend_position_ids``,
``split_padded_tensor_dict_into_mb_list``, ``pack_tensor_dict``, ``pad_mb_list``, ``gather_logprobs_entropy``)
around a lookup-table model, so the loss sees packed, reordered micro-batches exactly as the FSDP engine hands
them over. The dump must hold the token-aligned tensors that went in.
"""

from __future__ import annotations

import itertools
import re
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _peer_wheels import framework_modules, unpacked_wheel
from dump_columns import f32, read_columns
from online_recipe import FAULTS, behaviour, check, online_code, record_feeds

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "docs" / "recipes" / "areal.md"
VOCAB = 11
# (prompt, response, behaviour log-probs, versions of the response tokens, reward): RLVRWorkflow's inputs.
TRAJECTORIES = [
    ([1, 2, 3], [4, 5], [-0.5, -0.25], [4, 4], 1.0),
    ([6, 7], [8, 9, 10, 2, 3], [-1.5, -0.75, -0.125, -2.0, -0.0625], [3, 3, 4, 4, 4], -1.0),
    ([5], [1, 7, 2], [-0.375, -1.25, -0.5], [4, 4, 4], 0.5),
    ([2, 4, 6, 8], [10], [-3.0], [2], 0.0),
]
CURRENT_VERSION = 5


class FSDPEngineDataPath:
    """What ``FSDPEngine.train_batch`` does to the data (``areal/engine/fsdp_engine.py``: ``_prepare_mb_list``,
    ``forward_backward_batch``, ``_compute_logprobs_and_loss``), with AReaL's helpers; the model is ``table``."""

    def __init__(self, data: Any, functional: Any, table: torch.Tensor, mb_spec: Any) -> None:
        self.data, self.functional, self.table, self.mb_spec = data, functional, table, mb_spec
        self.micro_batches = 0

    def get_version(self) -> int:
        return CURRENT_VERSION

    def train(self, mode: bool = True) -> FSDPEngineDataPath:
        return self

    def train_batch(self, input_: dict[str, Any], loss_fn: Any, loss_weight_fn: Any) -> dict[str, float]:
        data = self.data
        input_ = data.amend_position_ids(input_.copy())
        mb_list = data.split_padded_tensor_dict_into_mb_list(input_, self.mb_spec)
        mb_list.mbs = [data.pack_tensor_dict(mb) for mb in mb_list.mbs]
        mb_list = data.unsqueeze_mb_list(data.pad_mb_list(mb_list, pad_value=0.0))
        for mb in mb_list.mbs:  # _prepare_mb_list: the model's attention kwargs replace the padded mask
            mb["attention_mask"] = dict(full_attention=None, sliding_attention=None)
        for item in mb_list:
            if loss_weight_fn(item.orig_mb) == 0:
                continue
            ids = item.padded_mb["input_ids"].squeeze(0).long()
            logits = self.table[ids]  # the "model": logits depend on the current token only
            logprobs, entropy = self.functional.gather_logprobs_entropy(logits, torch.roll(ids, -1), temperature=1.0)
            if item.padding_length > 0:
                logprobs, entropy = logprobs[:-item.padding_length], entropy[:-item.padding_length]
                logits = logits[:-item.padding_length]
            loss_fn(logprobs, entropy, item.orig_mb, vocab_min_logits=logits.min(-1).values,
                    vocab_max_logits=logits.max(-1).values)
            self.micro_batches += 1
        return {}


@pytest.fixture(scope="module")
def areal_modules() -> Iterator[dict[str, Any]]:
    root = unpacked_wheel("areal", "1.0.4")
    names = ["areal.trainer.ppo.actor", "areal.utils.data", "areal.utils.functional", "areal.api.cli_args"]
    with framework_modules("areal", root, "1.0.4", names) as (actor, data, functional, cli_args):
        yield {"actor": actor, "data": data, "functional": functional, "cli_args": cli_args}


def _install_recipe(actor: Any, monkeypatch: pytest.MonkeyPatch, dump: Path,
                    online: bool = False) -> types.ModuleType:
    """Execute the recipe's block as the module ``grpo_dump_areal`` of one training process (``online``: with the
    page's Diagnoser diff applied and the README's helper in the module); ``monkeypatch`` puts AReaL's own
    ``_ppo_update`` and ``grpo_loss_fn`` back afterwards."""
    blocks = re.findall(r"```python\n(.*?)```", RECIPE.read_text(), flags=re.S)
    assert len(blocks) == 1, "areal.md: one hook module"
    code = online_code(RECIPE, blocks[0]) if online else blocks[0]
    monkeypatch.setattr(actor.PPOActor, "_ppo_update", actor.PPOActor._ppo_update)
    monkeypatch.setattr(actor, "grpo_loss_fn", actor.grpo_loss_fn)
    monkeypatch.setenv("GRPO_DUMP_DIR", str(dump))
    hook = types.ModuleType("grpo_dump_areal")
    monkeypatch.setitem(sys.modules, "grpo_dump_areal", hook)
    exec(compile(code, str(RECIPE), "exec"), hook.__dict__)
    return hook


TABLE = torch.linspace(-2.0, 2.0, VOCAB * VOCAB).reshape(VOCAB, VOCAB).sin() * 3.0  # the model's logits


def _truth(i: int, scale: float) -> list[float]:
    """Token-aligned values of trajectory ``i`` (value t belongs to token t; token 0 has no predecessor)."""
    prompt, response, *_ = TRAJECTORIES[i]
    return [0.0] + [scale * (10 * i + t) for t in range(1, len(prompt) + len(response))]


def _next_token(row: list[float]) -> torch.Tensor:
    """A forward's ``[1, L]`` output: slot j scores token j + 1; the last slot is junk (9.0, never read)."""
    return torch.tensor([[*row[1:], 9.0]])


def _rollout_batch(recompute: bool, trajectories: list[Any] = TRAJECTORIES, prox: Any = None,
                   ref: Any = None) -> list[dict[str, torch.Tensor]]:
    """RLVRWorkflow's trajectories; ``prox(i)`` and ``ref(i)`` give trajectory ``i``'s token-aligned proximal and
    reference log-probs (default: distinct known values)."""
    prox = prox or (lambda i: _truth(i, -0.01))
    ref = ref or (lambda i: _truth(i, -0.02))
    batch = []
    for i, (prompt, response, behave, versions, reward) in enumerate(trajectories):
        seq = prompt + response
        traj = {  # RLVRWorkflow.arun_episode's dict, [1, L] each
            "input_ids": torch.tensor([seq], dtype=torch.int32),
            "loss_mask": torch.tensor([[0] * len(prompt) + [1] * len(response)], dtype=torch.int32),
            "logprobs": torch.tensor([[0.0] * len(prompt) + behave], dtype=torch.float32),
            "versions": torch.tensor([[-1] * len(prompt) + versions], dtype=torch.int32),
            "attention_mask": torch.ones(1, len(seq), dtype=torch.bool),
            "rewards": torch.tensor([reward], dtype=torch.float32),
        }
        traj["ref_logp"] = _next_token(ref(i))  # rl_trainer: traj["ref_logp"] = ref.compute_logp(...)
        if recompute:  # rl_trainer: traj["prox_logp"] = actor.compute_logp(...)
            traj["prox_logp"] = _next_token(prox(i))
        batch.append(traj)
    return batch


MODES = {  # (use_decoupled_loss, recompute_logprob)
    "decoupled": (True, True), "behaviour": (False, False), "recompute_without_decoupled": (False, True)}


def _train_step(modules: dict[str, Any], mode: str, batch: list[dict[str, torch.Tensor]] | None = None,
                max_tokens_per_mb: int = 8) -> FSDPEngineDataPath:
    """One step as ``PPOTrainer.train`` runs it on a training process: advantages, then the PPO update."""
    decoupled, recompute = MODES[mode]
    cli_args = modules["cli_args"]
    config = cli_args.PPOActorConfig(
        experiment_name="e", trial_name="t", path="p", ppo_n_minibatches=2, adv_norm=None, kl_ctl=0.0,
        use_decoupled_loss=decoupled, recompute_logprob=recompute,
        # several packed micro-batches per mini-batch
        mb_spec=cli_args.MicroBatchSpec(max_tokens_per_mb=max_tokens_per_mb),
    )
    engine = FSDPEngineDataPath(modules["data"], modules["functional"], TABLE, config.mb_spec)
    ppo_actor = modules["actor"].PPOActor(config, engine)
    adv_batch = ppo_actor.compute_advantages(batch or _rollout_batch(recompute))  # AReaL's rolls, masks and GAE
    ppo_actor.ppo_update(adv_batch)  # the recipe's _ppo_update wrapper, then grpo_loss_fn per micro-batch
    return engine


@pytest.mark.parametrize("mode", list(MODES))
def test_areal_recipe_on_areal_data_path(areal_modules: dict[str, Any], mode: str, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch):
    hook = _install_recipe(areal_modules["actor"], monkeypatch, tmp_path / "dump")
    hook.RECOMPUTE_WITHOUT_DECOUPLED = mode == "recompute_without_decoupled"  # the recipe's switch
    engine = _train_step(areal_modules, mode)
    assert engine.micro_batches >= 3  # AReaL's loss ran, on packed micro-batches
    hook._get_writer().close()

    logp = torch.log_softmax(TABLE.double(), dim=-1)  # float64 reference: logp[a, b] = log p(next = b | a)
    entropy_of = -(logp.exp() * logp).sum(-1)
    got = read_columns(tmp_path / "dump")
    order = sorted(range(len(got["seq_id"])), key=got["seq_id"].__getitem__)  # micro-batches reorder rows
    rows = {name: [got[name][k] for k in order] for name in got if name != "columns"}
    assert rows["seq_id"] == list(range(len(TRAJECTORIES)))  # one row per trajectory, ids in batch order
    assert rows["lengths"] == [len(p) + len(r) for p, r, *_ in TRAJECTORIES]
    assert rows["step"] == [CURRENT_VERSION] * 4 and rows["current_version"] == [CURRENT_VERSION] * 4
    for k, (prompt, response, behave, versions, reward) in enumerate(TRAJECTORIES):
        seq = prompt + response
        assert rows["versions"][k] == [-1] * len(prompt) + versions  # not rolled in AReaL
        assert rows["loss_mask"][k] == [False] * len(prompt) + [True] * len(response)
        if mode != "recompute_without_decoupled":
            assert rows["old_logp"][k] == f32([0.0] * len(prompt) + behave)
        assert rows["ref_logp"][k] == f32([0.0] * len(prompt) + _truth(k, -0.02)[len(prompt):])  # AReaL masks it
        # gamma = lambda = 1, no KL, no critic: every response token's advantage is the sequence reward.
        assert [a for a, m in zip(rows["advantages"][k], rows["loss_mask"][k]) if m] == [reward] * len(response)
        new = [0.0] + [float(logp[a, b]) for a, b in itertools.pairwise(seq)]
        ent = [0.0] + [float(entropy_of[a]) for a in seq[:-1]]
        assert rows["new_logp"][k] == pytest.approx(new, abs=1e-5)
        assert rows["entropy"][k] == pytest.approx(ent, abs=1e-5)
        if mode == "decoupled":
            assert rows["prox_logp"][k] == f32(_truth(k, -0.01))  # the recompute is not masked by AReaL
        if mode == "recompute_without_decoupled":  # AReaL overwrote "logprobs" with the (masked) recompute
            assert rows["prox_logp"][k] == f32([0.0] * len(prompt) + _truth(k, -0.01)[len(prompt):])
    if mode == "behaviour":  # AReaL copies the behaviour log-prob into prox_logp: not written
        assert "prox_logp" not in got["columns"]
    if mode == "recompute_without_decoupled":  # the behaviour log-prob is gone: not written
        assert "old_logp" not in got["columns"]


def test_areal_recipe_ids_unique_across_ranks(areal_modules: dict[str, Any], tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch):
    # Data parallel: every rank runs the hook in its own process, on its own shard, into one dump directory.
    # A (step, seq_id) seen twice is a duplicate to the analyzer (GRP107), so the ids must differ across ranks.
    for rank in range(2):
        with monkeypatch.context() as process:
            hook = _install_recipe(areal_modules["actor"], process, tmp_path / "dump")
            # The hook's view of torch.distributed in that process (AReaL's own calls stay single-process here).
            hook.dist = types.SimpleNamespace(is_initialized=lambda: True, get_rank=lambda r=rank: r,
                                              get_world_size=lambda: 2)
            _train_step(areal_modules, "behaviour")
            hook._get_writer().close()
    got = read_columns(tmp_path / "dump")
    keys = list(zip(got["step"], got["seq_id"]))
    assert len(keys) == 2 * len(TRAJECTORIES)
    assert len(set(keys)) == len(keys), "seq_id repeats across ranks"


def _sampled(fault: str | None, n: int = 24) -> list[tuple[list[int], list[int], list[float], list[int], float]]:
    """``n`` trajectories an engine sampled from :data:`TABLE` (healthy, or with ``fault``): most tokens generated by
    the current version, some one version before."""
    g = torch.Generator().manual_seed(3)
    out = []
    for i in range(n):
        prompt = torch.randint(0, VOCAB, (2 + i % 3,), generator=g).tolist()
        response, behave = behaviour(TABLE, prompt, 6 + i % 5, fault, g)
        versions = [CURRENT_VERSION - (t < 2 and i % 4 == 0) for t in range(len(response))]
        out.append((prompt, response, behave, versions, float(i % 3 - 1)))
    return out


def _forward(table: torch.Tensor, trajectory: tuple[Any, ...]) -> list[float]:
    """Token-aligned log-probs of a float32 forward of ``table`` over a trajectory (token 0 has no predecessor)."""
    prompt, response, *_ = trajectory
    logp = torch.log_softmax(table, dim=-1)
    return [0.0] + [float(logp[a, b]) for a, b in itertools.pairwise(prompt + response)]


@pytest.mark.parametrize("mode", ["decoupled", "behaviour"])
@pytest.mark.parametrize("fault", [None, *FAULTS])
def test_areal_recipe_findings_while_training(areal_modules: dict[str, Any], mode: str, fault: str | None,
                                              tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    # The page's Diagnoser call (areal.md, "Findings while training") inside the same hook, on AReaL's packed,
    # reordered, next-token-aligned micro-batches: a fault is named, a healthy step is quiet, and the findings are
    # analyze's on the dump the same hook wrote.
    hook = _install_recipe(areal_modules["actor"], monkeypatch, tmp_path / "dump", online=True)
    feeds = record_feeds(hook)
    trajectories = _sampled(fault)
    # the proximal recompute: the actor's own weights (TABLE); the reference: another model
    batch = _rollout_batch(MODES[mode][1], trajectories, prox=lambda i: _forward(TABLE, trajectories[i]),
                           ref=lambda i: _forward(TABLE * 0.8, trajectories[i]))
    engine = _train_step(areal_modules, mode, batch, max_tokens_per_mb=48)
    assert engine.micro_batches >= 4
    hook._get_writer().close()
    hook.diagnoser.step_end(hook._open_step)  # the page: once more after the last step
    assert hook._open_step == CURRENT_VERSION
    # every trajectory fed once (one feed per micro-batch), with its row id, at AReaL's version
    fed = sorted(int(i) for call in feeds for i in call["seq_id"])
    assert len(feeds) == engine.micro_batches and {call["step"] for call in feeds} == {CURRENT_VERSION}
    assert len(fed) == len(set(fed)) == len(trajectories)
    check(hook.diagnoser, tmp_path / "dump", fault)
