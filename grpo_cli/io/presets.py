"""``--preset NAME``: column maps and conventions for dumps written with a framework's own tensor names.

A preset is for a Parquet dump whose columns carry a framework's names (``rollout_log_probs``, ``old_log_probs``,
``response_mask``, …) and keep that framework's conventions, e.g. a verl user who wrote the step batch's tensors
as they are. It does two things (``dumps.md`` §8–9):

* **Renames**: schema column ← the first of the preset's candidate names that the file has (``--map`` wins over
  the preset; a column none of whose names is present falls back to its schema name, else stays absent). Where a
  framework's "old" log-prob is the recomputed *proximal* policy (verl ``old_log_probs``, TRL
  ``old_per_token_logps``, slime ``log_probs``, OpenRLHF ``action_log_probs``) it becomes ``prox_logp``, and the
  inference engine's log-prob becomes ``old_logp`` (schema v1's behaviour policy).
* **Alignment**: next-token-aligned frameworks are un-rolled to schema v1's token alignment by a transform applied
  to every batch the reader yields (:class:`UnrollTransform` for AReaL and twinkle, same length;
  :class:`PrependSlotTransform` for OpenRLHF, whose ``[B, T − 1]`` action tensors lack the first token). Files
  written by :class:`grpo_cli.io.RolloutWriter` are token-aligned already (metadata ``grpo_cli.alignment``) and are
  left alone.

The new log-prob of the training forward pass is a local variable of each framework's loss, not a named tensor
of its batch; each preset lists the name to store it under (``new_logp`` always works).

Example:
    >>> from grpo_cli.io.presets import PRESETS, resolve_column_map
    >>> resolve_column_map(PRESETS["verl"], ["new_logp", "old_log_probs", "rollout_log_probs", "response_mask"])
    {'old_logp': 'rollout_log_probs', 'prox_logp': 'old_log_probs', 'loss_mask': 'response_mask'}
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from grpo_cli.errors import InputError, UsageError
from grpo_cli.io.schema import COLUMNS

if TYPE_CHECKING:

    from grpo_cli.core.batch import TokenBatch
    from grpo_cli.io.reader import RolloutDataset

# The preset table, describe() and format_description() need no torch: ``grpo-cli schema`` loads none. The reader,
# the writer's metadata and the alignment functions (all torch) are imported where a dataset is opened.

__all__ = [
    "PRESETS",
    "PrependSlotTransform",
    "Preset",
    "UnrollTransform",
    "open_dataset",
    "preset_transforms",
    "resolve_column_map",
    "unread_column_notes",
]


def _shifted() -> tuple[str, ...]:
    """Per-token columns a transform shifts (``loss_mask`` is always shifted too: it exists on every batch)."""
    from grpo_cli.core.batch import PER_TOKEN_COLUMNS

    return tuple(PER_TOKEN_COLUMNS)

_FILL: dict[str, float | int | bool] = {"versions": -1, "loss_mask": False}


@dataclass(frozen=True)
class Preset:
    """A framework's column names and conventions.

    Attributes:
        name: the ``--preset`` value.
        framework: display name.
        columns: ``{schema column: candidate names}``; the first candidate the file has wins.
        alignment: ``"token"``, ``"next_token"`` (same length, un-rolled) or ``"next_token_short"`` (one slot
            fewer than tokens; a first slot is prepended).
        token_aligned: per-token columns exempt from un-rolling (AReaL's ``versions``).
        window: ``"full"`` or ``"response"``: which tokens the framework's per-token tensors cover.
        source: where these tensors live in the framework (the hook a dump is taken from).
        notes: traps to know when writing or reading such a dump (printed by ``grpo-cli schema --preset``).
    """

    name: str
    framework: str
    columns: Mapping[str, tuple[str, ...]]
    alignment: str
    window: str
    source: str
    token_aligned: frozenset[str] = field(default_factory=frozenset)
    notes: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "framework": self.framework,
            "columns": {k: list(v) for k, v in self.columns.items()},
            "alignment": self.alignment,
            "token_aligned": sorted(self.token_aligned),
            "window": self.window,
            "source": self.source,
            "notes": list(self.notes),
        }


_TEMPERATURE_NOTE = (
    "Temperature: the trainer divides logits by the sampling temperature; the engine's log-probs are scaled only "
    "if it returns processed log-probs (vLLM logprobs_mode=processed_logprobs; SGLang scales by default). Record "
    "temperature/top_p/top_k/logprobs_mode in the metadata; with top_p < 1 a behaviour/proximal gap is expected."
)

PRESETS: dict[str, Preset] = {
    preset.name: preset
    for preset in (
        Preset(
            name="areal",
            framework="AReaL",
            columns={
                "new_logp": ("new_logp", "new_logprobs"),
                "old_logp": ("logprobs",),
                "prox_logp": ("prox_logp",),
                "ref_logp": ("ref_logp",),
                "entropy": ("entropy",),
                "loss_mask": ("loss_mask",),
                "versions": ("versions",),
                "advantages": ("advantages",),
                "rewards": ("rewards",),
                "current_version": ("current_version", "version"),
                "step": ("step", "global_step"),
                "group_id": ("group_id", "task_id"),
            },
            alignment="next_token",
            token_aligned=frozenset({"versions"}),
            window="full",
            source="PPOActor._ppo_update input dict (post-advantage, padded [B, S]) + grpo_loss_fn's logprobs/entropy",
            notes=(
                "Every per-token tensor after _compute_advantages is rolled by -1 (next-token aligned) except "
                "versions; the preset un-rolls all but versions (the off-by-one AReaL #1736 fixes in its own stats).",
                "The batch's 'logprobs' is the behaviour policy (old_logp); the loss argument 'logprobs' is the new "
                "policy: store it as new_logp or new_logprobs.",
                "ref_logp is zeros when there is no reference model: do not store it then (absent, not zero).",
                "With recompute_logprob but no decoupled loss, 'logprobs' holds prox_logp: then store old_logp from "
                "the workflow output (token-aligned) instead.",
                _TEMPERATURE_NOTE,
            ),
        ),
        Preset(
            name="verl",
            framework="verl",
            columns={
                "new_logp": ("new_logp", "log_probs"),
                "old_logp": ("rollout_log_probs",),
                "prox_logp": ("old_log_probs",),
                "ref_logp": ("ref_log_prob",),
                "entropy": ("entropy", "entropys"),
                "loss_mask": ("response_mask",),
                "advantages": ("advantages",),
                "rewards": ("rewards", "scores"),
                "current_version": ("current_version",),
                "step": ("step", "global_steps"),
                "group_id": ("group_id",),
            },
            alignment="token",
            window="response",
            source="DataProto step batch in RayPPOTrainer._log_rollout_data + model_output['log_probs'] in ppo_loss",
            notes=(
                "verl's old_log_probs is the actor's recompute (proximal) → prox_logp; rollout_log_probs is the "
                "behaviour policy → old_logp.",
                "In bypass mode old_log_probs is a copy of rollout_log_probs: do not store it then.",
                "non_tensor_batch['uid'] is a uuid string: convert it to stable ints for group_id.",
                "Rejection sampling rewrites response_mask in flight: dump the pre-edit mask.",
                "balance_batch reorders rows: carry seq_id.",
                _TEMPERATURE_NOTE,
            ),
        ),
        Preset(
            name="trl",
            framework="TRL",
            columns={
                "new_logp": ("new_logp", "per_token_logps"),
                "old_logp": ("sampling_per_token_logps",),
                "prox_logp": ("old_per_token_logps",),
                "ref_logp": ("ref_per_token_logps",),
                "entropy": ("entropy", "entropies"),
                "loss_mask": ("completion_mask",),
                "advantages": ("advantages",),
                "rewards": ("rewards", "reward"),
                "current_version": ("current_version", "model_version"),
                "step": ("step", "global_step"),
                "group_id": ("group_id",),
            },
            alignment="token",
            window="response",
            source="GRPOTrainer._generate_and_score_completions output + per_token_logps in _compute_loss",
            notes=(
                "old_per_token_logps is the trainer's recompute (proximal) → prox_logp, and is omitted when "
                "on-policy without vLLM IS; sampling_per_token_logps is vLLM's → old_logp.",
                "completion_mask is multiplied by tool_mask in the loss: store the product you train on.",
                "Rows are shuffled and split over steps_per_generation: add a group/seq id before returning.",
                _TEMPERATURE_NOTE,
            ),
        ),
        Preset(
            name="slime",
            framework="slime",
            columns={
                "new_logp": ("new_logp", "new_log_probs"),
                "old_logp": ("rollout_log_probs",),
                "prox_logp": ("log_probs",),
                "ref_logp": ("ref_log_probs",),
                "entropy": ("entropy",),
                "loss_mask": ("loss_masks",),
                "advantages": ("advantages",),
                "rewards": ("raw_reward", "reward", "rewards"),
                "step": ("step", "rollout_id"),
                "group_id": ("group_id", "group_index"),
                "seq_id": ("seq_id", "rollout_position", "sample_index"),
            },
            alignment="token",
            window="response",
            source="--save-debug-train-data samples (grpo-cli convert --from slime-train) + custom-loss new log-prob",
            notes=(
                "slime's log_probs is the actor recompute before the update (proximal) → prox_logp; the per-update "
                "new log-prob is never dumped (only via a --custom-loss-function-path wrapper).",
                "The train dump's 'rewards' are post-processed (group-normalised); raw_reward is the reward.",
                "weight_versions are per-sample strings in the rollout dump: grpo-cli convert joins them on "
                "rollout_position.",
                _TEMPERATURE_NOTE,
            ),
        ),
        Preset(
            name="openrlhf",
            framework="OpenRLHF",
            columns={
                "new_logp": ("new_logp", "new_action_log_probs"),
                "old_logp": ("rollout_log_probs",),
                "prox_logp": ("action_log_probs",),
                "ref_logp": ("base_action_log_probs",),
                "entropy": ("entropy",),
                "loss_mask": ("action_mask",),
                "advantages": ("advantages",),
                "rewards": ("rewards",),
                "step": ("step", "global_step"),
                "group_id": ("group_id",),
                "seq_id": ("seq_id", "index"),
            },
            alignment="next_token_short",
            window="full",
            source="Experience in ActorPPOTrainer.training_step ([B, T-1] action tensors) + the actor's new output",
            notes=(
                "Experience tensors are [B, T-1]: index j scores token j+1. The preset prepends one slot per "
                "sequence (masked), making it token-aligned over the full sequence.",
                "experience.action_log_probs is the actor recompute (proximal) → prox_logp; store the actor's new "
                "output in training_step as new_logp.",
                "rollout_log_probs exists only with --algo.advantage.is_correction_enable.",
                "group = index // n_samples_per_prompt.",
                _TEMPERATURE_NOTE,
            ),
        ),
        Preset(
            name="twinkle",
            framework="twinkle",
            columns={
                "new_logp": ("new_logp", "logps"),
                "old_logp": ("old_logps",),
                "ref_logp": ("ref_logps",),
                "entropy": ("entropy", "entropies"),
                "loss_mask": ("loss_mask", "mask"),
                "advantages": ("advantages",),
                "rewards": ("rewards",),
                "step": ("step", "optim_step"),
                "group_id": ("group_id",),
            },
            alignment="next_token",
            window="full",
            source="a Metric registered with model.add_metric: outputs['logps'], inputs['labels'], forward kwargs",
            notes=(
                "Template._roll_labels rolls labels by -1, so logps/entropies/labels are next-token aligned; the "
                "preset un-rolls them.",
                "Store the mask labels != -100 (as loss_mask or mask), not the labels: a label column is not a mask.",
                "old_logps are response-only lists: scatter them onto the mask's positions (as GRPOMetric does) "
                "before storing, so all columns have the row's length.",
                "Masked positions hold garbage (the log-prob of token 0): only masked-in values are meaningful.",
                _TEMPERATURE_NOTE,
            ),
        ),
    )
}


def _by_name(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise UsageError(f"--preset: unknown preset '{name}' (known: {', '.join(PRESETS)})") from None


def resolve_column_map(
    preset: Preset | str, available: Iterable[str], column_map: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The ``{schema column: file column}`` renames a preset implies for a file with columns ``available``.

    ``column_map`` (``--map``) wins. A schema column gets the first candidate present; if none is present it is
    left out (the reader then uses the schema name, if the file has it). A file column is never used twice.
    """
    preset = _by_name(preset) if isinstance(preset, str) else preset
    present = set(available)
    out: dict[str, str] = dict(column_map or {})
    used = set(out.values())
    for canonical in COLUMNS:
        if canonical in out:
            continue
        for candidate in preset.columns.get(canonical, ()):
            if candidate in present and candidate not in used:
                if candidate != canonical:
                    out[canonical] = candidate
                used.add(candidate)
                break
    return out


def _is_list(dtype: pa.DataType) -> bool:
    return pa.types.is_list(dtype) or pa.types.is_large_list(dtype)


class UnrollTransform:
    """Un-rolls next-token-aligned per-token columns of every batch (same lengths; ``align.unroll_next_token``).

    Args:
        columns: the per-token columns to shift (``loss_mask`` is always shifted).
        skip_files: file indices that are token-aligned already (written by ``RolloutWriter``).
    """

    def __init__(self, columns: Iterable[str], skip_files: Iterable[int] = ()) -> None:
        self.columns = tuple(columns)
        self.skip_files = frozenset(skip_files)

    def __call__(self, batch: TokenBatch) -> TokenBatch:
        from grpo_cli.io.align import unroll_next_token

        if batch.file_index in self.skip_files:
            return batch
        changes: dict[str, Any] = {}  # column → Tensor (Any: dataclasses.replace types each field)
        for name in (*self.columns, "loss_mask"):
            values = getattr(batch, name)
            if values is not None:
                changes[name] = unroll_next_token(values, batch.cu_seqlens, _FILL.get(name, 0.0))
        return replace(batch, positions=None, **changes)


class PrependSlotTransform:
    """Inserts a masked first slot into every sequence (OpenRLHF's ``[B, T − 1]`` tensors → ``T`` tokens).

    Args:
        skip_files: file indices that are token-aligned already (written by ``RolloutWriter``).
    """

    def __init__(self, skip_files: Iterable[int] = ()) -> None:
        self.skip_files = frozenset(skip_files)

    def __call__(self, batch: TokenBatch) -> TokenBatch:
        from grpo_cli.io.align import prepend_slot

        if batch.file_index in self.skip_files:
            return batch
        changes: dict[str, Any] = {}  # column → Tensor (Any: dataclasses.replace types each field)
        cu_out = batch.cu_seqlens
        for name in (*_shifted(), "loss_mask"):
            values = getattr(batch, name)
            if values is not None:
                changes[name], cu_out = prepend_slot(values, batch.cu_seqlens, _FILL.get(name, 0.0))
        return replace(batch, cu_seqlens=cu_out, positions=None, **changes)


def preset_transforms(preset: Preset | str, dataset: RolloutDataset) -> list[Any]:
    """The batch transforms a preset needs on ``dataset`` (empty for token-aligned frameworks)."""
    from grpo_cli.io.part_writer import read_metadata

    preset = _by_name(preset) if isinstance(preset, str) else preset
    if preset.alignment == "token":
        return []
    skip = [i for i, path in enumerate(dataset.files) if read_metadata(path).get("alignment") == "token"]
    if preset.alignment == "next_token_short":
        return [PrependSlotTransform(skip)]
    columns = [c for c in _shifted() if c not in preset.token_aligned]
    if "advantages" in columns and "advantages" in dataset.columns and not _per_token_advantages(dataset):
        columns.remove("advantages")  # one value per sequence (broadcast by the reader): nothing to shift
    return [UnrollTransform(columns, skip)]


def _per_token_advantages(dataset: RolloutDataset) -> bool:
    name = dataset.column_map.get("advantages", "advantages")
    schema = pq.read_schema(dataset.files[0])
    new_name = dataset.column_map.get("new_logp", "new_logp")
    token_layout = not _is_list(schema.field(new_name).type)
    return token_layout or _is_list(schema.field(name).type)


def open_dataset(
    paths: Sequence[str | os.PathLike[str]],
    column_map: Mapping[str, str] | None = None,
    preset: str | None = None,
) -> RolloutDataset:
    """A :class:`RolloutDataset` with ``--map`` and ``--preset`` applied (what every command should open).

    Raises:
        UsageError: an unknown preset.
        InputError: what :class:`RolloutDataset` raises (missing files or columns, wrong types).
    """
    from grpo_cli.io.reader import expand_paths

    if preset is None:
        return _open_noting(paths, dict(column_map or {}), None)
    chosen = _by_name(preset)
    files = expand_paths(paths)
    try:
        available = pq.read_schema(files[0]).names
    except (pa.ArrowException, OSError):
        available = []  # the dataset below reports the unreadable file with its usual message
    resolved = resolve_column_map(chosen, available, column_map)
    if chosen.name == "twinkle" and "loss_mask" not in resolved and "loss_mask" not in available and (
        "labels" in available
    ):
        raise InputError(
            "--preset twinkle: found 'labels' but no mask; store labels != -100 as 'loss_mask' (a label column "
            "holds token ids, not a mask)",
            file=str(files[0]),
            column="labels",
        )
    dataset = _open_noting(paths, resolved, chosen)
    dataset.transforms.extend(preset_transforms(chosen, dataset))
    return dataset


def _open_noting(paths: Sequence[str | os.PathLike[str]], column_map: Mapping[str, str],
                 preset: Preset | None) -> RolloutDataset:
    """:class:`RolloutDataset` plus the column hints: a missing required column names the preset whose names the
    file uses, and file columns that look like unread schema columns become ``dataset.notes``."""
    from grpo_cli.io.reader import RolloutDataset

    try:
        dataset = RolloutDataset(paths, dict(column_map))
    except InputError as exc:
        if exc.column in ("new_logp",) and exc.reason.startswith("required column is missing") and exc.file:
            hint = _missing_hint(_file_columns(exc.file), preset)
            if hint:
                raise InputError(f"{exc.reason}; {hint}", file=exc.file, column=exc.column) from None
        raise
    try:
        available = pq.read_schema(dataset.files[0]).names
    except (pa.ArrowException, OSError):
        available = []
    dataset.notes.extend(unread_column_notes(available, dataset.column_map, dataset.columns, preset))
    return dataset


def _file_columns(path: str) -> list[str]:
    try:
        return list(pq.read_schema(path).names)
    except (pa.ArrowException, OSError):
        return []


def _preset_names(preset: Preset) -> set[str]:
    return {name for canonical, names in preset.columns.items() for name in names if name != canonical}


def _missing_hint(available: Sequence[str], preset: Preset | None) -> str | None:
    """Which ``--preset`` the file's column names match (by how many of its framework names the file has)."""
    if preset is not None:
        names = " or ".join(preset.columns.get("new_logp", ("new_logp",)))
        return f"--preset {preset.name} reads the new log-prob from {names} (or use --map new_logp=COLUMN)"
    present = set(available)
    scores = {p.name: len(_preset_names(p) & present) for p in PRESETS.values()}
    best = max(scores.values(), default=0)
    if best == 0:
        return "name it new_logp or use --map new_logp=COLUMN"
    matches = [name for name, score in scores.items() if score == best]
    return (f"the column names match --preset {' or --preset '.join(matches)} (which reads new_logp from "
            f"{' or '.join(PRESETS[matches[0]].columns['new_logp'])}); or use --map new_logp=COLUMN")


def unread_column_notes(available: Sequence[str], column_map: Mapping[str, str], read: Iterable[str],
                        preset: Preset | None = None) -> list[str]:
    """Warnings for file columns that look like a schema column the run does not read.

    A column is flagged if a preset would read it as a schema column that is absent (``rollout_log_probs`` →
    ``old_logp`` under ``--preset verl``) or if its name is close to an absent schema column's (``old_logprobs``);
    each note names the ``--map`` (and presets) that would use it. A misspelt optional column would otherwise
    leave its figures "not computed" without a word.
    """
    import difflib

    used = set(column_map.values()) | set(read)
    absent = [c for c in COLUMNS if c not in set(read)]
    notes = []
    for name in available:
        if name in used or name in COLUMNS:
            continue
        targets: dict[str, list[str]] = {}
        for candidate in PRESETS.values():
            if preset is not None and candidate.name == preset.name:
                continue
            for canonical, names in candidate.columns.items():
                if name in names and canonical in absent:
                    targets.setdefault(canonical, []).append(candidate.name)
        if not targets:
            close = difflib.get_close_matches(name, absent, n=1, cutoff=0.75)
            if close:
                targets[close[0]] = []
        for canonical, presets in targets.items():
            via = f"--map {canonical}={name}"
            if presets:
                via = f"--preset {' or --preset '.join(presets)} (or {via})"
            notes.append(f"column '{name}' looks like {canonical} but is not read; {via} would use it")
    return notes



def describe(preset: str | None = None) -> dict[str, Any]:
    """Schema v1 (columns, kinds, meanings) and, with ``preset``, that preset's map: ``grpo-cli schema``."""
    from grpo_cli.io.schema import SCHEMA_VERSION

    doc: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "columns": [
            {"name": spec.name, "kind": spec.kind.value, "required": spec.name == "new_logp", "meaning": spec.meaning}
            for spec in COLUMNS.values()
        ],
    }
    if preset is not None:
        doc["preset"] = _by_name(preset).to_json()
    return doc


