"""The preset table: each framework's column names and conventions (:data:`PRESETS`), how a preset renames a
file's columns (:func:`resolve_column_map`), and ``grpo-cli schema``'s description of the schema and a preset.
Torch-free (``grpo-cli schema`` loads no torch); :mod:`grpo_cli.io.presets` explains what a preset does and opens
datasets with one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from grpo_cli.errors import UsageError
from grpo_cli.io.schema import COLUMNS

__all__ = ["PRESETS", "Preset", "describe", "format_description", "resolve_column_map"]


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
