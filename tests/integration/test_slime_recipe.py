"""The slime recipe (``docs/recipes/slime.md``) against slime's own code at commit 681b3ad.

slime is not on a package index (the PyPI ``slime`` is an unrelated library), so the few pure-Python files on the
recipe's path are vendored unchanged under ``tests/integration/vendor/slime`` (see its README.md) and loaded with
heavy imports stubbed, as the peers tier loads unpacked wheels. The test runs what slime runs between a rollout and
the two debug dumps the recipe turns on, with the paths the recipe's flags give:

- ``Sample`` objects (``slime/utils/types.py``) → ``RolloutManager._save_debug_rollout_data`` (the rollout dump),
  ``_convert_samples_to_train_data`` (GRPO group normalisation of the rewards) and ``_split_train_data_by_dp``
  (``build_dp_schedule``, two DP ranks) from ``slime/ray/rollout.py``;
- on each rank, ``process_rollout_data`` (``slime/utils/data.py``), the actor's recomputed ``log_probs`` and
  ``ref_log_probs`` (stand-ins for the model's forward: known values), ``compute_advantages_and_returns``
  (``slime/backends/megatron_utils/loss.py``) and ``save_debug_train_data`` (``train_dump_utils.py``; the DP gather
  of the two ranks' shards is done in-process).

Then the recipe's ``grpo-cli convert`` commands run on the dump directory and the result must hold, per token, the
log-probs, mask and advantages that went in, and per sequence the step, ``seq_id``, rewards and lengths.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import re
import shlex
import sys
from argparse import Namespace
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _peer_wheels import FORCED_STUBS, _StubLoader, framework_modules
from dump_columns import f32, read_columns
from online_recipe import FAULTS, behaviour, check, new_side, page_diff, readme_helper

from grpo_cli.cli import main

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "docs" / "recipes" / "slime.md"
VENDOR = Path(__file__).resolve().parent / "vendor" / "slime"
COMMIT = "681b3ad"
DOC_ROOT = "/data/dumps/run1"
ROLLOUT_ID = 5
# Two prompts x two samples: (prompt tokens, response tokens, reward, loss mask, SGLang log-probs, weight version).
SAMPLES = [
    ([11, 12], [21, 22, 23], 1.0, [1, 1, 1], [-0.5, -0.25, -1.0], "3"),
    ([11, 12], [24, 25], 0.0, [1, 0], [-0.125, -2.0], "3"),
    ([13], [26, 27, 28, 29], 0.5, [1, 1, 0, 1], [-1.5, -0.0625, -0.375, -3.0], "4"),
    ([13], [30], 1.0, [1], [-0.75], "4"),
]


class _MissingSlimeModules(importlib.abc.MetaPathFinder):
    """slime modules that are not vendored (sglang engines, logging, metrics...) are stubs: the functions under test
    never call them."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname.split(".")[0] == "slime":
            return importlib.util.spec_from_loader(fullname, _StubLoader(), is_package=True)
        return None


def _doc_blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", RECIPE.read_text(), flags=re.S)


def _doc_flags() -> dict[str, str]:
    """The explicit form of the recipe's training flags (``--save-debug-*-data PATH``)."""
    text = _doc_blocks("bash")[0].replace("\\\n", " ")
    flags = dict(re.findall(r"--(save-debug-(?:rollout|train)-data)\s+(\S+)", text))
    assert set(flags) == {"save-debug-rollout-data", "save-debug-train-data"}, flags
    return flags


def _doc_convert_commands() -> list[list[str]]:
    """Every ``grpo-cli convert`` command of the recipe, as argument lists (without ``grpo-cli``)."""
    text = _doc_blocks("bash")[1].replace("\\\n", " ")
    commands = [shlex.split(line, comments=True) for line in text.splitlines() if line.strip()]
    commands = [c[1:] for c in commands if c[:2] == ["grpo-cli", "convert"]]
    assert len(commands) == 2, commands
    return commands


