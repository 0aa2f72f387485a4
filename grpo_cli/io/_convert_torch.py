"""The converters' torch side: :func:`safe_torch_load` (``torch.load(weights_only=True)`` behind an allow-list)
and ``--from torch-dict`` (a ``torch.save``d dict of padded ``[B, T]`` tensors)."""

from __future__ import annotations

import io
import os
import re
import warnings
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from grpo_cli.errors import InputError
from grpo_cli.io._convert_common import (
    _CHUNK_TOKENS,
    ConvertResult,
    _conventions,
    _count_tokens,
    _key_map,
    _writer_error,
)
from grpo_cli.io.part_writer import TOKEN_INPUTS
from grpo_cli.io.preset_table import Preset
from grpo_cli.io.storage import DumpPath, RemotePath, read_bytes
from grpo_cli.io.writer import RolloutWriter

__all__ = ["safe_torch_load"]


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


def safe_torch_load(path: str | os.PathLike[str] | RemotePath) -> Any:
    """``torch.load(weights_only=True)`` with numpy arrays allowed; anything else is an :class:`InputError`.

    Zip-format files are memory-mapped, so large tensors are paged in only when read.

    Raises:
        InputError: unreadable file, or a pickle that needs a global outside the allow-list (named).
    """
    source: Any
    if isinstance(path, RemotePath):
        source, mmap = io.BytesIO(read_bytes(path)), False  # an object cannot be memory-mapped: read whole
    else:
        path = source = Path(path)
        mmap = zipfile.is_zipfile(path)
    try:
        with torch.serialization.safe_globals(_numpy_allow_list()), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns about pickle protocols it may not support
            return torch.load(source, map_location="cpu", weights_only=True, mmap=mmap)
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


def _tensor(value: Any, what: str, file: DumpPath) -> Tensor:
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


def _convert_torch_dict(
    files: Sequence[DumpPath], out_dir: DumpPath, result: ConvertResult, column_map: Mapping[str, str] | None,
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


def _take(value: Any, pick: Tensor) -> Any:
    if isinstance(value, Tensor) and value.dim() >= 1:
        return value[pick]
    return value


def _dict_rows(
    payload: Mapping[str, Any], keys: Mapping[str, str], rows: slice, n_rows: int, file: DumpPath, pad: bool
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
