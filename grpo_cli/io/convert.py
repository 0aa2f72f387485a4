"""``grpo-cli convert``: dumps that frameworks (or people) already write → schema-v1 part files.

Formats (``--from``):

* ``slime-train`` — slime's ``--save-debug-train-data`` files, both the per-rank legacy layout
  (``{"rollout_id", "rank", "rollout_data": {key: list}}``) and the sorted ``format_version: 2`` layout
  (``{"rollout_id", "rank", "samples": [dict, …], "raw_reward", …}``); ``--join`` adds the matching
  ``--save-debug-rollout-data`` files (behaviour versions, group index, raw reward), joined on
  ``(rollout_id, rollout_position)``. A ``--dump-details`` directory (``rollout_data/`` + ``train_data/``) is split
  automatically.
* ``slime-rollout`` — the same join with the rollout dumps as sources and the train dumps as ``--join`` (a rollout
  dump alone has no training log-prob, which schema v1 requires).
* ``torch-dict`` — a ``torch.save``d dict of padded ``[B, T]`` tensors (schema names, or a preset's / ``--map``'s),
  lengths from ``attention_mask`` or ``lengths`` if present, else from the last ``loss_mask`` position.
* ``jsonl`` — one sequence per line: ``{"new_logp": [...], "loss_mask": [...], "advantages": 0.5, "step": 3, …}``.
* ``--optimize`` — re-encode an existing schema-v1 dump with the fast settings (``RolloutWriter``'s), keeping its
  columns (also extra ones), layout and file names; small row groups are merged.

Every ``.pt`` file is loaded with ``torch.load(weights_only=True)`` plus an explicit allow-list of numpy's array
reconstruction helpers; anything else in the pickle (a class, a function) is refused with an
:class:`~grpo_cli.errors.InputError` naming it — never an unsafe unpickle. Converters stream: one source file
(one rollout) at a time, padded tensors in row chunks, JSON lines in token-budgeted chunks, and write through
:class:`~grpo_cli.io.writer.RolloutWriter`. The result is checked by a ``check`` callable the command supplies
(``grpo_cli.commands.convert``: ``analyze``'s validation; under ``--on-invalid error``, the default, an invalid
value removes what was written and exits 2; under ``skip`` the data is kept and the offenders are counted in a note).

How slime's keys map (``dumps.md`` §5, §9): ``log_probs`` (the actor's recompute with the pre-update weights, i.e.
the weights of the step's first training forward) → ``new_logp``; the per-update new log-prob is never dumped, and
a second copy as ``prox_logp`` would make every ratio 1, so ``prox_logp`` stays absent. ``rollout_log_probs`` →
``old_logp``, ``ref_log_probs`` → ``ref_logp``, ``entropy`` → ``entropy``, ``loss_masks`` → ``loss_mask``,
``advantages`` → ``advantages``, ``rollout_id`` → ``step``, ``rollout_position`` → ``seq_id``; rewards are the raw
rewards (joined rollout ``reward``, else the payload's ``raw_reward``), never the post-processed per-sample
``rewards``; with ``--join``: ``group_index`` → ``group_id`` and the last of ``weight_versions`` → ``versions``
(every response token). Windows are response-only and token-aligned; the metadata records all of this.
"""

from __future__ import annotations

import json
import math
import os
import re
import warnings
import zipfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch import Tensor

from grpo_cli._choices import CONVERT_FORMATS
from grpo_cli.errors import InputError, UsageError
from grpo_cli.io.presets import PRESETS, Preset, open_dataset, resolve_column_map
from grpo_cli.io.schema import COLUMNS, Layout
from grpo_cli.io.writer import TOKEN_INPUTS, RolloutWriter, fast_write_options

__all__ = ["FORMATS", "Check", "ConvertResult", "convert", "optimize_dump", "safe_torch_load"]

FORMATS = CONVERT_FORMATS
_CHUNK_TOKENS = 1 << 20
_PER_SEQUENCE = ("rewards", "current_version", "group_id", "seq_id")


@dataclass
class ConvertResult:
    """What a conversion wrote."""

    files: list[Path] = field(default_factory=list)
    n_sequences: int = 0
    n_tokens: int = 0
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"files": [str(p) for p in self.files], "n_sequences": self.n_sequences, "n_tokens": self.n_tokens,
                "notes": self.notes}