@pytest.fixture(scope="module")
def slime() -> Iterator[dict[str, Any]]:
    missing = _MissingSlimeModules()
    with framework_modules("slime", VENDOR, COMMIT, ["ray", "megatron.core"],
                           forced_stubs=(*FORCED_STUBS, "ray", "megatron", "sglang")) as (ray, megatron_core):
        sys.meta_path.append(missing)
        # ray may be the real package (imported by another test before this one): put its functions back after.
        saved = {name: getattr(ray, name, None) for name in ("remote", "put", "get")}
        try:
            # ray: @ray.remote leaves the class as written; the object store hands objects through unchanged.
            ray.remote = lambda cls: cls
            ray.put = lambda value, **kwargs: value
            ray.get = lambda value: value
            # megatron's parallel state of a rank on the last pipeline stage, TP rank 0, no context parallelism.
            megatron_core.mpu = Namespace(
                is_pipeline_last_stage=lambda **kwargs: True,
                get_tensor_model_parallel_rank=lambda: 0,
                get_context_parallel_rank=lambda: 0,
                get_context_parallel_world_size=lambda: 1,
                get_context_parallel_group=lambda: None,
                get_data_parallel_rank=lambda with_context_parallel=False: _RANK["dp"],
                get_data_parallel_world_size=lambda with_context_parallel=False: 2,
                get_data_parallel_src_rank=lambda with_context_parallel=False: 0,
                get_data_parallel_group_gloo=lambda with_context_parallel=False: None,
            )
            names = ["slime.utils.types", "slime.ray.rollout", "slime.utils.data",
                     "slime.backends.megatron_utils.loss", "slime.backends.megatron_utils.train_dump_utils"]
            types, rollout, data, loss, dump = (importlib.import_module(n) for n in names)
            yield {"types": types, "rollout": rollout, "data": data, "loss": loss, "dump": dump}
        finally:
            sys.meta_path.remove(missing)
            for name, value in saved.items():
                setattr(ray, name, value)


_RANK = {"dp": 0}
# Git blob ids of the vendored files at slime commit 681b3ad (``git rev-parse 681b3ad:PATH``): unchanged bytes.
VENDORED = {
    "LICENSE": "456e53742c2559a96f834c77daafd58c895db5cb",
    "slime/backends/megatron_utils/cp_utils.py": "96c97df0e264a4458c18c67999fd61fca3fd5f32",
    "slime/backends/megatron_utils/loss.py": "a19c0148688b6776adcfca47bd550d75dba592d7",
    "slime/backends/megatron_utils/train_dump_utils.py": "8ae2a158b230d67bc45667b53e6931adab6f4996",
    "slime/ray/rollout.py": "abd8e35d701dbf7b79d3180d15bbe12b2dcb9156",
    "slime/utils/data.py": "adac4b95a6e1a158f057c0ab8a213f6ec0da1290",
    "slime/utils/dp_schedule.py": "1735fad3b48cd52ada98912ff2440481beaebf64",
    "slime/utils/misc.py": "2b3032295483552750dedd1aaf72d0c111223125",
    "slime/utils/ppo_utils.py": "4746af4f3a62c1559748638bc767960087ad51aa",
    "slime/utils/seqlen_balancing.py": "5736d8850e875978407565c22e3b037bd30459eb",
    "slime/utils/types.py": "df4b10062ca643f3796e9296c4bb24c9d444b149",
}


def _args(flags: dict[str, str], root: Path) -> Namespace:
    """slime's parsed arguments, as far as the functions on the recipe's path read them (GRPO, 2 x 2 samples)."""
    return Namespace(
        save_debug_rollout_data=flags["save-debug-rollout-data"].replace(DOC_ROOT, str(root)),
        save_debug_train_data=flags["save-debug-train-data"].replace(DOC_ROOT, str(root)),
        reward_key=None, advantage_estimator="grpo", rewards_normalization=True, grpo_std_normalization=True,
        n_samples_per_prompt=2, rollout_batch_size=2, rollout_top_p=1.0, global_batch_size=4,
        use_dynamic_batch_size=False, max_tokens_per_gpu=None, micro_batch_size=1, balance_data=False,
        balance_by_flops=False, rollout_data_transport="object-store",
        use_rollout_logprobs=False, kl_coef=0.0, kl_loss_type="low_var_kl", custom_advantage_function_path=None,
        use_opd=False, normalize_advantages=False,
    )


def _recompute(position: int, length: int) -> list[float]:
    """The actor's recomputed log-prob of response token t of the sample at ``position`` (known, distinct)."""
    return [-(position + 1) / 8 - t / 64 for t in range(length)]


