"""``--from slime-train`` / ``slime-rollout``: slime's ``--save-debug-train-data`` (and, joined,
``--save-debug-rollout-data``) files → schema-v1 part files; how the keys map is in :mod:`grpo_cli.io.convert`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from grpo_cli.errors import InputError
from grpo_cli.io._convert_common import ConvertResult, _count_tokens, _writer_error
from grpo_cli.io._convert_torch import _scalar, _tensor, safe_torch_load
from grpo_cli.io.storage import DumpPath
from grpo_cli.io.writer import RolloutWriter

__all__: list[str] = []  # private to grpo_cli.io.convert


_SLIME_TOKEN_KEYS = {  # schema column ← slime train-dump key (response-only, token-aligned)
    "new_logp": "log_probs",
    "old_logp": "rollout_log_probs",
    "ref_logp": "ref_log_probs",
    "entropy": "entropy",
    "loss_mask": "loss_masks",
    "advantages": "advantages",
}


def _slime_kind(payload: Any) -> str:
    if not isinstance(payload, dict):
        return "unknown"
    if "rollout_data" in payload:
        return "train-legacy"
    samples = payload.get("samples")
    if not isinstance(samples, list):
        return "unknown"
    if "format_version" in payload:
        return "train"
    first = samples[0] if samples and isinstance(samples[0], dict) else {}
    if "response_lengths" in first or "log_probs" in first or "loss_masks" in first:
        return "train"
    return "rollout"


def _train_samples(payload: dict[str, Any], kind: str, file: DumpPath) -> list[dict[str, Any]]:
    if kind == "train":
        samples = payload["samples"]
        if not all(isinstance(s, dict) for s in samples):
            raise InputError("'samples' must be a list of dicts", file=str(file))
        return samples
    data = payload["rollout_data"]
    if not isinstance(data, dict):
        raise InputError("'rollout_data' must be a dict of lists", file=str(file))
    n = len(data.get("response_lengths") or data.get("tokens") or [])
    if n == 0:
        return []
    out: list[dict[str, Any]] = [{} for _ in range(n)]
    for key, values in data.items():
        if isinstance(values, (list, tuple)) and len(values) == n:
            for sample, value in zip(out, values):
                sample[key] = value
    return out


def _version_number(weight_versions: Any) -> int | None:
    if not isinstance(weight_versions, (list, tuple)) or not weight_versions:
        return None
    last = weight_versions[-1]
    try:
        return int(str(last).strip())
    except ValueError:
        return None


class _SlimeJoin:
    """Rollout dumps by rollout id, loaded on demand one at a time (bounded memory)."""

    def __init__(self, files: Sequence[DumpPath]) -> None:
        self.paths: dict[int, DumpPath] = {}
        for path in files:
            payload = safe_torch_load(path)
            if _slime_kind(payload) != "rollout":
                raise InputError("not a slime --save-debug-rollout-data file (no per-sample 'samples' list)",
                                 file=str(path))
            rid = _scalar(payload.get("rollout_id"))
            if not isinstance(rid, int):
                raise InputError("no integer 'rollout_id'", file=str(path))
            if rid in self.paths:
                raise InputError(f"rollout_id {rid} also in {self.paths[rid]}", file=str(path))
            self.paths[rid] = path
            del payload
        self._cached: tuple[int, list[dict[str, Any]]] | None = None

    def samples(self, rollout_id: int) -> tuple[DumpPath, list[dict[str, Any]]] | None:
        path = self.paths.get(rollout_id)
        if path is None:
            return None
        if self._cached is None or self._cached[0] != rollout_id:
            self._cached = (rollout_id, safe_torch_load(path)["samples"])
        return path, self._cached[1]


def _convert_slime(
    train_files: Sequence[DumpPath], rollout_files: Sequence[DumpPath], out_dir: DumpPath, result: ConvertResult,
    metadata: Mapping[str, Any],
) -> None:
    join = _SlimeJoin(rollout_files) if rollout_files else None
    writers: dict[int, RolloutWriter] = {}
    columns: tuple[str, ...] | None = None
    try:
        for file in train_files:
            payload = safe_torch_load(file)
            kind = _slime_kind(payload)
            if kind not in ("train", "train-legacy"):
                hint = " (a rollout dump: pass it with --join)" if kind == "rollout" else ""
                raise InputError(f"not a slime --save-debug-train-data file{hint}", file=str(file))
            rid = _scalar(payload.get("rollout_id"))
            if not isinstance(rid, int) or rid < 0:
                raise InputError("no integer 'rollout_id' >= 0", file=str(file))
            rank = _scalar(payload.get("rank"))
            rank = rank if isinstance(rank, int) and rank >= 0 else 0
            samples = _train_samples(payload, kind, file)
            raw_reward = payload.get("raw_reward")
            joined = join.samples(rid) if join is not None else None
            if join is not None and joined is None:
                raise InputError(f"no rollout dump with rollout_id {rid} among the --join files", file=str(file))
            batch = _slime_batch(file, samples, raw_reward, joined)
            rewards_source = batch.pop("_rewards_source")
            del payload
            if not batch["new_logp"]:
                continue
            present = tuple(sorted(k for k, v in batch.items() if v is not None))
            if columns is not None and present != columns:
                raise InputError(f"has columns {list(present)}, earlier files {list(columns)}", file=str(file))
            columns = present
            if rank not in writers:
                meta = {**metadata, "framework": "slime", "hook": "--save-debug-train-data",
                        "source_format": f"slime-{kind}", "new_logp_source": "log_probs (recompute, pre-update)",
                        "rewards_source": rewards_source}
                writers[rank] = RolloutWriter(out_dir, rank=rank, metadata=meta)
            try:
                n = writers[rank].add(step=rid, window="response", **{k: v for k, v in batch.items() if v is not None})
            except ValueError as exc:
                raise _writer_error(exc, file) from None
            writers[rank].flush()
            result.n_sequences += n
    finally:
        for writer in writers.values():
            writer.close()
            result.files.extend(writer.files)
    result.n_tokens = _count_tokens(result.files)


def _slime_batch(
    file: DumpPath,
    samples: list[dict[str, Any]],
    raw_reward: Any,
    joined: tuple[DumpPath, list[dict[str, Any]]] | None,
) -> dict[str, Any]:
    """Per-sample dicts → writer inputs (lists of 1-D tensors and per-sequence lists)."""
    out: dict[str, Any] = {name: [] for name in _SLIME_TOKEN_KEYS}
    seq: dict[str, list[Any]] = {"rewards": [], "group_id": [], "seq_id": [], "versions": []}
    for i, sample in enumerate(samples):
        length = _scalar(sample.get("response_lengths", sample.get("response_length")))
        if not isinstance(length, int):
            raise InputError(f"sample {i}: no integer 'response_lengths'", file=str(file))
        for name, key in _SLIME_TOKEN_KEYS.items():
            value = sample.get(key)
            if value is None or (name != "new_logp" and isinstance(value, (list, tuple)) and len(value) == 0):
                out[name].append(None)
                continue
            tensor = _tensor(value, key, file).reshape(-1)
            if name == "advantages" and tensor.numel() == 1 and length != 1:
                out[name].append(tensor.reshape(()))
                continue
            if tensor.numel() != length:
                raise InputError(
                    f"sample {i}: '{key}' has {tensor.numel()} values but response_lengths is {length} (a CP-local "
                    "chunk? dumps written before slime #2266 under context parallelism cannot be re-gathered)",
                    file=str(file),
                )
            out[name].append(tensor)
        position = _scalar(sample.get("rollout_position", sample.get("sample_index")))
        seq["seq_id"].append(position if isinstance(position, int) else None)
        reward, group, version = None, None, None
        if joined is not None:
            join_file, rollout = joined
            if not isinstance(position, int) or not 0 <= position < len(rollout):
                raise InputError(f"sample {i}: rollout_position {position} is not a position in {join_file}",
                                 file=str(file))
            other = rollout[position]
            other_length = _scalar(other.get("response_length"))
            if isinstance(other_length, int) and other_length != length:
                raise InputError(
                    f"sample {i}: joins rollout position {position} of {join_file}, whose response has "
                    f"{other_length} tokens, not {length}", file=str(file))
            tokens, other_tokens = sample.get("tokens"), other.get("tokens")
            if tokens is not None and other_tokens is not None and not torch.equal(
                _tensor(tokens, "tokens", file).reshape(-1).to(torch.int64),
                _tensor(other_tokens, "tokens", join_file).reshape(-1).to(torch.int64),
            ):
                raise InputError(f"sample {i}: tokens differ from rollout position {position} of {join_file}",
                                 file=str(file))
            reward = _scalar(other.get("reward"))
            group = _scalar(other.get("group_index"))
            version = _version_number(other.get("weight_versions"))
            if out["old_logp"][-1] is None and other.get("rollout_log_probs") is not None:
                tensor = _tensor(other["rollout_log_probs"], "rollout_log_probs", join_file).reshape(-1)
                if tensor.numel() == length:
                    out["old_logp"][-1] = tensor
        if reward is None and isinstance(raw_reward, (list, tuple)):
            index = position if isinstance(position, int) and len(raw_reward) > len(samples) else i
            if 0 <= index < len(raw_reward):
                reward = _scalar(raw_reward[index])
        if group is None:
            group = _scalar(sample.get("group_index"))
        seq["rewards"].append(reward)
        seq["group_id"].append(group if isinstance(group, int) else None)
        seq["versions"].append(version)
    batch: dict[str, Any] = {}
    for name, values in out.items():
        batch[name] = _all_or_none(values, name, file)
    if batch["new_logp"] is None:
        raise InputError("no 'log_probs' in the train dump (needed as the training log-prob)", file=str(file))
    for name in ("rewards", "group_id", "seq_id"):
        batch[name] = _all_or_none(seq[name], name, file, strict=False)
    batch["_rewards_source"] = ("rollout dump 'reward'" if joined is not None else "'raw_reward'") if (
        batch["rewards"] is not None) else None
    if all(v is not None for v in seq["versions"]) and seq["versions"]:
        batch["versions"] = [torch.full((len(x),), v, dtype=torch.int64)
                             for x, v in zip(batch["new_logp"], seq["versions"])]
    else:
        batch["versions"] = None
    return batch


def _all_or_none(values: list[Any], name: str, file: DumpPath, *, strict: bool = True) -> list[Any] | None:
    """A column is written only if every sample has it (absent stays absent, never zero-filled)."""
    if not values or all(v is None for v in values):
        return None if values else []
    if any(v is None for v in values):
        if strict:
            first = next(i for i, v in enumerate(values) if v is None)
            raise InputError(f"sample {first} lacks '{name}' that other samples have", file=str(file))
        return None
    return values