# -- safe loading -------------------------------------------------------------------------------------------------
def _numpy_allow_list() -> list[Any]:
    """numpy's array/scalar reconstruction helpers: they build arrays from bytes and call nothing else."""
    import numpy as np

    try:
        from numpy._core import multiarray
    except ImportError:  # numpy < 2
        from numpy.core import multiarray  # type: ignore[no-redef]  # numpy 1.x location
    allowed: list[Any] = [np.ndarray, np.dtype, multiarray._reconstruct, multiarray.scalar]
    dtypes = getattr(np, "dtypes", None)
    if dtypes is not None:
        for name in ("BoolDType", "Int8DType", "Int16DType", "Int32DType", "Int64DType", "UInt8DType",
                     "UInt16DType", "UInt32DType", "UInt64DType", "Float16DType", "Float32DType", "Float64DType"):
            if hasattr(dtypes, name):
                allowed.append(getattr(dtypes, name))
    return allowed


def safe_torch_load(path: str | os.PathLike[str]) -> Any:
    """``torch.load(weights_only=True)`` with numpy arrays allowed; anything else is an :class:`InputError`.

    Zip-format files are memory-mapped, so large tensors are paged in only when read.

    Raises:
        InputError: unreadable file, or a pickle that needs a global outside the allow-list (named).
    """
    path = Path(path)
    mmap = zipfile.is_zipfile(path)
    try:
        with torch.serialization.safe_globals(_numpy_allow_list()), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns about pickle protocols it may not support
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as exc:  # torch raises UnpicklingError, RuntimeError, EOFError, … for bad files
        text = str(exc)
        allowed = "only tensors, numbers, strings, lists, dicts and numpy arrays are loaded (weights_only=True)"
        match = re.search(r"GLOBAL ([\w.]+)", text)
        if match:
            raise InputError(f"refusing to unpickle '{match.group(1)}': {allowed}", file=str(path)) from None
        if "Weights only load failed" in text:
            detail = text.split("WeightsUnpickler error:", 1)[-1] if "WeightsUnpickler error:" in text else ""
            reason = next((line.strip() for line in detail.splitlines() if line.strip()), "unsupported content")
            raise InputError(f"refusing to unpickle ({reason[:120]}): {allowed}", file=str(path)) from None
        first = next((line.strip() for line in text.splitlines() if line.strip()), type(exc).__name__)
        raise InputError(f"not a loadable torch file ({first[:200]})", file=str(path)) from None


# -- helpers ------------------------------------------------------------------------------------------------------
def _expand(sources: Sequence[str | os.PathLike[str]], suffixes: tuple[str, ...]) -> list[Path]:
    files: set[Path] = set()
    for raw in sources:
        path = Path(raw)
        if not path.exists():
            raise InputError("no such file or directory", file=str(path))
        if path.is_dir():
            found = [p for p in path.rglob("*") if p.is_file() and p.suffix in suffixes]
            if not found:
                raise InputError(f"directory contains no {'/'.join(suffixes)} files", file=str(path))
            files.update(found)
        else:
            files.add(path)
    return sorted(files, key=str)


def _check_out_dir(out_dir: Path, sources: Sequence[Path]) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise UsageError(f"-o {out_dir}: not a directory")
    if out_dir.exists() and any(out_dir.rglob("*.parquet")):
        raise UsageError(f"-o {out_dir}: already holds .parquet files; choose an empty or new directory")
    resolved = out_dir.resolve()
    for source in sources:
        if source.resolve() == resolved:
            raise UsageError(f"-o {out_dir}: is one of the sources")


def _tensor(value: Any, what: str, file: Path) -> Tensor:
    if isinstance(value, Tensor):
        return value
    try:
        import numpy as np

        if isinstance(value, np.ndarray):
            return torch.from_numpy(value)
        return torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise InputError(f"'{what}' is not numeric ({exc})", file=str(file)) from None


def _scalar(value: Any) -> float | int | None:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, Tensor) and value.numel() == 1:
        return value.item()
    try:
        import numpy as np

        if isinstance(value, (np.generic, np.ndarray)) and np.size(value) == 1:
            return np.asarray(value).reshape(()).item()
    except ImportError:  # pragma: no cover
        pass
    return None