def _run_slime(slime: dict[str, Any], args: Namespace, monkeypatch: pytest.MonkeyPatch,
               rollout: list[tuple[Any, ...]] = SAMPLES, recompute: Callable[[int, int], list[float]] = _recompute,
               train_end: Callable[[dict[str, Any]], None] | None = None) -> list[Any]:
    """One rollout (``rollout``: :data:`SAMPLES`' tuples) through slime's code to both debug dumps; ``recompute``
    gives the actor's log-probs of the sample at a rollout position; ``train_end(rollout_data)`` replaces each
    rank's ``save_debug_train_data`` call (the end of the actor's training step)."""
    Sample = slime["types"].Sample
    samples = []
    for i, (prompt, response, reward, mask, logps, version) in enumerate(rollout):
        samples.append(Sample(group_index=i // args.n_samples_per_prompt, index=i, prompt="p",
                              tokens=prompt + response, response_length=len(response), reward=reward,
                              loss_mask=list(mask), rollout_log_probs=list(logps), weight_versions=["0", version],
                              status=Sample.Status.COMPLETED))
    manager = slime["rollout"].RolloutManager.__new__(slime["rollout"].RolloutManager)
    manager.args = args
    manager.custom_convert_samples_to_train_data_func = None
    manager.custom_reward_post_process_func = None
    manager.set_train_parallel_config(
        {"dp_size": 2, "cp_size": 1, "vpp_size": 1, "microbatch_group_size_per_vp_stage": 1})
    # RolloutManager.generate, after the rollout function returned the (flattened) samples:
    manager._save_debug_rollout_data(samples, rollout_id=ROLLOUT_ID, evaluation=False)
    refs = manager._split_train_data_by_dp(manager._convert_samples_to_train_data(samples))

    # The DP gather of save_debug_train_data, in-process: rank 1 hands its shard over, then rank 0 writes.
    shards: dict[int, Any] = {}

    def gather_object(obj: Any, object_gather_list: list[Any] | None = None, dst: int = 0, group: Any = None) -> None:
        shards[obj["data_parallel_rank"]] = obj
        if object_gather_list is not None:
            object_gather_list[:] = [shards[r] for r in range(len(object_gather_list))]

    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a, **k: _RANK["dp"])
    monkeypatch.setattr(torch.distributed, "gather_object", gather_object)
    for dp_rank in (1, 0):
        _RANK["dp"] = dp_rank
        rollout_data = slime["data"].process_rollout_data(args, refs, dp_rank, 2)
        lengths = rollout_data["response_lengths"]
        rollout_data["log_probs"] = [torch.tensor(recompute(p, n)) for p, n in
                                     zip(rollout_data["partition"], lengths)]
        rollout_data["ref_log_probs"] = [x - 0.03125 for x in rollout_data["log_probs"]]
        slime["loss"].compute_advantages_and_returns(args, rollout_data)
        if train_end is None:
            slime["dump"].save_debug_train_data(args, rollout_id=ROLLOUT_ID, rollout_data=rollout_data)
        else:
            train_end(rollout_data)
    return samples


def _group_normalised(rewards: list[float]) -> list[float]:
    """GRPO's advantage, float64: (r − group mean) / (group std (n − 1) + 1e-6)."""
    r = np.asarray(rewards, dtype=np.float64).reshape(-1, 2)
    centred = r - r.mean(axis=1, keepdims=True)
    return (centred / (r.std(axis=1, ddof=1, keepdims=True) + 1e-6)).reshape(-1).tolist()


def test_vendored_files_are_slime_unchanged() -> None:
    files = {str(p.relative_to(VENDOR)) for p in VENDOR.rglob("*")
             if p.is_file() and p.name != "README.md" and "__pycache__" not in p.parts}
    assert files == set(VENDORED)
    for name, blob in VENDORED.items():
        data = (VENDOR / name).read_bytes()
        assert hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest() == blob, name
    assert COMMIT in RECIPE.read_text()


def test_doc_flags_match_dump_details_layout() -> None:
    """The recipe's two flag forms name the same files (slime's arguments.py: ``--dump-details D`` sets
    ``D/rollout_data/{rollout_id}.pt`` and ``D/train_data/{rollout_id}.pt``)."""
    assert f"--dump-details {DOC_ROOT}" in _doc_blocks("bash")[0]
    assert _doc_flags() == {"save-debug-rollout-data": f"{DOC_ROOT}/rollout_data/{{rollout_id}}.pt",
                            "save-debug-train-data": f"{DOC_ROOT}/train_data/{{rollout_id}}.pt"}


@pytest.mark.parametrize("command", [0, 1], ids=["dump-details-dir", "explicit-join"])
def test_recipe_dump_roundtrip(slime: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                               capsys: pytest.CaptureFixture[str], command: int) -> None:
    root = tmp_path / "run1"
    args = _args(_doc_flags(), root)
    _run_slime(slime, args, monkeypatch)
    assert (root / "rollout_data" / f"{ROLLOUT_ID}.pt").exists() and (root / "train_data" / f"{ROLLOUT_ID}.pt").exists()

    argv = [a.replace(DOC_ROOT, str(root)) for a in _doc_convert_commands()[command]]
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 0, err
    out = read_columns(Path(argv[argv.index("-o") + 1]))

    n = len(SAMPLES)
    assert out["lengths"] == [len(s[1]) for s in SAMPLES]
    assert out["step"] == [ROLLOUT_ID] * n
    assert out["seq_id"] == list(range(n))  # the rollout position (slime's `partition`)
    assert out["group_id"] == [0, 0, 1, 1]
    assert out["rewards"] == f32([s[2] for s in SAMPLES])  # the rollout's raw rewards, not the normalised ones
    assert out["loss_mask"] == [[float(m) for m in s[3]] for s in SAMPLES]
    assert out["old_logp"] == [f32(s[4]) for s in SAMPLES]
    assert out["new_logp"] == [f32(_recompute(i, len(s[1]))) for i, s in enumerate(SAMPLES)]
    assert out["ref_logp"] == [f32(np.asarray(_recompute(i, len(s[1]))) - 0.03125) for i, s in enumerate(SAMPLES)]
    assert out["versions"] == [[int(s[5])] * len(s[1]) for s in SAMPLES]
    expected_adv = _group_normalised([s[2] for s in SAMPLES])
    for got, want, s in zip(out["advantages"], expected_adv, SAMPLES):
        np.testing.assert_allclose(got, [want] * len(s[1]), rtol=1e-6, atol=1e-6)
    assert "prox_logp" not in out and "entropy" not in out


