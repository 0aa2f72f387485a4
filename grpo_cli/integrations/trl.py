"""TRL ``GRPOTrainer`` → schema-v1 dumps: the hooks behind ``docs/recipes/trl.md``.

:class:`GRPODumpMixin` goes in front of ``trl.GRPOTrainer`` in a subclass (the recipe's ``DumpingGRPOTrainer``) and
writes one row per completion and training forward with :class:`~grpo_cli.io.RolloutWriter`. The hooks follow
``trl/trainer/grpo_trainer.py`` of TRL 1.16 (:data:`SUPPORTED_TRL`):

* ``GRPOTrainer._generate_and_score_completions`` returns the per-process generation batch. The mixin adds
  per-row tensors there (``grpo_seq_id``, ``grpo_group_id``, ``grpo_rewards``, ``grpo_eos``), which
  ``_prepare_inputs`` shuffles and splits over ``steps_per_generation`` together with TRL's own tensors.
* ``GRPOTrainer._calculate_rewards`` returns the rewards of every reward function for the whole generation batch
  (all processes); the mixin keeps their weighted sum, as ``_generate_and_score_completions`` logs it (``reward``).
* ``GRPOTrainer._compute_loss`` calls ``_get_per_token_logps_and_entropies`` once for the policy forward; that
  call returns ``(logps, entropies, aux_loss)`` in 1.16 (older releases returned two values or a dict). The mixin
  keeps the log-probs and entropies of exactly that call (not of the no-grad recomputes of the "old" and reference
  log-probs made during generation) and writes the micro-batch after the loss.

Steps: TRL logs the metrics of an optimizer step after ``state.global_step`` has been incremented, so a training
forward is written under ``global_step + 1``, the step its metrics are logged under. Evaluation
(``prediction_step`` runs ``_compute_loss`` under ``torch.no_grad``) is written only when ``eval_dump_dir`` is
given, to that directory, under the step at which the evaluation runs (that of its ``eval_*`` log entry).

Ids: ``seq_id`` numbers the completions of the run (in TRL's global order, all processes), so it is unique across
the run and ranks; ``group_id = seq_id // num_generations`` (a group's completions are consecutive in the global
order, ``RepeatSampler``); ``micro_batch`` numbers the loss forwards of the run (one per ``_compute_loss`` call,
the same number on every process). Every forward is written: with ``num_iterations > 1`` a completion is trained
on, and written, once per iteration (its ``seq_id`` repeats, under the step and micro-batch of that forward).

Findings while training: :class:`FindingsCallback` (a ``TrainerCallback``) holds a
:class:`~grpo_cli.commands.diagnoser.Diagnoser`; the mixin feeds it every training forward's tensors (the columns
it dumps, plus each completion's weights version, ``state.global_step`` when it was generated, against the
forward's) and adds its counts to the trainer's logs. A callback alone never sees the batch, hence the mixin
(``dump_dir=None`` when only the findings are wanted).

Importing this module imports ``trl``; importing :mod:`grpo_cli` does not.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import trl
from torch import Tensor
from transformers import TrainerCallback

from grpo_cli.commands.diagnoser import CONCLUSIVE, Diagnoser
from grpo_cli.io import RolloutWriter

__all__ = [
    "SUPPORTED_TRL",
    "FindingsCallback",
    "GRPODumpMixin",
    "completion_eos",
    "format_finding",
    "sequence_rewards",
    "trl_version_supported",
]

SUPPORTED_TRL: tuple[str, ...] = ("1.16",)
"""TRL releases (``major.minor``) whose ``GRPOTrainer`` internals these hooks follow and are tested with."""

_HOOK = "grpo_cli.integrations.trl.GRPODumpMixin"


def trl_version_supported(version: str | None = None) -> bool:
    """Whether ``version`` (default: the installed ``trl.__version__``) is one of :data:`SUPPORTED_TRL`.

    Example:
        >>> trl_version_supported("1.16.0"), trl_version_supported("0.19.1")
        (True, False)
    """
    version = trl.__version__ if version is None else version
    return ".".join(version.split(".")[:2]) in SUPPORTED_TRL


def completion_eos(
    completion_ids: Tensor, completion_mask: Tensor, eos_token_ids: Sequence[int], pad_token_id: int | None
) -> Tensor:
    """``[B]`` int64: 1 where a completion ended with EOS, 0 where it was cut off, as TRL decides it.

    TRL (``_generate_and_score_completions``, ``completions/clipped_ratio`` and ``mask_truncated_completions``)
    calls a completion truncated when its last token is neither an EOS token nor the pad token, so an EOS at the
    last allowed position (length ``max_completion_length``) is not a cut-off. Rows whose ``completion_mask`` is
    all zero were truncated and masked by ``mask_truncated_completions`` (a generated completion has at least one
    token): they are cut off.

    Args:
        completion_ids: ``[B, C]`` right-padded completion token ids.
        completion_mask: ``[B, C]``, 1 on the tokens of each completion (up to and including its EOS).
        eos_token_ids: the trainer's ``eos_token_ids``.
        pad_token_id: the tokenizer's pad token id (or ``None``).

    Example:
        >>> ids = torch.tensor([[5, 2, 0], [5, 6, 7], [5, 6, 2]])  # EOS = 2, pad = 0, max length 3
        >>> completion_eos(ids, torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 1]]), [2], 0).tolist()
        [1, 0, 1]
    """
    lengths = completion_mask.sum(dim=1).to(torch.int64)
    last = (lengths - 1).clamp(min=0).unsqueeze(1)
    last_token = completion_ids.gather(1, last.to(completion_ids.device)).squeeze(1)
    ends = [int(t) for t in eos_token_ids] + ([] if pad_token_id is None else [int(pad_token_id)])
    is_end = torch.isin(last_token, torch.tensor(ends, dtype=last_token.dtype, device=last_token.device))
    return (is_end & (lengths > 0).to(is_end.device)).to(torch.int64)


def sequence_rewards(rewards_per_func: Tensor, reward_weights: Tensor) -> Tensor:
    """``[B]`` weighted reward per completion, as TRL logs it (``reward``): NaN-skipping sum, NaN when unscorable.

    Args:
        rewards_per_func: ``[B, F]`` rewards of the ``F`` reward functions (NaN where a function returned None).
        reward_weights: ``[F]`` the trainer's ``reward_weights``.

    Example:
        >>> sequence_rewards(torch.tensor([[1.0, 0.5], [float("nan"), 0.5]]), torch.tensor([1.0, 2.0])).tolist()
        [2.0, 1.0]
    """
    weights = reward_weights.to(rewards_per_func.device, rewards_per_func.dtype)
    rewards = (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)
    return rewards.masked_fill(torch.isnan(rewards_per_func).all(dim=1), float("nan"))


def _split_result(result: Any) -> tuple[Tensor, Tensor | None]:
    """``_get_per_token_logps_and_entropies``'s result → ``(logps, entropies)`` (1.16: a 3-tuple with aux_loss)."""
    if isinstance(result, dict):
        return result["logps"], result.get("entropies")
    if isinstance(result, (tuple, list)):
        return result[0], result[1] if len(result) > 1 else None
    return result, None