def _writer_error(exc: ValueError, file: Path) -> InputError:
    return InputError(f"cannot convert ({exc})", file=str(file))


# -- slime --------------------------------------------------------------------------------------------------------
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


def _train_samples(payload: dict[str, Any], kind: str, file: Path) -> list[dict[str, Any]]:
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

    def __init__(self, files: Sequence[Path]) -> None:
        self.paths: dict[int, Path] = {}
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

    def samples(self, rollout_id: int) -> tuple[Path, list[dict[str, Any]]] | None:
        path = self.paths.get(rollout_id)
        if path is None:
            return None
        if self._cached is None or self._cached[0] != rollout_id:
            self._cached = (rollout_id, safe_torch_load(path)["samples"])
        return path, self._cached[1]


def _convert_slime(
    train_files: Sequence[Path], rollout_files: Sequence[Path], out_dir: Path, result: ConvertResult,
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
    file: Path,
    samples: list[dict[str, Any]],
    raw_reward: Any,
    joined: tuple[Path, list[dict[str, Any]]] | None,
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


def _all_or_none(values: list[Any], name: str, file: Path, *, strict: bool = True) -> list[Any] | None:
    """A column is written only if every sample has it (absent stays absent, never zero-filled)."""
    if not values or all(v is None for v in values):
        return None if values else []
    if any(v is None for v in values):
        if strict:
            first = next(i for i, v in enumerate(values) if v is None)
            raise InputError(f"sample {first} lacks '{name}' that other samples have", file=str(file))
        return None
    return values


# -- torch-dict ---------------------------------------------------------------------------------------------------
def _conventions(preset: Preset | None) -> tuple[str, dict[str, str], str, bool]:
    """(alignment, column_alignment, window, pad one slot) for the writer from a preset."""
    if preset is None or preset.alignment == "token":
        return "token", {}, preset.window if preset is not None else "full", False
    overrides = dict.fromkeys(preset.token_aligned, "token")
    return "next_token", overrides, "full", preset.alignment == "next_token_short"


def _key_map(keys: Sequence[str], column_map: Mapping[str, str] | None, preset: Preset | None) -> dict[str, str]:
    """``{schema column: key}`` for the keys a source has."""
    resolved = resolve_column_map(preset, keys, column_map) if preset is not None else dict(column_map or {})
    out = {}
    for canonical in COLUMNS:
        key = resolved.get(canonical, canonical)
        if key in keys:
            out[canonical] = key
    return out


def _convert_torch_dict(
    files: Sequence[Path], out_dir: Path, result: ConvertResult, column_map: Mapping[str, str] | None,
    preset: Preset | None, metadata: Mapping[str, Any],
) -> None:
    alignment, overrides, window, pad = _conventions(preset)
    meta = {**metadata, "source_format": "torch-dict"}
    if preset is not None:
        meta.setdefault("framework", preset.framework)
    with RolloutWriter(out_dir, metadata=meta) as writer:
        try:
            for index, file in enumerate(files):
                payload = safe_torch_load(file)
                if not isinstance(payload, dict) or not all(isinstance(k, str) for k in payload):
                    raise InputError("expected a dict of tensors keyed by column name", file=str(file))
                keys = _key_map(list(payload), column_map, preset)
                if "new_logp" not in keys:
                    raise InputError("no 'new_logp' tensor (use --map new_logp=KEY or --preset)", file=str(file))
                step_key = keys.pop("step", None)
                used = {*keys.values(), "attention_mask", "lengths", step_key}
                ignored = sorted(k for k in payload if k not in used)
                if ignored:
                    result.notes.append(f"{file}: ignored keys {', '.join(ignored)}")
                new = _tensor(payload[keys["new_logp"]], keys["new_logp"], file)
                if new.dim() != 2:
                    raise InputError(f"'{keys['new_logp']}' must be padded [B, T], got {tuple(new.shape)}",
                                     file=str(file), column=keys["new_logp"])
                n_rows = new.shape[0]
                steps = _tensor(payload[step_key] if step_key else index, "step", file).reshape(-1)
                if steps.numel() not in (1, n_rows) or steps.is_floating_point():
                    raise InputError("'step' must be an int or one int per row", file=str(file))
                chunk = max(1, _CHUNK_TOKENS // max(new.shape[1], 1))
                for lo in range(0, n_rows, chunk):
                    rows = slice(lo, min(lo + chunk, n_rows))
                    inputs = _dict_rows(payload, keys, rows, n_rows, file, pad)
                    row_steps = steps if steps.numel() == 1 else steps[rows]
                    for value in torch.unique(row_steps).tolist():
                        pick = (row_steps == value).nonzero().flatten() if row_steps.numel() > 1 else None
                        part = inputs if pick is None else {k: _take(v, pick) for k, v in inputs.items()}
                        try:
                            n = writer.add(step=int(value), alignment=alignment, column_alignment=overrides,
                                           window=window, **part)
                        except ValueError as exc:
                            raise _writer_error(exc, file) from None
                        result.n_sequences += n
                del payload
            writer.flush()
        finally:
            writer.close()
            result.files.extend(writer.files)
    result.n_tokens = _count_tokens(result.files)


def _count_tokens(files: Sequence[Path]) -> int:
    total = 0
    for path in files:
        md = pq.ParquetFile(path).metadata
        for rg in range(md.num_row_groups):
            total += md.row_group(rg).column(0).num_values
    return total


def _take(value: Any, pick: Tensor) -> Any:
    if isinstance(value, Tensor) and value.dim() >= 1:
        return value[pick]
    return value


def _dict_rows(
    payload: Mapping[str, Any], keys: Mapping[str, str], rows: slice, n_rows: int, file: Path, pad: bool
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for canonical, key in keys.items():
        tensor = _tensor(payload[key], key, file)
        if tensor.dim() == 0:
            out[canonical] = tensor
            continue
        if tensor.shape[0] != n_rows:
            raise InputError(f"has {tensor.shape[0]} rows, new_logp has {n_rows}", file=str(file), column=key)
        tensor = tensor[rows]
        per_token = canonical in TOKEN_INPUTS and tensor.dim() == 2 and tuple(tensor.shape[1:]) != (1,)
        if pad and per_token:  # OpenRLHF-style [B, T-1]: one trailing slot lets next-token un-rolling keep all
            tensor = torch.nn.functional.pad(tensor, (0, 1), value=-1 if canonical == "versions" else 0)
        out[canonical] = tensor
    for extra in ("attention_mask", "lengths"):  # both describe the full rows (after the pad, if any)
        if extra in payload:
            out[extra] = _tensor(payload[extra], extra, file)[rows]
            break
    return out


# -- jsonl --------------------------------------------------------------------------------------------------------
def _convert_jsonl(
    files: Sequence[Path], out_dir: Path, result: ConvertResult, column_map: Mapping[str, str] | None,
    preset: Preset | None, metadata: Mapping[str, Any],
) -> None:
    alignment, overrides, window, pad = _conventions(preset)
    meta = {**metadata, "source_format": "jsonl"}
    if preset is not None:
        meta.setdefault("framework", preset.framework)
    keys: dict[str, str] | None = None
    if column_map and "step" in column_map:
        step_keys: tuple[str, ...] = (column_map["step"],)
    else:
        step_keys = preset.columns.get("step", ("step",)) if preset is not None else ("step",)
    with RolloutWriter(out_dir, metadata=meta) as writer:
        try:
            for file in files:
                for step, rows, first_line in _jsonl_chunks(file, step_keys):
                    if keys is None:
                        keys = _key_map(list(rows[0]), column_map, preset)
                        if "new_logp" not in keys:
                            raise InputError(f"{_line(first_line)}: no 'new_logp' list (use --map new_logp=KEY or "
                                             "--preset)", file=str(file), row=first_line - 1)
                    inputs = _jsonl_inputs(rows, keys, file, first_line, pad)
                    try:
                        result.n_sequences += writer.add(step=step, alignment=alignment, column_alignment=overrides,
                                                         window=window, **inputs)
                    except ValueError as exc:
                        raise _writer_error(exc, file) from None
        finally:
            writer.close()
            result.files.extend(writer.files)
    result.n_tokens = _count_tokens(result.files)


def _jsonl_chunks(file: Path, step_keys: Sequence[str]) -> Iterator[tuple[int, list[dict[str, Any]], int]]:
    """(step, rows, first line number) chunks of consecutive lines with one step, about 1M tokens each."""
    rows: list[dict[str, Any]] = []
    step: int | None = None
    tokens = 0
    first_line = 1
    try:
        handle = file.open("r", encoding="utf-8")
    except OSError as exc:
        raise InputError(f"cannot open ({exc.strerror or exc})", file=str(file)) from None
    with handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InputError(f"{_line(number)}: not JSON ({exc.msg})", file=str(file), row=number - 1) from None
            if not isinstance(row, dict):
                raise InputError(f"{_line(number)}: expected a JSON object", file=str(file), row=number - 1)
            step_key = next((k for k in step_keys if k in row), None)
            row_step = row[step_key] if step_key is not None else 0
            if isinstance(row_step, bool) or not isinstance(row_step, int) or row_step < 0:
                raise InputError(f"{_line(number)}: '{step_key}' must be an integer >= 0", file=str(file),
                                 column=step_key, row=number - 1)
            if rows and (row_step != step or tokens >= _CHUNK_TOKENS):
                yield step, rows, first_line  # type: ignore[misc]  # step is set once rows is not empty
                rows, tokens = [], 0
            if not rows:
                first_line = number
            step = row_step
            rows.append(row)
            new = row.get("new_logp")
            tokens += len(new) if isinstance(new, list) else 1
        if rows:
            yield step, rows, first_line  # type: ignore[misc]  # step is set once rows is not empty


def _line(number: int) -> str:
    """A JSON-lines position: the error's ``row`` is 0-based like every row grpo-cli reports (pyarrow/pandas), the
    editor's 1-based line number is given beside it."""
    return f"line {number}"


def _jsonl_inputs(
    rows: list[dict[str, Any]], keys: Mapping[str, str], file: Path, first_line: int, pad: bool
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for canonical, key in keys.items():
        if canonical == "step":
            continue
        values = []
        for offset, row in enumerate(rows):
            if key not in row or row[key] is None:
                raise InputError(f"{_line(first_line + offset)}: no '{key}' (earlier lines have it)",
                                 file=str(file), column=key, row=first_line + offset - 1)
            values.append(row[key])
        per_sequence = canonical in _PER_SEQUENCE or (
            canonical == "advantages" and not isinstance(values[0], list)
        )
        if per_sequence:
            if any(isinstance(v, list) for v in values):
                raise InputError(f"lines {first_line}…: '{key}' must be one number per line", file=str(file),
                                 column=key, row=first_line - 1)
            out[canonical] = values
            continue
        tensors = []
        for offset, value in enumerate(values):
            if not isinstance(value, list):
                raise InputError(f"{_line(first_line + offset)}: '{key}' must be a list (one value per token)",
                                 file=str(file), column=key, row=first_line + offset - 1)
            try:
                tensor = torch.tensor(
                    [math.nan if v is None else v for v in value],
                    dtype=torch.int64 if canonical in ("versions",) else torch.float64,
                )
            except (TypeError, ValueError) as exc:
                raise InputError(f"{_line(first_line + offset)}: '{key}' is not numeric ({exc})", file=str(file),
                                 column=key, row=first_line + offset - 1) from None
            if pad:
                tensor = torch.cat([tensor, tensor.new_full((1,), -1 if canonical == "versions" else 0)])
            tensors.append(tensor)
        out[canonical] = tensors
    return out


# -- validation ---------------------------------------------------------------------------------------------------
Check = Callable[[Any, "ConvertResult", str], None]
"""``check(dataset, result, what)``: the value checks run on a dump before it is rewritten (``optimize``) or on
what a converter wrote; it raises :class:`~grpo_cli.errors.InputError` to refuse the data, or adds notes to
``result``. The command layer supplies it (``grpo_cli.commands.convert``: ``analyze``'s validation)."""


def _validate_written(result: ConvertResult, check: Check | None) -> None:
    """Check what a converter wrote; a refusal removes the written files (all or nothing)."""
    from grpo_cli.io.reader import RolloutDataset

    if not result.files or check is None:
        return
    try:
        check(RolloutDataset(result.files), result, "converted data")
    except InputError as exc:
        for path in result.files:
            path.unlink(missing_ok=True)
        raise InputError(f"converted data is invalid, nothing written: {exc}") from None


# -- optimize -----------------------------------------------------------------------------------------------------
def optimize_dump(
    sources: Sequence[str | os.PathLike[str]],
    out_dir: str | os.PathLike[str],
    *,
    column_map: Mapping[str, str] | None = None,
    preset: str | None = None,
    row_group_tokens: int = _CHUNK_TOKENS,
    check: Check | None = None,
) -> ConvertResult:
    """Re-encode a schema-v1 dump with the writer's fast settings (non-nullable, BYTE_STREAM_SPLIT + zstd).

    The dump is first read once by ``check`` (``--map``/``--preset`` apply; the command passes ``analyze``'s
    validation, which stops at invalid values or counts them into a note), then each
    file is streamed into ``out_dir`` under its own relative name, all columns kept, row groups merged to about
    ``row_group_tokens`` tokens, each output file written to a temporary name and renamed when complete.
    """
    out = Path(out_dir)
    dataset = open_dataset(sources, column_map, preset)
    names = _relative_names(sources, dataset.files)
    _check_out_dir(out, dataset.files)
    result = ConvertResult()
    # Read once with the checks (types, nulls, list lengths, values) before anything is written.
    if check is not None:
        check(dataset, result, "the dump")
    token_layout = dataset.layout is Layout.TOKEN_PER_ROW
    schema_columns = {dataset.column_map.get(c, c) for c in dataset.columns}
    for path, name in zip(dataset.files, names):
        target = out / name
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.parent / f".{target.name}.{os.getpid()}.tmp"
        parquet = pq.ParquetFile(path, memory_map=True)
        source_schema = parquet.schema_arrow
        schema = pa.schema(
            [_non_nullable(f) if f.name in schema_columns else f for f in source_schema],
            metadata=source_schema.metadata,
        )
        new_name = dataset.column_map.get("new_logp", "new_logp")
        try:
            with pq.ParquetWriter(tmp, schema, **fast_write_options(schema)) as writer:
                pending: list[pa.RecordBatch] = []
                pending_tokens = 0
                for batch in parquet.iter_batches(batch_size=65536, use_threads=True):
                    batch = batch.cast(schema)
                    pending.append(batch)
                    column = batch.column(new_name)
                    pending_tokens += batch.num_rows if token_layout else _list_values(column)
                    if pending_tokens >= row_group_tokens:
                        table = pa.Table.from_batches(pending, schema=schema)
                        writer.write_table(table, row_group_size=max(table.num_rows, 1))
                        result.n_tokens += pending_tokens
                        pending, pending_tokens = [], 0
                if pending:
                    table = pa.Table.from_batches(pending, schema=schema)
                    writer.write_table(table, row_group_size=max(table.num_rows, 1))
                    result.n_tokens += pending_tokens
            os.replace(tmp, target)
        except (pa.ArrowException, OSError) as exc:
            tmp.unlink(missing_ok=True)
            raise InputError(f"cannot rewrite ({str(exc).splitlines()[0] if str(exc) else exc})",
                             file=str(path)) from None
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        result.files.append(target)
        result.n_sequences += parquet.metadata.num_rows
    if token_layout:
        result.n_sequences = -1  # not known without reading seq_id; reported as n/a
    return result


def _list_values(column: pa.Array) -> int:
    offsets = column.offsets
    return int(offsets[-1].as_py()) - int(offsets[0].as_py()) if len(column) else 0


def _non_nullable(f: pa.Field) -> pa.Field:
    if pa.types.is_list(f.type):
        return pa.field(f.name, pa.list_(pa.field("element", f.type.value_type, nullable=False)), nullable=False,
                        metadata=f.metadata)
    if pa.types.is_large_list(f.type):
        return pa.field(f.name, pa.large_list(pa.field("element", f.type.value_type, nullable=False)),
                        nullable=False, metadata=f.metadata)
    return f.with_nullable(False)


def _relative_names(sources: Sequence[str | os.PathLike[str]], files: Sequence[Path]) -> list[Path]:
    """Each file's name relative to the source directory it was found in (or its own name)."""
    dirs = [Path(s).resolve() for s in sources if Path(s).is_dir()]
    names: list[Path] = []
    for path in files:
        resolved = path.resolve()
        base = next((d for d in dirs if d in resolved.parents), None)
        names.append(resolved.relative_to(base) if base is not None else Path(path.name))
    if len(set(names)) != len(names):
        seen: set[Path] = set()
        dup = next(n for n in names if n in seen or seen.add(n))  # type: ignore[func-returns-value]  # set.add used for its effect
        raise UsageError(f"two inputs would both be written as {dup}; convert them separately")
    return names


# -- entry point --------------------------------------------------------------------------------------------------
def _split_dump_details(sources: Sequence[Path]) -> tuple[list[Path], list[Path]] | None:
    """A slime ``--dump-details`` directory → (train files, rollout files), else None."""
    train: list[Path] = []
    rollout: list[Path] = []
    for source in sources:
        if source.is_dir() and (source / "train_data").is_dir() and (source / "rollout_data").is_dir():
            train += _expand([source / "train_data"], (".pt",))
            rollout += _expand([source / "rollout_data"], (".pt",))
        else:
            return None
    return train, rollout


def convert(
    sources: Sequence[str | os.PathLike[str]],
    out_dir: str | os.PathLike[str],
    *,
    source_format: str | None = None,
    optimize: bool = False,
    join: Sequence[str | os.PathLike[str]] = (),
    column_map: Mapping[str, str] | None = None,
    preset: str | None = None,
    metadata: Mapping[str, Any] | None = None,
    check: Check | None = None,
) -> ConvertResult:
    """Convert ``sources`` into schema-v1 part files in ``out_dir`` (see the module docstring).

    The result is read back once by ``check`` (the command passes ``analyze``'s value checks): a refusal removes
    what was written and raises; otherwise the data is kept and ``check`` may add notes.

    Raises:
        UsageError: bad option combinations, a non-empty output directory.
        InputError: unreadable or refused sources, missing keys, inconsistent samples.
    """
    if not sources:
        raise UsageError("give at least one source")
    out = Path(out_dir)
    if source_format is None and not optimize and all(
        str(source).endswith((".jsonl", ".ndjson")) for source in sources
    ):
        source_format = "jsonl"  # JSON lines are recognised by their extension (docs/schema.md)
    if source_format is None:
        if not optimize:
            raise UsageError(f"give --from FORMAT ({', '.join(FORMATS)}) or --optimize")
        if join:
            raise UsageError("--join applies to --from slime-train/slime-rollout")
        return optimize_dump(sources, out, column_map=column_map, preset=preset, check=check)
    if source_format not in FORMATS:
        raise UsageError(f"--from: unknown format '{source_format}' (known: {', '.join(FORMATS)})")
    if join and not source_format.startswith("slime"):
        raise UsageError("--join applies to --from slime-train/slime-rollout")
    chosen = None
    if preset is not None:
        if preset not in PRESETS:
            raise UsageError(f"--preset: unknown preset '{preset}' (known: {', '.join(PRESETS)})")
        chosen = PRESETS[preset]
    result = ConvertResult()
    if optimize:
        result.notes.append("--optimize: converters always write the fast settings")
    meta = dict(metadata or {})
    if source_format.startswith("slime"):
        if column_map or chosen is not None:
            raise UsageError("--map/--preset do not apply to slime dumps (their keys are fixed)")
        source_paths = [Path(s) for s in sources]
        split = _split_dump_details(source_paths)
        if split is not None:
            train, rollout = split
            rollout += _expand(join, (".pt",)) if join else []
        else:
            primary = _expand(source_paths, (".pt",))
            other = _expand(join, (".pt",)) if join else []
            train, rollout = (primary, other) if source_format == "slime-train" else (other, primary)
        if not train:
            raise UsageError("a slime rollout dump has no training log-prob (schema v1 needs new_logp): pass the "
                             "matching --save-debug-train-data files with --join")
        _check_out_dir(out, [*train, *rollout])
        _convert_slime(train, rollout, out, result, meta)
    elif source_format == "torch-dict":
        files = _expand([Path(s) for s in sources], (".pt", ".pth", ".bin"))
        _check_out_dir(out, files)
        _convert_torch_dict(files, out, result, column_map, chosen, meta)
    else:
        files = _expand([Path(s) for s in sources], (".jsonl", ".json"))
        _check_out_dir(out, files)
        _convert_jsonl(files, out, result, column_map, chosen, meta)
    if not result.files:
        raise InputError("no sequences found in the sources", file=str(sources[0]))
    _validate_written(result, check)
    return result
