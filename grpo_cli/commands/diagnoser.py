"""Findings while training: :class:`Diagnoser` runs ``analyze``'s detectors inside a training loop.

It is ``analyze`` fed from tensors instead of a dump: each :meth:`Diagnoser.update` builds the
:class:`~grpo_cli.core.batch.TokenBatch` the reader would have built from the same rows (the packing of
:meth:`grpo_cli.io.RolloutWriter.add`), validates it (:class:`~grpo_cli.engine.validate.BatchValidator`) and folds it
into the same metric groups' mergeable states (the figures the detectors read and the findings-only ``diag/*``
groups); :meth:`Diagnoser.step_end` merges the step into the run's states (all-reduced first under
``torch.distributed``, as :class:`~grpo_cli.core.metric.GRPOMetric` does), computes the figures as ``analyze``
does (:func:`grpo_cli.engine.run.compute_figures`) and applies :func:`grpo_cli.findings.detect`. A dump replayed
step by step therefore ends with the findings ``analyze`` gives for the whole dump.

A step plays the part of one part file of a dump (``RolloutWriter`` writes one per step): a finding's ``where``
names sequences as ``{"file": n, "row": r}`` with ``n`` the step's ordinal (0 for the first ``step_end``) and ``r``
the sequence's position among the step's ``update`` calls.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import fields
from typing import Any

import torch
from torch import Tensor

from grpo_cli.core.batch import TokenBatch
from grpo_cli.core.keyed_state import all_reduce_states
from grpo_cli.core.state import MetricState
from grpo_cli.engine.group import MetricGroup
from grpo_cli.engine.run import compute_figures
from grpo_cli.engine.validate import BatchValidator, ValidationGroup
from grpo_cli.findings import CODES, SEVERITIES, DetectConfig, Finding, detect, detector_inputs
from grpo_cli.io._writer_inputs import pack_inputs
from grpo_cli.metrics import AnalyzeConfig, default_groups, select_groups
from grpo_cli.metrics.diagnosis import diagnosis_groups

__all__ = ["CONCLUSIVE", "WINDOW", "Diagnoser", "diagnoser_groups"]

CONCLUSIVE = ("warning", "error")
"""The severities at which a finding is conclusive: :meth:`Diagnoser.step_end` reports a finding when it first
reaches one of them (and again when a warning becomes an error)."""

WINDOW = 16
"""Default :class:`Diagnoser` ``window``: steps whose per-sequence rows (duplicate hashes) stay in memory. A rank
that writes its shard twice does so within a step."""

_NOT_ONLINE = {"group_by", "max_groups", "batch_tokens", "device"}
"""``AnalyzeConfig`` fields that describe how a dump is streamed, not a figure: the batches are the caller's and
the states live on the device of the tensors."""

_PER_TOKEN = ("old_logp", "prox_logp", "ref_logp", "entropy", "versions")
_PER_SEQUENCE = ("rewards", "group_id", "current_version", "eos", "seq_id", "step")


def diagnoser_groups() -> list[MetricGroup]:
    """The metric groups whose states the detectors read: the figures of :func:`~grpo_cli.findings.detector_inputs`
    for every code (``analyze --select`` semantics, validation and counts included) and the findings-only groups they
    name. A run over these gives every code the findings a run over every group gives."""
    keys, names = detector_inputs(CODES)
    return [*select_groups(default_groups(), keys), *(g for g in diagnosis_groups() if g.name in names)]


class Diagnoser:
    """``analyze``'s findings, computed while training: fed per (micro-)batch, judged at every step's end.

    Args:
        process_group: ``torch.distributed`` group whose ranks' states are all-reduced at each :meth:`step_end`
            (default: the world when ``torch.distributed`` is initialised; every rank must call ``step_end``).
        each_step: also judge each step on its own data at its :meth:`step_end` (default ``True``): a fault that
            starts mid-run is diluted in the run's pooled statistics by the healthy steps before it, but is as clear
            within its first step as it would be in a dump of that step alone.
        window: steps whose per-sequence rows are kept (:meth:`MetricGroup.retire
            <grpo_cli.engine.group.MetricGroup.retire>`): a sequence written twice is found when its copies are
            fewer than ``window`` steps apart. Older rows leave memory; what they counted stays counted.
        **options: ``analyze``'s options by their names (:class:`~grpo_cli.metrics.AnalyzeConfig` fields such as
            ``epsilon``, ``epsilon_high``, ``current_version``, ``on_invalid``; and
            :class:`~grpo_cli.findings.DetectConfig`'s ``max_staleness`` and ``prox_approximation``).

    Raises:
        TypeError: an option ``analyze`` does not take, or one that describes streaming a dump (``group_by``,
            ``batch_tokens``, ``max_groups``, ``device``).
        grpo_cli.errors.UsageError: an option value ``analyze`` refuses.
        ValueError: ``window`` below 1.

    Example:
        >>> import torch
        >>> from grpo_cli import Diagnoser
        >>> diagnoser = Diagnoser(epsilon=0.2, max_staleness=4)
        >>> new = -torch.rand(8, 6)
        >>> diagnoser.update(new_logp=new, old_logp=new.clone(), loss_mask=torch.ones(8, 6),
        ...                  advantages=torch.randn(8), group_id=torch.arange(8) // 4)
        >>> diagnoser.step_end(1)
        []
        >>> [f["code"] for f in diagnoser.findings() if f["severity"] in ("warning", "error")]
        []
    """

    def __init__(
        self, *, process_group: Any = None, each_step: bool = True, window: int = WINDOW, **options: Any
    ) -> None:
        detect_names = {f.name for f in fields(DetectConfig)}
        analyze_names = {f.name for f in fields(AnalyzeConfig)} - _NOT_ONLINE
        unknown = sorted(set(options) - detect_names - analyze_names)
        if unknown:
            raise TypeError(f"Diagnoser: unknown option(s) {', '.join(unknown)} (analyze options: "
                            f"{', '.join(sorted(detect_names | analyze_names))})")
        self.config = AnalyzeConfig(**{k: v for k, v in options.items() if k in analyze_names})
        self.config.validate()
        self.detect_config = DetectConfig(**{k: v for k, v in options.items() if k in detect_names})
        self.process_group = process_group
        self.each_step = each_step
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        self.groups = diagnoser_groups()
        self._validator = BatchValidator(self.config.on_invalid, current_version=self.config.current_version)
        self._run: list[MetricState] | None = None  # every rank's, merged over the ended steps
        self._step: list[MetricState] | None = None  # this rank's, since the last step_end
        self._columns: set[str] = set()
        self._ordinal = 0  # the step's ordinal: its "file" in a dump
        self._row = 0  # sequences of this step so far: their "rows"
        self._next_step = 0
        self._latest: list[Finding] = []  # the run's, as analyze gives them
        self._now: list[Finding] = []  # conclusive at the last step_end, judged on the run or on the step alone
        self._first: dict[str, int] = {}  # code -> the step it first became conclusive at
        self._reported: dict[str, str] = {}  # code -> the severity it was last reported at

    # -- feeding -------------------------------------------------------------------------------------------------
    def update(
        self,
        *,
        new_logp: Tensor | Sequence[Tensor],
        loss_mask: Tensor | Sequence[Tensor] | None = None,
        old_logp: Tensor | None = None,
        prox_logp: Tensor | None = None,
        ref_logp: Tensor | None = None,
        entropy: Tensor | None = None,
        versions: Tensor | None = None,
        advantages: Tensor | None = None,
        rewards: Tensor | None = None,
        group_id: Tensor | None = None,
        current_version: Tensor | int | None = None,
        eos: Tensor | None = None,
        seq_id: Tensor | None = None,
        step: Tensor | int | None = None,
        cu_seqlens: Tensor | None = None,
        lengths: Tensor | None = None,
        attention_mask: Tensor | None = None,
        alignment: str = "token",
        column_alignment: Mapping[str, str] | None = None,
    ) -> None:
        """Fold one (micro-)batch of whole sequences into this step's states (nothing is kept but the states).

        The inputs are read as :meth:`RolloutWriter.add <grpo_cli.io.RolloutWriter.add>` reads them (the same
        code): per-token columns right-padded ``[B, T]`` (a row ends at ``lengths``, at the last non-zero of
        ``attention_mask``, else at its last ``loss_mask`` position), packed ``[N]`` with ``cu_seqlens``, or lists
        of 1-D tensors (one per sequence), all in the same form; value ``t`` belongs to token ``t`` unless
        ``alignment="next_token"``. Per-sequence columns are ``[B]`` (or a scalar for ``current_version`` and
        ``step``). Feed each sequence once per step (the first of several PPO epochs over it), as
        ``RolloutWriter(dedupe=True)`` writes it. Tensors stay on their device; the call syncs with the host where
        the statistics need it (the row lengths, validation, compaction to the loss-mask tokens).

        Args:
            new_logp: the trainer's log-probs of the tokens (required).
            loss_mask: 1 where a token enters the loss (default: every token).
            old_logp, prox_logp, ref_logp, entropy: behaviour, proximal and reference log-probs; entropy (nats).
            versions: the policy version that generated each token (−1 for prompt tokens).
            advantages: ``[B]`` per sequence, or per token like ``new_logp``.
            rewards, group_id, eos, seq_id: ``[B]`` per sequence (``eos``: 1 ended with EOS, 0 cut off).
            current_version: the trainer's version, ``[B]`` or one int.
            step: ``[B]`` or one int (default: the step after the last :meth:`step_end`'s, 0 at first).
            cu_seqlens: ``[B + 1]`` offsets for packed columns.
            lengths: ``[B]`` true lengths of padded rows.
            attention_mask: ``[B, T]``, non-zero where a padded row has a token (any padding side).
            alignment: ``"token"`` or ``"next_token"`` (value ``t`` belongs to token ``t + 1``: AReaL's loss inputs,
                OpenRLHF, twinkle), un-rolled as the writer does.
            column_alignment: per-column exceptions, e.g. ``{"versions": "token"}`` for AReaL.

        Raises:
            ValueError: shapes that disagree.
            grpo_cli.errors.InputError: a value ``analyze`` refuses (NaN or positive log-probs, a mask not 0/1,
                versions ahead of ``current_version``, …) under ``on_invalid="error"``.
        """
        batch = self._batch(locals())
        if batch.n_sequences == 0:
            return
        if self._step is None:
            self._step = [group.init_state(self.config, batch.device) for group in self.groups]
        skip = next((s for g, s in zip(self.groups, self._step) if isinstance(g, ValidationGroup)), None)
        batch = self._validator(batch, skip)
        valid = batch.valid()
        for group, state in zip(self.groups, self._step):
            group.update(state, batch, valid, self.config)
        self._columns |= batch.columns() | ({"loss_mask"} if loss_mask is not None else set())

    def _batch(self, given: Mapping[str, Any]) -> TokenBatch:
        """The :class:`TokenBatch` the reader would build from the rows ``RolloutWriter.add`` would write from these
        inputs (:func:`~grpo_cli.io._writer_inputs.pack_inputs`, the writer's own reading; floats as read, integers
        as int64, per-sequence advantages on every token)."""
        new_logp = given["new_logp"]
        first = new_logp[0] if isinstance(new_logp, (list, tuple)) and new_logp else new_logp
        device = first.device if isinstance(first, Tensor) else torch.device("cpu")
        inputs = {name: given[name] for name in ("new_logp", "loss_mask", *_PER_TOKEN, "advantages", *_PER_SEQUENCE)}
        inputs["step"] = None
        inputs = {k: (v.detach() if isinstance(v, Tensor) else v) for k, v in inputs.items() if v is not None}
        packed = pack_inputs(inputs, cu_seqlens=given["cu_seqlens"], lengths=given["lengths"],
                             attention_mask=given["attention_mask"], alignment=given["alignment"],
                             column_alignment=given["column_alignment"], window="full")
        layout = packed.layout
        cu_seqlens = layout.cu_seqlens.to(device)
        n_seq, n_tok = layout.n_sequences, layout.n_tokens
        columns: dict[str, Any] = {}
        for name, value in packed.token.items():
            value = value.to(device)
            columns[name] = value if name == "loss_mask" else (
                value.to(torch.int64) if name == "versions" else _float(value))
        if "loss_mask" not in columns:
            columns["loss_mask"] = torch.ones(n_tok, dtype=torch.bool, device=device)
        step = self._next_step if given["step"] is None else given["step"]
        sequence = {**packed.sequence, "step": layout.per_sequence(torch.as_tensor(step), "step")}
        for name, value in sequence.items():
            value = value.to(device)
            if name == "advantages":  # per sequence: every token of the row, as the reader broadcasts it
                value = torch.repeat_interleave(_float(value), cu_seqlens[1:] - cu_seqlens[:-1], output_size=n_tok)
            columns[name] = _float(value) if name in ("rewards", "advantages") else value.to(torch.int64)
        rows = torch.arange(self._row, self._row + n_seq, dtype=torch.int64, device=device)
        self._row += n_seq
        return TokenBatch(cu_seqlens=cu_seqlens, file_index=self._ordinal, rows=rows, **columns)

    # -- judging -------------------------------------------------------------------------------------------------
    def step_end(self, step: int) -> list[dict[str, Any]]:
        """Merge this step into the run and apply the detectors to the whole run so far (and, with ``each_step``, to
        this step alone: the same detectors on the step's states, as ``analyze`` would judge a dump of that step).

        Every rank of the process group must call it (the states are all-reduced); every rank gets the same result.

        Args:
            step: the training step that just ended (the ``step`` of its findings).

        Returns:
            The findings that became conclusive at this step in either judgement (reached ``warning`` or
            ``error`` for the first time, or went from ``warning`` to ``error``), most severe first:
            :meth:`findings`'s dicts.
        """
        states = self._step
        self._step = None
        self._ordinal += 1
        self._row = 0
        self._next_step = int(step) + 1
        group = self._group()
        if group is not None:
            states, columns = self._all_reduce(states, group)
        else:
            columns = self._columns
        alone: list[Finding] = []
        if states is not None:
            if self.each_step:
                alone = self._detect(columns, states)
            if self._run is None:
                self._run = states
            else:
                for mine, theirs in zip(self._run, states):
                    mine.merge_(theirs)
        if self._run is None:
            return []
        for g, state in zip(self.groups, self._run):
            g.retire(state, self._ordinal - self.window)  # self._ordinal: the next step's
        self._latest = self._detect(columns, self._run)
        order = {s: i for i, s in enumerate(SEVERITIES)}
        now: dict[str, Finding] = {}  # per code, the more severe of the two judgements
        for finding in (*self._latest, *alone):
            if finding.severity in CONCLUSIVE and (
                finding.code not in now or order[finding.severity] > order[now[finding.code].severity]
            ):
                now[finding.code] = finding
        self._now = sorted(now.values(), key=lambda f: (-order[f.severity], f.code))
        risen = []
        for finding in self._now:
            before = self._reported.get(finding.code)
            if before is None or order[finding.severity] > order[before]:
                self._reported[finding.code] = finding.severity
                self._first.setdefault(finding.code, int(step))
                risen.append(self._as_dict(finding))
        return risen

    def _detect(self, columns: set[str], states: list[MetricState]) -> list[Finding]:
        """``analyze``'s findings for data with ``columns`` whose merged states are ``states``."""
        metrics, _, evidence = compute_figures(frozenset(columns), self.config, self.groups, states)
        if not metrics.get("n_valid_tokens"):
            return []
        return detect({**metrics, **evidence}, None, self.detect_config)

    def findings(self) -> list[dict[str, Any]]:
        """The run's findings as of the last :meth:`step_end` (every severity, most severe first), judged on the
        whole run so far: what ``analyze`` gives for a dump of those steps. ``analyze``'s finding dicts (``code``,
        ``category``, ``severity``, ``title``, ``evidence``, ``where``, ``fix``, ``notes``) with ``step``, the step
        at which the code first became conclusive in either judgement (``None`` if it never did)."""
        return [self._as_dict(f) for f in self._latest]

    def counts(self) -> dict[str, int]:
        """Scalars for a trainer's logs: ``findings/error`` and ``findings/warning`` (findings conclusive at the last
        :meth:`step_end`, judged on the run or on that step alone), one
        ``findings/<category>`` count per category with a conclusive finding, and ``findings/<code>`` with the
        code's severity as a number (2 warning, 3 error), so a dashboard shows which codes fire and when."""
        loud = self._now
        out = {f"findings/{severity}": sum(f.severity == severity for f in loud) for severity in ("error", "warning")}
        for f in loud:
            out[f"findings/{f.category}"] = out.get(f"findings/{f.category}", 0) + 1
        out.update({f"findings/{f.code}": SEVERITIES.index(f.severity) for f in loud})
        return out

    def _as_dict(self, finding: Finding) -> dict[str, Any]:
        return {**finding.to_dict(), "step": self._first.get(finding.code)}

    def _group(self) -> Any:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return None
        return self.process_group if self.process_group is not None else dist.group.WORLD

    def _all_reduce(self, states: list[MetricState] | None, group: Any) -> tuple[list[MetricState] | None, set[str]]:
        """Every rank's step states merged (a rank without a batch contributes empty states) and the columns any
        rank saw (:func:`~grpo_cli.core.keyed_state.all_reduce_states`, the reduction ``GRPOMetric`` uses)."""
        import torch.distributed as dist

        everyone: list[Any] = [None] * dist.get_world_size(group)
        device = None if states is None else states[0].device
        dist.all_gather_object(everyone, (sorted(self._columns), None if device is None else str(device)), group=group)
        columns = {c for cols, _ in everyone for c in cols}
        devices = [d for _, d in everyone if d is not None]
        if not devices:
            return None, columns
        if states is None:  # empty states where this rank's would be: its own GPU, or the CPU
            kind = torch.device(devices[0]).type
            here = torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device(kind)
            states = [g.init_state(self.config, here) for g in self.groups]
        all_reduce_states(states, group)
        return states, columns


def _float(values: Tensor) -> Tensor:
    """Floats as the reader returns them: float32 and float64 kept, other floats (bf16, fp16) as float32, integers
    as float64."""
    if values.dtype in (torch.float32, torch.float64):
        return values
    return values.to(torch.float32 if values.is_floating_point() else torch.float64)

