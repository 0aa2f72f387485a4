"""What the commands share: choice types, option declarations, and the steps around every command (progress,
``--workers``, ``--device``, the input, the output format). Nothing here imports torch: ``--help`` stays fast."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from grpo_cli._choices import (
    DEFAULT_BATCH_TOKENS,
    DEVICES,
    FRAMEWORKS,
    ON_INVALID,
    PRESET_NAMES,
    TRL_VLLM_IS_MODES,
    VERL_ROLLOUT_IS_LEVELS,
)
from grpo_cli._launch import distributed_env, is_secondary_rank
from grpo_cli.errors import UsageError

if TYPE_CHECKING:
    from rich.console import Console

    from grpo_cli.io.reader import RolloutDataset
    from grpo_cli.io.storage import Location

__all__ = [
    "DEFAULT_BATCH_TOKENS",
    "OUTPUT_FORMATS",
    "CurrentVersionOpt",
    "IsThresholdOpt",
    "KlClampOpt",
    "MaxStalenessOpt",
    "ProxApproximationOpt",
    "RolloutIsOpt",
    "RolloutIsThresholdOpt",
    "RolloutRsOpt",
    "RolloutRsThresholdOpt",
    "VllmIsClipMaxOpt",
    "VllmIsClipMinOpt",
    "VllmIsModeOpt",
    "check_device",
    "config_from",
    "emit",
    "given",
    "metadata_defaults",
    "with_options",
    "one_of",
    "open_input",
    "progress_bar",
    "streaming",
    "resolve_workers",
    "write_result",
    "warn_skipped",
]


def one_of(*values: str) -> dict[str, Any]:
    """A choice option's ``parser`` and ``metavar`` (``typer.Option(..., **one_of(*VALUES))``), from the library's own
    tuple (``grpo_cli._choices``): values stay plain strings, and a wrong one is refused naming the choices."""

    def parse(value: str) -> str:
        if value not in values:
            raise typer.BadParameter(f"{value!r} is not one of {', '.join(values)}")
        return value

    return {"parser": parse, "metavar": "|".join(values)}


OUTPUT_FORMATS = ("table", "json", "csv")

PathsArg = Annotated[
    list[str], typer.Argument(metavar="PATHS", help="Parquet files, directories (recursive) or quoted globs.")
]
EpsilonOpt = Annotated[float, typer.Option("--epsilon", "--clip-range", help="Lower clip width ε.")]
EpsilonHighOpt = Annotated[
    float | None, typer.Option("--epsilon-high", "--clip-range-high", help="Upper clip width (default ε).")
]
TemperatureOpt = Annotated[
    float,
    typer.Option("--temperature", help="Sampling temperature; log-probs are rescaled by it (as twinkle's GRPOMetric "
                 "does)."),
]
BatchTokensOpt = Annotated[
    int,
    typer.Option("--batch-tokens", help="Token budget per streamed batch: bounds memory (docs/performance.md; "
                 "use millions with --device cuda)."),
]
DeviceOpt = Annotated[str, typer.Option("--device", **one_of(*DEVICES), help="Where the core runs.")]
FormatOpt = Annotated[
    str, typer.Option("--format", "-f", **one_of(*OUTPUT_FORMATS), help="Output format.")
]
OutputOpt = Annotated[Path | None, typer.Option("--output", "-o", help="Write the report here instead of stdout.")]
MapOpt = Annotated[
    list[str] | None, typer.Option("--map", help="Rename a column: canonical=actual (repeatable).")
]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")]
ExecutorOpt = Annotated[
    str,
    typer.Option("--executor", **one_of("local", "ray"),
                 help="Where the (file, row-group) units run: local processes (--workers), or the tasks of the Ray "
                 "cluster RAY_ADDRESS names, else of a local one (pip install 'grpo-cli[ray]'). The same figures, "
                 "bit for bit (docs/performance.md)."),
]
WorkersOpt = Annotated[
    int | None,
    typer.Option("--workers", help="CPU cores to use: processes read (file, row-group) units in parallel and the "
                 "cores left to each compute its metrics in threads (default: the available cores; 1 per torchrun "
                 "rank or with --device cuda). No figure depends on it (docs/performance.md)."),
]


NamesOpt = Annotated[
    str,
    typer.Option("--names", **one_of("grpo-cli", *FRAMEWORKS),
        help="Report every figure that has an equivalent under the key that framework logs, "
                 "in its sign convention (docs/metrics.md, 'Names per framework')."),
]


PresetOpt = Annotated[
    str | None,
    typer.Option(
        "--preset",
        **one_of(*PRESET_NAMES),
        help="Read a dump written with a framework's own tensor names and conventions (renames, un-rolls "
        "next-token-aligned columns); `grpo-cli schema --preset NAME` shows the map. --map wins over it.",
    ),
]
OnInvalidOpt = Annotated[
    str,
    typer.Option(
        "--on-invalid",
        **one_of(*ON_INVALID),
        help="Invalid values (NaN/positive log-probs, masks not 0/1, versions above current_version, ...): "
        "error (exit 2 naming file, column, row) or skip (drop those sequences, count them under invalid/*).",
    ),
]
CClipOpt = Annotated[float | None, typer.Option("--c-clip", help="Dual-clip constant (> 1); default off.")]
ImportanceLevelOpt = Annotated[
    str, typer.Option("--importance-level", help="PPO ratio per token or per sequence (GSPO): token|sequence.")
]
RsLevelOpt = Annotated[str | None, typer.Option("--rs-level", help="Rejection sampling granularity: token|sequence.")]
RsActionOpt = Annotated[str | None, typer.Option("--rs-action", help="Rejection sampling action: mask|clamp.")]
RsMetricOpt = Annotated[
    str | None, typer.Option("--rs-metric", help="Rejection sampling metric: ratio|kl_k1|kl_k2|kl_k3.")
]
RsAggOpt = Annotated[str | None, typer.Option("--rs-agg", help="Rejection sampling aggregation: sum|mean|max.")]
RsUpperOpt = Annotated[float | None, typer.Option("--rs-upper", help="Rejection sampling upper bound (AReaL: 5).")]
RsLowerOpt = Annotated[float | None, typer.Option("--rs-lower", help="Rejection sampling lower bound.")]




IsThresholdOpt = Annotated[
    float, typer.Option("--is-threshold", help="IS weight bound C: is/frac_high (w > C), is/frac_low (w < 1/C).")
]
# verl's RolloutCorrectionConfig and TRL's GRPOConfig settings of the figures they log (read under their --names).
RolloutIsOpt = Annotated[
    str,
    typer.Option("--rollout-is", **one_of(*VERL_ROLLOUT_IS_LEVELS),
                 help="--names verl: verl's rollout_is level of rollout_corr/rollout_is_* (verl's own default is "
                 "off; token here)."),
]
RolloutIsThresholdOpt = Annotated[
    str | None,
    typer.Option("--rollout-is-threshold", help="--names verl: verl's rollout_is_threshold, U (truncate at U) or "
                 "L_U (IcePop: weights outside [L, U] become 0); default --is-threshold."),
]
RolloutRsOpt = Annotated[
    str | None,
    typer.Option("--rollout-rs", help="--names verl: verl's rollout_rs rejection-sampling options, comma-separated "
                 "(token_k1, seq_mean_k3, ...); gives rollout_corr/rollout_rs_*."),
]
RolloutRsThresholdOpt = Annotated[
    str | None,
    typer.Option("--rollout-rs-threshold", help="--names verl: verl's rollout_rs_threshold, one per option or one "
                 "for all (k1: L_U or U; k2/k3: an upper bound)."),
]
VllmIsModeOpt = Annotated[
    str,
    typer.Option("--vllm-is-mode", **one_of(*TRL_VLLM_IS_MODES),
                 help="--names trl: TRL's vllm_importance_sampling_mode of sampling/importance_sampling_ratio/*."),
]
VllmIsClipMaxOpt = Annotated[
    float, typer.Option("--vllm-is-clip-max", help="--names trl: TRL's vllm_importance_sampling_clip_max (C_max).")
]
VllmIsClipMinOpt = Annotated[
    float | None,
    typer.Option("--vllm-is-clip-min", help="--names trl: TRL's vllm_importance_sampling_clip_min (C_min; default "
                 "none)."),
]
KlClampOpt = Annotated[
    float | None,
    typer.Option("--kl-clamp", help="Clamp the per-token kl_ref/* estimates (the KL loss) to [-C, C] (default: "
                 "none); kl/* are never clamped."),
]
CurrentVersionOpt = Annotated[
    int | None,
    typer.Option("--current-version", help="Trainer version v_θ when the dump has no current_version column."),
]
MaxStalenessOpt = Annotated[
    int,
    typer.Option("--max-staleness", help="Findings: the largest lag the run's correction is meant for (TRL "
                 "max_staleness, AReaL max_head_offpolicyness); more is flagged as staleness."),
]
ProxApproximationOpt = Annotated[
    str | None,
    typer.Option("--prox-approximation", **one_of("loglinear", "linear"),
                 help="Findings: the run approximates the proximal policy (AReaL prox_logp_method) this way."),
]


LOCAL_PROGRESS_TOKENS = 2_000_000
"""Tokens from which a local read shows a progress bar (smaller dumps take about a second)."""
REMOTE_PROGRESS_TOKENS = 100_000
"""The same for object storage: a few row groups already take seconds of round trips."""


@contextlib.contextmanager
def progress_bar(total: int, quiet: bool, threshold: int = LOCAL_PROGRESS_TOKENS
                 ) -> Iterator[Callable[[int], None] | None]:
    """A token progress bar on stderr, only on a terminal and for inputs of at least ``threshold`` tokens."""
    if quiet or total < threshold or not sys.stderr.isatty():
        yield None
        return
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from grpo_cli.render.console import make_console

    with Progress(
        TextColumn("reading"),
        BarColumn(),
        TextColumn("{task.completed:,.0f}/{task.total:,.0f} tokens"),
        TimeRemainingColumn(),
        console=make_console(stderr=True),
        transient=True,
    ) as bar:
        task = bar.add_task("tokens", total=total)
        yield lambda n: bar.advance(task, n)


@contextlib.contextmanager
def streaming(dataset: RolloutDataset, quiet: bool, executor: str = "local") -> Iterator[Callable[[int], None] | None]:
    """The progress callback of one streaming pass over ``dataset`` (:func:`progress_bar`; also for smaller dumps
    when they are read from object storage, where each row group is a round trip), on ``executor``."""
    from grpo_cli.io.storage import RemotePath

    remote = any(isinstance(path, RemotePath) for path in dataset.files)
    with contextlib.ExitStack() as stack:
        if executor != "local":
            from grpo_cli.engine.parallel import use_executor

            stack.enter_context(use_executor(executor))
        yield stack.enter_context(progress_bar(dataset.n_tokens, quiet, threshold=REMOTE_PROGRESS_TOKENS if remote
                                               else LOCAL_PROGRESS_TOKENS))


def resolve_workers(workers: int | None, device: str) -> int:
    """``--workers``: the available cores by default; one per torchrun rank (each rank is a process) and with
    ``--device cuda`` (one process drives the GPU while a thread decodes ahead)."""
    if workers is None:
        if distributed_env() is not None or device == "cuda":
            return 1
        from grpo_cli.engine.parallel import available_cores

        return available_cores()
    if workers < 1:
        raise UsageError(f"--workers must be >= 1, got {workers}")
    return workers


def check_device(device: str) -> str:
    """``--device``'s value, refused (exit 2) when CUDA is asked for and absent."""
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--device cuda: no CUDA device is available (torch.cuda.is_available() is False)")
    return device