VOCAB = 11
TABLE = torch.linspace(-2.0, 2.0, VOCAB * VOCAB).reshape(VOCAB, VOCAB).sin() * 3.0  # the model's logits
PROMPTS, N_SAMPLES = 6, 4


def _sampled(fault: str | None) -> list[tuple[Any, ...]]:
    """A rollout of :data:`PROMPTS` x :data:`N_SAMPLES` samples an engine drew from :data:`TABLE` (healthy, or with
    ``fault``), as :data:`SAMPLES`' tuples; every group's rewards differ."""
    g = torch.Generator().manual_seed(17)
    out = []
    for group in range(PROMPTS):
        prompt = torch.randint(0, VOCAB, (2 + group % 3,), generator=g).tolist()
        for k in range(N_SAMPLES):
            response, logps = behaviour(TABLE, prompt, 4 + (group + k) % 6, fault, g)
            reward = [0.0, 1.0, 0.5, 1.0][(group + k) % N_SAMPLES]
            out.append((prompt, response, reward, [1] * len(response), logps, "3"))
    return out


def _table_recompute(rollout: list[tuple[Any, ...]]) -> Callable[[int, int], list[float]]:
    """The actor's recompute: the float32 log-probs :data:`TABLE` gives the response tokens of each sample."""
    logp = torch.log_softmax(TABLE, dim=-1)

    def recompute(position: int, length: int) -> list[float]:
        prompt, response, *_ = rollout[position]
        seq = prompt + response
        return [float(logp[a, b]) for a, b in zip(seq[len(prompt) - 1:-1], seq[len(prompt):])]
    return recompute


@pytest.mark.parametrize("fault", [None, *FAULTS])
def test_recipe_findings_while_training(slime: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str], fault: str | None) -> None:
    # The page's "Findings while training" lines (slime.md) at the end of each DP rank's training step, on the
    # rollout_data slime's own code built (the context line is the actor's save_debug_train_data call, run too);
    # the README's helper is the module they run in. The two ranks run in one process, so one Diagnoser takes both
    # shards of the step, as the all-reduce over the data-parallel group would.
    root = tmp_path / "run1"
    args = _args(_doc_flags(), root)
    args.n_samples_per_prompt, args.rollout_batch_size, args.global_batch_size = N_SAMPLES, PROMPTS, PROMPTS * N_SAMPLES
    module: dict[str, Any] = {"__name__": "grpo_diagnose_slime"}
    exec(compile(readme_helper(), "README.md", "exec"), module)
    train_end = compile(new_side(page_diff(RECIPE)), str(RECIPE), "exec")
    fed: list[int] = []
    inner = module["diagnose"]

    def diagnose(step: int, **columns: Any) -> None:  # the same helper, recording which samples reached it
        fed.extend(int(i) for i in columns["seq_id"])
        inner(step, **columns)

    module["diagnose"] = diagnose
    # what the lines see in the actor: its module's imports and train_actor's locals
    actor = {"train_dump_utils": slime["dump"], "mpu": sys.modules["megatron.core"].mpu, "torch": torch,
             "self": Namespace(args=args), "rollout_id": ROLLOUT_ID}
    rollout = _sampled(fault)
    _run_slime(slime, args, monkeypatch, rollout, _table_recompute(rollout),
               train_end=lambda rollout_data: exec(train_end, {**module, **actor, "rollout_data": rollout_data}))
    diagnoser = module["diagnoser"]
    diagnoser.step_end(module["_open_step"])  # the page: once more after the last step
    assert sorted(fed) == list(range(len(rollout)))  # both ranks' samples, each once
    argv = [a.replace(DOC_ROOT, str(root)) for a in _doc_convert_commands()[0]]
    assert main(argv) == 0, capsys.readouterr().err
    check(diagnoser, Path(argv[argv.index("-o") + 1]), fault)