def _inside(path: Path, other: Path) -> bool:
    return path == other or other in path.parents


class GRPODumpMixin:
    """Writes every training forward of a ``trl.GRPOTrainer`` as schema-v1 rows (put it before ``GRPOTrainer``).

    Columns: ``new_logp`` and ``entropy`` of the policy forward (logits divided by the sampling temperature by
    TRL's fused LM head), ``prox_logp`` = TRL's ``old_per_token_logps`` (its recompute; absent when TRL skips it),
    ``old_logp`` = ``sampling_per_token_logps`` (vLLM's, when present), ``ref_logp`` (``beta != 0``),
    ``loss_mask`` = ``completion_mask`` × ``tool_mask``, ``advantages``, ``rewards``, ``eos``, ``step``, ``seq_id``,
    ``group_id`` and ``micro_batch``; metadata records TRL's version, sampling and loss settings and the split.

    Args:
        *args: passed to ``GRPOTrainer``.
        dump_dir: directory of the training dump (created if missing; one part file per step and rank), or
            ``None`` to write no dump (with a :class:`FindingsCallback`: findings only).
        eval_dump_dir: directory for evaluation rows, or ``None`` (default) to write nothing from evaluation.
            It must lie outside ``dump_dir`` (``grpo-cli analyze DIR`` reads sub-directories too).
        **kwargs: passed to ``GRPOTrainer``.

    Raises:
        ValueError: ``eval_dump_dir`` overlaps ``dump_dir``.
    """

    def __init__(
        self,
        *args: Any,
        dump_dir: str | os.PathLike[str] | None = "grpo_dumps",
        eval_dump_dir: str | os.PathLike[str] | None = None,
        **kwargs: Any,
    ) -> None:
        dirs = {} if dump_dir is None else {"train": Path(dump_dir)}
        if eval_dump_dir is not None:
            dirs["eval"] = Path(eval_dump_dir)
        if len(dirs) == 2:
            train, evaluation = (p.resolve() for p in (dirs["train"], dirs["eval"]))
            if _inside(train, evaluation) or _inside(evaluation, train):
                raise ValueError(
                    f"eval_dump_dir ({eval_dump_dir}) and dump_dir ({dump_dir}) must not contain each other: "
                    "`grpo-cli analyze` reads a directory recursively and would mix the two splits"
                )
        if not trl_version_supported():
            warnings.warn(
                f"grpo_cli.integrations.trl follows GRPOTrainer of TRL {', '.join(SUPPORTED_TRL)}; "
                f"trl {trl.__version__} is installed: check the dump against the trainer's logs",
                RuntimeWarning,
                stacklevel=2,
            )
        super().__init__(*args, **kwargs)
        self._grpo_dirs = dirs
        self._grpo_writers: dict[str, RolloutWriter] = {}
        self._grpo_rows = {"train": 0, "eval": 0}  # completions numbered so far (all processes)
        self._grpo_forwards = {"train": 0, "eval": 0}  # loss forwards numbered so far
        self._grpo_rewards: Tensor | None = None
        self._grpo_capture = False
        self._grpo_captured: tuple[Tensor, Tensor | None] | None = None

    # -- TRL hooks ----------------------------------------------------------------------------------------------
    def _calculate_rewards(self, *args: Any, **kwargs: Any) -> Tensor:
        rewards_per_func = super()._calculate_rewards(*args, **kwargs)  # type: ignore[misc]  # GRPOTrainer method (mixin)
        self._grpo_rewards = sequence_rewards(rewards_per_func, self.reward_weights)  # type: ignore[attr-defined]  # GRPOTrainer attribute
        return rewards_per_func

    def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
        self._grpo_rewards = None
        out = super()._generate_and_score_completions(inputs)  # type: ignore[misc]  # GRPOTrainer method (mixin)
        mode = self._grpo_mode()
        completion_ids = out["completion_ids"]
        device = completion_ids.device
        b = int(completion_ids.shape[0])
        rank, world = self.accelerator.process_index, self.accelerator.num_processes  # type: ignore[attr-defined]  # GRPOTrainer attribute
        first = self._grpo_rows[mode] + rank * b  # TRL's process slice of the gathered batch starts at rank * b
        seq_id = first + torch.arange(b, device=device, dtype=torch.int64)
        n_generations = self.num_generations if mode == "train" else self.num_generations_eval  # type: ignore[attr-defined]  # GRPOTrainer attribute
        out["grpo_seq_id"] = seq_id
        out["grpo_group_id"] = seq_id // n_generations
        # the weights that generated these completions: optimizer steps taken so far (FindingsCallback's versions)
        out["grpo_version"] = torch.full((b,), int(self.state.global_step), dtype=torch.int64, device=device)  # type: ignore[attr-defined]  # GRPOTrainer attribute
        self._grpo_rows[mode] += b * world
        if self._grpo_rewards is not None:
            out["grpo_rewards"] = self._grpo_rewards[rank * b:(rank + 1) * b].to(device)
        tokenizer = self._tokenizer  # type: ignore[attr-defined]  # GRPOTrainer attribute
        out["grpo_eos"] = completion_eos(
            completion_ids, out["completion_mask"], self.eos_token_ids, tokenizer.pad_token_id  # type: ignore[attr-defined]  # GRPOTrainer attribute
        )
        return out

    def _get_per_token_logps_and_entropies(self, *args: Any, **kwargs: Any) -> Any:
        result = super()._get_per_token_logps_and_entropies(*args, **kwargs)  # type: ignore[misc]  # GRPOTrainer method (mixin)
        if self._grpo_capture:  # the first call inside _compute_loss is the policy forward
            self._grpo_capture = False
            logps, entropies = _split_result(result)
            self._grpo_captured = (logps.detach(), None if entropies is None else entropies.detach())
        return result

    def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> Tensor:
        self._grpo_capture, self._grpo_captured = True, None
        try:
            loss = super()._compute_loss(model, inputs)  # type: ignore[misc]  # GRPOTrainer method (mixin)
        finally:
            self._grpo_capture = False
        self._grpo_record(self._grpo_mode(), inputs)
        return loss

    def log(self, logs: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        if self._grpo_mode() == "train":  # the findings beside the losses, for every logger (TensorBoard, W&B, …)
            for callback in self._grpo_findings_callbacks():
                logs.update(callback.diagnoser.counts())
        super().log(logs, *args, **kwargs)  # type: ignore[misc]  # GRPOTrainer method (mixin)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().train(*args, **kwargs)  # type: ignore[misc]  # GRPOTrainer method (mixin)
        finally:
            self.flush_dumps()  # the last step's part file is complete when train returns (or raises)

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().evaluate(*args, **kwargs)  # type: ignore[misc]  # GRPOTrainer method (mixin)
        finally:
            writer = self._grpo_writers.get("eval")
            if writer is not None:
                writer.flush()  # each evaluation's part file is complete when evaluate returns

    # -- the dump -------------------------------------------------------------------------------------------------
    def flush_dumps(self) -> None:
        """Finish the open part files; the writers stay usable (``train`` calls this when it returns or raises).

        A later ``train``/``evaluate`` of the same trainer keeps writing to the same directories; a step written
        again gets a new part file (``-1``, ``-2``, … suffix) instead of replacing the earlier one.
        """
        for writer in self._grpo_writers.values():
            writer.flush()

    def close_dumps(self) -> None:
        """Finish the part files and close the writers (a later forward opens new writers)."""
        writers, self._grpo_writers = self._grpo_writers, {}
        for writer in writers.values():
            writer.close()

    def _grpo_mode(self) -> str:
        return "train" if self.model.training else "eval"  # type: ignore[attr-defined]  # as TRL decides it

    def _grpo_writer(self, mode: str) -> RolloutWriter | None:
        writer = self._grpo_writers.get(mode)
        if writer is None and mode in self._grpo_dirs:
            args = self.args  # type: ignore[attr-defined]  # GRPOTrainer attribute
            metadata = {
                "framework": "trl", "framework_version": trl.__version__, "hook": _HOOK, "split": mode,
                "temperature": self.temperature,  # type: ignore[attr-defined]  # GRPOTrainer attribute
                "top_p": args.top_p, "top_k": args.top_k,
                "logprobs_mode": "processed_logprobs" if self.use_vllm else "none",  # type: ignore[attr-defined]  # GRPOTrainer attribute
                "loss_type": args.loss_type, "epsilon_low": args.epsilon, "epsilon_high": args.epsilon_high,
                "beta": args.beta, "num_generations": self.num_generations,  # type: ignore[attr-defined]  # GRPOTrainer attribute
                "num_iterations": args.num_iterations, "importance_sampling_level": args.importance_sampling_level,
                "use_bias_correction_kl": args.use_bias_correction_kl, "delta": args.delta,
                "scale_rewards": args.scale_rewards, "logging_steps": args.logging_steps,
                "gradient_accumulation_steps": args.gradient_accumulation_steps,
                "steps_per_generation": args.steps_per_generation,
                # rows of one generation batch (all processes; in evaluation one eval batch per process):
                # seq_id // generation_batch_size numbers the generation batches
                "generation_batch_size": args.generation_batch_size if mode == "train"
                else args.per_device_eval_batch_size * self.accelerator.num_processes,  # type: ignore[attr-defined]  # GRPOTrainer attribute
            }
            rank = self.accelerator.process_index  # type: ignore[attr-defined]  # GRPOTrainer attribute
            writer = RolloutWriter(self._grpo_dirs[mode], rank=rank, metadata=metadata)
            self._grpo_writers[mode] = writer
        return writer

    def _grpo_findings_callbacks(self) -> list[FindingsCallback]:
        handler = getattr(self, "callback_handler", None)
        return [c for c in getattr(handler, "callbacks", ()) if isinstance(c, FindingsCallback)]

    def _grpo_record(self, mode: str, inputs: dict[str, Any]) -> None:
        micro_batch = self._grpo_forwards[mode]
        self._grpo_forwards[mode] += 1
        writer = self._grpo_writer(mode)
        callbacks = self._grpo_findings_callbacks() if mode == "train" else []
        if writer is None and not callbacks:
            return
        if self._grpo_captured is None:
            raise RuntimeError(
                "GRPOTrainer._compute_loss did not call _get_per_token_logps_and_entropies (a patched loss?): "
                "no per-token log-probs to dump"
            )
        new_logp, entropy = self._grpo_captured
        self._grpo_captured = None
        completion_mask = inputs["completion_mask"]
        mask = completion_mask if inputs.get("tool_mask") is None else completion_mask * inputs["tool_mask"]
        global_step = int(self.state.global_step)  # type: ignore[attr-defined]  # GRPOTrainer attribute
        columns: dict[str, Any] = dict(
            step=global_step + 1 if mode == "train" else global_step,  # the step TRL logs this forward under
            new_logp=new_logp, entropy=entropy,
            old_logp=inputs.get("sampling_per_token_logps"), prox_logp=inputs.get("old_per_token_logps"),
            ref_logp=inputs.get("ref_per_token_logps"), loss_mask=mask, advantages=inputs["advantages"],
            rewards=inputs.get("grpo_rewards"), eos=inputs["grpo_eos"],
            seq_id=inputs["grpo_seq_id"], group_id=inputs["grpo_group_id"],
            lengths=completion_mask.sum(dim=1),  # completion tokens up to and including EOS
        )
        if writer is not None:
            writer.add(**columns, micro_batch=micro_batch, window="response")
        if callbacks:
            version = inputs.get("grpo_version")
            if version is not None:  # every completion token was generated by the weights of its generation
                columns["versions"] = version[:, None].expand_as(new_logp)
                columns["current_version"] = global_step
            for callback in callbacks:
                callback.feed(columns)


def format_finding(finding: Mapping[str, Any]) -> str:
    """A finding as the lines :class:`FindingsCallback` prints: code, severity, category, step and title, then the
    evidence (each statistic with its 95 % interval and threshold), where, the fix and any notes.

    Example:
        >>> print(format_finding({"code": "GRP102", "severity": "error", "category": "temperature", "step": 3,
        ...     "title": "t", "evidence": {"diag/temperature_ratio": {"value": 0.7, "low": 0.66, "high": 0.74,
        ...     "threshold": 0.9}}, "where": {}, "fix": "f", "notes": []}))
        grpo-cli GRP102 error [temperature] at step 3: t
          diag/temperature_ratio = 0.7 (95 % 0.66 to 0.74; threshold 0.9)
          fix: f
    """
    lines = [f"grpo-cli {finding['code']} {finding['severity']} [{finding['category']}] at step "
             f"{finding.get('step')}: {finding['title']}"]
    for key, ev in (finding.get("evidence") or {}).items():
        value, low, high = (ev.get(k) for k in ("value", "low", "high"))
        parts = [] if low is None or low == high else [f"95 % {low:.4g} to {high:.4g}"]
        parts += [] if ev.get("threshold") is None else [f"threshold {ev['threshold']}"]
        lines.append(f"  {key} = {value:.4g}" + (f" ({'; '.join(parts)})" if parts else ""))
    where = {k: v for k, v in (finding.get("where") or {}).items() if v}
    if where:
        lines.append(f"  where: {', '.join(f'{k} {str(v)[:120]}' for k, v in where.items())}")
    lines.append(f"  fix: {finding.get('fix', '')}")
    lines.extend(f"  note: {note}" for note in finding.get("notes") or [])
    return "\n".join(lines)


class FindingsCallback(TrainerCallback):
    """``analyze``'s findings while a ``GRPOTrainer`` trains, at the step a fault appears.

    Register it with a trainer whose class includes :class:`GRPODumpMixin` (``callbacks=[FindingsCallback()]``;
    the mixin feeds it every training forward). At each optimizer step's end it calls
    :meth:`Diagnoser.step_end <grpo_cli.commands.diagnoser.Diagnoser.step_end>`, prints each finding once when it
    becomes conclusive (:func:`format_finding`, on the main process), and the trainer's logs carry
    :meth:`Diagnoser.counts <grpo_cli.commands.diagnoser.Diagnoser.counts>` (``findings/error``,
    ``findings/<category>``, ``findings/<code>``) beside the losses.

    Args:
        diagnoser: the :class:`~grpo_cli.commands.diagnoser.Diagnoser` to feed (default: one built from
            ``options``).
        stop_on: ``"error"`` (or ``"warning"``) stops training (``control.should_training_stop``) at the step a
            finding reaches that severity; ``None`` (default) never stops.
        verbose: print each finding when it becomes conclusive.
        **options: ``analyze``'s options for the default diagnoser (``epsilon``, ``max_staleness``, …).

    Attributes:
        stopped_by: the finding that stopped training, or ``None``.

    Raises:
        ValueError: ``stop_on`` is not ``None``, ``"warning"`` or ``"error"``.
    """

    def __init__(
        self, diagnoser: Diagnoser | None = None, *, stop_on: str | None = None, verbose: bool = True, **options: Any
    ) -> None:
        if stop_on is not None and stop_on not in CONCLUSIVE:
            raise ValueError(f"stop_on must be None, 'warning' or 'error', got {stop_on!r}")
        if diagnoser is not None and options:
            raise TypeError("pass a diagnoser or its options, not both")
        self.diagnoser = diagnoser if diagnoser is not None else Diagnoser(**options)
        self.stop_on = stop_on
        self.verbose = verbose
        self.stopped_by: dict[str, Any] | None = None
        self._fed = False

    def feed(self, columns: Mapping[str, Any]) -> None:
        """One training forward's columns (:meth:`Diagnoser.update`'s keywords); :class:`GRPODumpMixin` calls it."""
        self.diagnoser.update(**columns)
        self._fed = True

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if not self._fed:
            raise RuntimeError(
                "FindingsCallback saw no batch: the trainer's class must include "
                "grpo_cli.integrations.trl.GRPODumpMixin before GRPOTrainer (a callback alone never sees the batch)"
            )
        self._fed = False
        risen = self.diagnoser.step_end(int(state.global_step))
        main = getattr(state, "is_world_process_zero", True)
        for finding in risen:
            if self.verbose and main:
                print(format_finding(finding), flush=True)
        if self.stop_on is not None and self.stopped_by is None:
            floor = CONCLUSIVE.index(self.stop_on)
            worst = next((f for f in risen if CONCLUSIVE.index(f["severity"]) >= floor), None)
            if worst is not None:
                self.stopped_by = worst
                control.should_training_stop = True
                if main:
                    print(f"grpo-cli: stopping training at step {state.global_step} on {worst['code']} "
                          f"({worst['severity']}): {worst['title']}", file=sys.stderr, flush=True)
        return control