def warn_skipped(metrics: Mapping[str, Any]) -> None:
    """One warning line on stderr when ``--on-invalid skip`` dropped sequences (every command calls this)."""
    from grpo_cli.engine.validate import skipped_warning

    warning = skipped_warning(metrics)
    if warning is not None:
        typer.echo(f"grpo-cli: warning: {warning}", err=True)


def emit(text: str, output: Path | None) -> None:
    if output is None:
        sys.stdout.write(text)
        return
    try:
        output.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"--output {output}: cannot write ({exc.strerror or exc})") from None


def open_input(
    paths: Sequence[str], column_map: Sequence[str] | None, preset: str | None, on_invalid: str | None = "error"
) -> RolloutDataset:
    """The dataset the command reads: ``paths`` with ``--map`` renames over the ``--preset``'s column map.

    With ``on_invalid="skip"`` a file that is not readable Parquet (truncated, corrupt) is left out with one warning
    line that counts them, as invalid rows are; otherwise it is an input error naming the file (exit 2).
    """
    from grpo_cli.io.presets import open_dataset
    from grpo_cli.io.schema import parse_column_map

    skipped_note = None
    if on_invalid == "skip":
        from grpo_cli.engine.validate import readable_files, unreadable_warning

        files, skipped = readable_files(paths)
        skipped_note = unreadable_warning(skipped, len(files) + len(skipped))
        if skipped:
            paths = [str(path) for path in files]
    dataset = open_dataset(paths, parse_column_map(column_map), preset)
    if skipped_note is not None:
        dataset.notes.insert(0, skipped_note)
    if not is_secondary_rank():
        for note in dataset.notes:
            typer.echo(f"grpo-cli: warning: {note}", err=True)
    return dataset


