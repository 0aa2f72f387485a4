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
:class:`~grpo_cli.io.writer.RolloutWriter` (JSON lines, as numpy arrays, through its torch-free
:class:`~grpo_cli.io.part_writer.PartWriter`: ``--from jsonl`` never loads torch). The result is checked by a
``check_files`` (or ``check``) callable the command supplies (``grpo_cli.commands.convert``: ``analyze``'s
validation; under ``--on-invalid error``, the default, an invalid value removes what was written and exits 2; under
``skip`` the data is kept and the offenders are counted in a note).

How slime's keys map (``docs/recipes/slime.md``): ``log_probs`` (the actor's recompute with the pre-update weights, i.e.
the weights of the step's first training forward) → ``new_logp``; the per-update new log-prob is never dumped, and
a second copy as ``prox_logp`` would make every ratio 1, so ``prox_logp`` stays absent. ``rollout_log_probs`` →
``old_logp``, ``ref_log_probs`` → ``ref_logp``, ``entropy`` → ``entropy``, ``loss_masks`` → ``loss_mask``,
``advantages`` → ``advantages``, ``rollout_id`` → ``step``, ``rollout_position`` → ``seq_id``; rewards are the raw
rewards (joined rollout ``reward``, else the payload's ``raw_reward``), never the post-processed per-sample
``rewards``; with ``--join``: ``group_index`` → ``group_id`` and the last of ``weight_versions`` → ``versions``
(every response token). Windows are response-only and token-aligned; the metadata records all of this.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpo_cli._choices import CONVERT_FORMATS
from grpo_cli.errors import InputError, UsageError
from grpo_cli.io._convert_common import Check, CheckFiles, ConvertResult, _check_out_dir, _expand
from grpo_cli.io._convert_jsonl import _convert_jsonl
from grpo_cli.io._optimize import optimize_dump
from grpo_cli.io.preset_table import PRESETS
from grpo_cli.io.storage import DumpPath, is_uri, remove, to_path

if TYPE_CHECKING:
    from grpo_cli.io._convert_torch import safe_torch_load

# torch is loaded only for the formats that hold tensors (slime, torch-dict): ``--from jsonl`` and ``--optimize``
# stay torch-free (docs/performance.md).

__all__ = ["FORMATS", "Check", "CheckFiles", "ConvertResult", "convert", "optimize_dump", "safe_torch_load"]

FORMATS = CONVERT_FORMATS


def __getattr__(name: str) -> Any:
    # PEP 562: safe_torch_load (torch) is imported from here when first used.
    if name == "safe_torch_load":
        from grpo_cli.io._convert_torch import safe_torch_load

        return safe_torch_load
    raise AttributeError(f"module 'grpo_cli.io.convert' has no attribute {name!r}")


def _validate_written(result: ConvertResult, check: Check | None, check_files: CheckFiles | None) -> None:
    """Check what a converter wrote; a refusal removes the written files (all or nothing)."""
    if not result.files or (check is None and check_files is None):
        return
    try:
        if check_files is not None:
            check_files(list(result.files), result, "converted data")
        else:
            from grpo_cli.io.reader import RolloutDataset

            assert check is not None
            check(RolloutDataset(result.files), result, "converted data")
    except InputError as exc:
        for path in result.files:
            remove(path)
        raise InputError(f"converted data is invalid, nothing written: {exc}") from None


# -- entry point --------------------------------------------------------------------------------------------------
def _split_dump_details(sources: Sequence[Path]) -> tuple[list[DumpPath], list[DumpPath]] | None:
    """A slime ``--dump-details`` directory → (train files, rollout files), else None."""
    train: list[DumpPath] = []
    rollout: list[DumpPath] = []
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
    check_files: CheckFiles | None = None,
) -> ConvertResult:
    """Convert ``sources`` into schema-v1 part files in ``out_dir`` (see the module docstring).

    The result is read back once by ``check_files`` (given the written files), else by ``check`` (given them as a
    :class:`~grpo_cli.io.reader.RolloutDataset`; ``--optimize`` always uses ``check``). The command passes
    ``analyze``'s value checks as both, the torch-free ones as ``check_files``. A refusal removes what was written
    and raises; otherwise the data is kept and the check may add notes.

    Raises:
        UsageError: bad option combinations, a non-empty output directory.
        InputError: unreadable or refused sources, missing keys, inconsistent samples.
    """
    if not sources:
        raise UsageError("give at least one source")
    out = to_path(out_dir)
    remote_sources = [str(s) for s in [*sources, *join] if is_uri(s)]
    if remote_sources and source_format is not None and source_format.startswith("slime"):
        raise UsageError(f"{remote_sources[0]}: convert --from {source_format} reads local files (slime's dump "
                         "directories); copy them to a local directory first")
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
        from grpo_cli.io._convert_slime import _convert_slime

        _convert_slime(train, rollout, out, result, meta)
    elif source_format == "torch-dict":
        files = _expand(list(sources), (".pt", ".pth", ".bin"))
        _check_out_dir(out, files)
        from grpo_cli.io._convert_torch import _convert_torch_dict

        _convert_torch_dict(files, out, result, column_map, chosen, meta)
    else:
        files = _expand(list(sources), (".jsonl", ".json"))
        _check_out_dir(out, files)
        _convert_jsonl(files, out, result, column_map, chosen, meta)
    if not result.files:
        raise InputError("no sequences found in the sources", file=str(sources[0]))
    _validate_written(result, check, check_files)
    return result