def format_description(doc: Mapping[str, Any]) -> str:
    """Plain-text rendering of :func:`describe` (fixed-width, no colours)."""
    lines = [f"rollout schema v{doc['schema_version']} (docs/schema.md)", ""]
    rows = [(c["name"] + (" *" if c["required"] else ""), c["kind"], c["meaning"]) for c in doc["columns"]]
    width = [max(len(r[i]) for r in rows) for i in range(2)]
    lines.append(f"{'column':<{width[0]}}  {'kind':<{width[1]}}  meaning")
    lines += [f"{a:<{width[0]}}  {b:<{width[1]}}  {c}" for a, b, c in rows]
    lines.append("* required. Layouts: sequence-per-row (list columns) or token-per-row (with seq_id).")
    preset = doc.get("preset")
    if preset:
        lines += ["", f"preset '{preset['name']}' ({preset['framework']}): source = {preset['source']}"]
        alignment = {
            "token": "token-aligned (no shift)",
            "next_token": "next-token aligned: un-rolled by one within each sequence",
            "next_token_short": "next-token aligned, one slot short: a masked first slot is prepended",
        }[preset["alignment"]]
        if preset["token_aligned"]:
            alignment += f" (except {', '.join(preset['token_aligned'])}, token-aligned)"
        lines += [f"alignment: {alignment}; window: {preset['window']}", ""]
        lines.append(f"{'schema column':<16}  ← framework column (first present wins)")
        for name in COLUMNS:
            candidates = preset["columns"].get(name)
            lines.append(f"{name:<16}  ← {' | '.join(candidates) if candidates else '-  (not available)'}")
        lines += ["", "notes:"] + [f"- {note}" for note in preset["notes"]]
    return "\n".join(lines) + "\n"