def config_from(config_type: type, values: Mapping[str, Any], **overrides: Any) -> Any:
    """``config_type`` (a dataclass) built from the command's parameters ``values`` whose names are its fields, then
    ``overrides``: one place that hands options to the library."""
    fields = {f.name for f in dataclasses.fields(config_type)}
    chosen = {name: value for name, value in values.items() if name in fields}
    chosen.update(overrides)
    return config_type(**chosen)


def given(ctx: typer.Context, name: str) -> bool:
    """Whether the parameter ``name`` came from the command line or the environment, not from its default."""
    source = ctx.get_parameter_source(name)
    return source is not None and getattr(source, "name", "") not in ("DEFAULT", "DEFAULT_MAP")


def metadata_defaults(
    ctx: typer.Context,
    files: Sequence[Location],
    config: Any,
    *,
    fixed: Collection[str] = (),
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The options a dump records (``RolloutWriter(metadata=…)``: temperature, clip widths) that become this
    command's defaults, and what to report as ``config.from_metadata``.

    An option given on the command line wins, and so do those in ``fixed`` (set by a rules file); options that
    ``config`` (the command's config dataclass, or an instance) lacks are neither read nor checked. Every command
    takes its dump's defaults here, so they mean the same everywhere (docs/schema.md, "Options recorded in a
    dump").

    Returns:
        ``(options, used)``: ``{field: value}`` to apply to the config (:func:`with_options`), and those plus the
        informational ``framework`` as reported in the output's config (empty when the dump records none).

    Raises:
        InputError: the files record different values for an option, or a value that is not a finite number
            ``>= 0`` (exit 2, naming both files and the metadata key).
    """
    from grpo_cli.io.metadata import METADATA_OPTIONS, dump_defaults

    fields = {f.name for f in dataclasses.fields(config)}
    skipped = {name for name in METADATA_OPTIONS if name not in fields or name in fixed or given(ctx, name)}
    used = dump_defaults(files, skipped)
    return {name: value for name, value in used.items() if name in METADATA_OPTIONS}, used


def with_options(config: Any, options: Mapping[str, Any]) -> Any:
    """``config`` (a dataclass) with ``options`` replacing its fields of those names, validated again."""
    fields = {f.name for f in dataclasses.fields(config)}
    chosen = {name: value for name, value in options.items() if name in fields}
    if not chosen:
        return config
    config = dataclasses.replace(config, **chosen)
    config.validate()
    return config


def write_result(
    output_format: str,
    output: Path | None,
    *,
    document: Callable[[], dict[str, Any]],
    csv: Callable[[], str],
    table: Callable[[Console], None],
) -> None:
    """Render one result in the chosen format to stdout or ``--output`` (every command's last step)."""
    from grpo_cli.render.console import make_console
    from grpo_cli.render.documents import dumps_json

    if is_secondary_rank():
        return  # under torchrun only rank 0 writes the report

    if output_format == "json":
        emit(dumps_json(document()), output)
    elif output_format == "csv":
        emit(csv(), output)
    elif output is None:
        table(make_console())
    else:
        import io

        buffer = io.StringIO()
        table(make_console(file=buffer))
        emit(buffer.getvalue(), output)
