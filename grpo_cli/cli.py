"""The ``grpo-cli`` command line: thin wrappers that parse options, call the library and hand results to ``render``.

Exit codes: 0 ok, 1 a check failed, 2 usage/input/internal error. Results go to stdout (or ``--output``); progress,
warnings and errors go to stderr.
"""

from __future__ import annotations

import contextlib
import enum
import sys
import traceback
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from grpo_cli import __version__
from grpo_cli.errors import EXIT_ERROR, GrpoCliError, UsageError

if TYPE_CHECKING:
    from rich.console import Console

    from grpo_cli.engine.run import AnalysisResult

app = typer.Typer(
    name="grpo-cli",
    help="Offline diagnostics for GRPO/PPO rollout dumps: off-policy-ness, train/inference mismatch, clipping, "
    "proximal approximation and regression gates.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

_state = {"debug": False}


class OutputFormat(str, enum.Enum):
    table = "table"
    json = "json"
    csv = "csv"


class InvalidPolicy(str, enum.Enum):
    """``--on-invalid`` (``grpo_cli.engine.config.OnInvalid``, repeated so that ``--help`` imports no torch)."""

    error = "error"
    skip = "skip"


class Device(str, enum.Enum):
    cpu = "cpu"
    cuda = "cuda"


def _version_callback(value: bool) -> None:
    if value:
        import pyarrow
        import torch

        typer.echo(f"grpo-cli {__version__} (torch {torch.__version__}, pyarrow {pyarrow.__version__})")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version_callback, is_eager=True, help="Print versions and exit."),
    ] = False,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks of internal errors.")] = False,
) -> None:
    _state["debug"] = _state["debug"] or debug


# -- shared option types ------------------------------------------------------------------------------------------
PathsArg = Annotated[list[str], typer.Argument(help="Parquet files, directories (recursive) or quoted globs.")]
EpsilonOpt = Annotated[float, typer.Option("--epsilon", "--clip-range", help="Lower clip width ε.")]
EpsilonHighOpt = Annotated[
    float | None, typer.Option("--epsilon-high", "--clip-range-high", help="Upper clip width (default ε).")
]
TemperatureOpt = Annotated[
    float, typer.Option("--temperature", help="Sampling temperature; log-probs are rescaled by it as the seed does.")
]
BatchTokensOpt = Annotated[
    int,
    typer.Option("--batch-tokens", help="Token budget per streamed batch: bounds memory (docs/performance.md; "
                 "use millions with --device cuda)."),
]
DeviceOpt = Annotated[Device, typer.Option("--device", help="Where the core runs.")]
FormatOpt = Annotated[OutputFormat, typer.Option("--format", "-f", help="Output format.")]
OutputOpt = Annotated[Path | None, typer.Option("--output", "-o", help="Write the report here instead of stdout.")]
MapOpt = Annotated[
    list[str] | None, typer.Option("--map", help="Rename a column: canonical=actual (repeatable).")
]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")]
WorkersOpt = Annotated[
    int | None,
    typer.Option("--workers", help="CPU cores to use: processes read (file, row-group) units in parallel and the "
                 "cores left to each compute its metrics in threads (default: the available cores; 1 per torchrun "
                 "rank or with --device cuda). No figure depends on it (docs/performance.md)."),
]


class NamesChoice(str, enum.Enum):
    """``--names``: ``grpo_cli.metrics.names.FRAMEWORKS`` plus grpo-cli's own (so ``--help`` imports no torch)."""

    grpo_cli = "grpo-cli"
    areal = "areal"
    verl = "verl"
    trl = "trl"
    twinkle = "twinkle"


NamesOpt = Annotated[
    NamesChoice,
    typer.Option("--names", help="Report every figure that has an equivalent under the key that framework logs, "
                 "in its sign convention (docs/metrics.md, 'Names per framework')."),
]


class PresetName(str, enum.Enum):
    """The names of ``grpo_cli.io.presets.PRESETS`` (listed here so that ``--help`` imports no torch)."""

    areal = "areal"
    verl = "verl"
    trl = "trl"
    slime = "slime"
    openrlhf = "openrlhf"
    twinkle = "twinkle"


PresetOpt = Annotated[
    PresetName | None,
    typer.Option(
        "--preset",
        help="Read a dump written with a framework's own tensor names and conventions (renames, un-rolls "
        "next-token-aligned columns); `grpo-cli schema --preset NAME` shows the map. --map wins over it.",
    ),
]
OnInvalidOpt = Annotated[
    InvalidPolicy,
    typer.Option(
        "--on-invalid",
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


@contextlib.contextmanager
def _progress(total: int, quiet: bool) -> Iterator[Callable[[int], None] | None]:
    """A token progress bar on stderr, only on a terminal and for inputs big enough to wait for."""
    if quiet or total < 2_000_000 or not sys.stderr.isatty():
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


def _workers(workers: int | None, device: Device = Device.cpu) -> int:
    """``--workers``: the available cores by default; one per torchrun rank (each rank is a process) and with
    ``--device cuda`` (one process drives the GPU while a thread decodes ahead)."""
    from grpo_cli.engine.parallel import available_cores, distributed_env

    if workers is None:
        return 1 if distributed_env() is not None or device is Device.cuda else available_cores()
    if workers < 1:
        raise UsageError(f"--workers must be >= 1, got {workers}")
    return workers


def _check_device(device: Device) -> str:
    if device is Device.cuda:
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--device cuda: no CUDA device is available (torch.cuda.is_available() is False)")
    return device.value


def warn_skipped(metrics: Mapping[str, Any]) -> None:
    """One warning line on stderr when ``--on-invalid skip`` dropped sequences (every command calls this)."""
    from grpo_cli.engine.validate import skipped_warning

    warning = skipped_warning(metrics)
    if warning is not None:
        typer.echo(f"grpo-cli: warning: {warning}", err=True)


def _emit(text: str, output: Path | None) -> None:
    if output is None:
        sys.stdout.write(text)
        return
    try:
        output.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"--output {output}: cannot write ({exc.strerror or exc})") from None


@app.command()
def analyze(
    paths: PathsArg,
    epsilon: EpsilonOpt = 0.2,
    epsilon_high: EpsilonHighOpt = None,
    temperature: TemperatureOpt = 1.0,
    top_k: Annotated[int, typer.Option("--top-k", help="Report the k highest-KL tokens (0: off).")] = 10,
    batch_tokens: BatchTokensOpt = 1 << 18,
    device: DeviceOpt = Device.cpu,
    output_format: FormatOpt = OutputFormat.table,
    output: OutputOpt = None,
    column_map: MapOpt = None,
    preset: PresetOpt = None,
    group_by: Annotated[
        str | None, typer.Option("--group-by", help="Also report every figure per value of this per-sequence column.")
    ] = None,
    metric_names: Annotated[
        str | None, typer.Option("--metrics", help="Comma-separated metrics for the per-group table.")
    ] = None,
    loss: Annotated[
        list[str] | None,
        typer.Option("--loss", help="Loss to report (repeatable): grpo, gspo, sapo, cispo, bnpo, dr_grpo, ppo."),
    ] = None,
    c_clip: CClipOpt = None,
    beta: Annotated[float, typer.Option("--beta", help="KL penalty coefficient of the GRPO-family losses.")] = 0.0,
    tau_pos: Annotated[float, typer.Option("--tau-pos", help="SAPO gate temperature for A > 0.")] = 1.0,
    tau_neg: Annotated[float | None, typer.Option("--tau-neg", help="SAPO gate temperature for A < 0.")] = None,
    max_completion_length: Annotated[
        int, typer.Option("--max-completion-length", help="Dr.GRPO's fixed normaliser.")
    ] = 1024,
    importance_level: ImportanceLevelOpt = "token",
    rs_level: RsLevelOpt = None,
    rs_action: RsActionOpt = None,
    rs_metric: RsMetricOpt = None,
    rs_agg: RsAggOpt = None,
    rs_upper: RsUpperOpt = None,
    rs_lower: RsLowerOpt = None,
    on_invalid: OnInvalidOpt = InvalidPolicy.error,
    kl_clamp: Annotated[
        float | None,
        typer.Option("--kl-clamp", help="Clamp the per-token kl_ref/* estimates (the KL loss) to [-C, C] (default: "
                     "none); kl/* are never clamped."),
    ] = None,
    is_threshold: Annotated[
        float, typer.Option("--is-threshold", help="IS weight bound C: is/frac_high (w > C), is/frac_low (w < 1/C).")
    ] = 2.0,
    m2_threshold: Annotated[
        float | None, typer.Option("--m2-threshold", help="M2PO threshold on the mean (old - prox)^2 (default: off).")
    ] = None,
    current_version: Annotated[
        int | None,
        typer.Option("--current-version", help="Trainer version v_θ when the dump has no current_version column."),
    ] = None,
    distill_weight: Annotated[
        float, typer.Option("--distill-weight", help="AReaL distill_loss_weight w_d of loss/kd (teacher_logp).")
    ] = 0.005,
    rl_weight: Annotated[
        float, typer.Option("--rl-weight", help="AReaL rl_loss_weight; 0 selects the importance-sampled loss/kd.")
    ] = 1.0,
    max_new_tokens: Annotated[
        int | None,
        typer.Option("--max-new-tokens", help="Without an eos column: a response this long had no EOS "
                     "(seq/no_eos_frac)."),
    ] = None,
    names: NamesOpt = NamesChoice.grpo_cli,
    convention: Annotated[
        str | None, typer.Option("--convention", help="With --names: an older peer release whose figures differ "
                                 "(verl<=0.7: rollout_is statistics of the raw weights).")
    ] = None,
    workers: WorkersOpt = None,
    quiet: QuietOpt = False,
) -> None:
    """Every diagnostic of a rollout dump, streamed in one pass."""
    from grpo_cli.commands.analyze import AnalyzeConfig
    from grpo_cli.commands.analyze import analyze as run_analysis
    from grpo_cli.io.presets import open_dataset
    from grpo_cli.io.schema import parse_column_map
    from grpo_cli.render.documents import json_document, to_csv
    from grpo_cli.render.tables import render_group_table, render_table

    config = AnalyzeConfig(
        epsilon=epsilon,
        epsilon_high=epsilon_high,
        temperature=temperature,
        top_k=top_k,
        batch_tokens=batch_tokens,
        device=_check_device(device),
        group_by=group_by,
        losses=None if not loss else tuple(name for item in loss for name in item.split(",") if name),
        c_clip=c_clip,
        beta=beta,
        tau_pos=tau_pos,
        tau_neg=tau_neg,
        max_completion_length=max_completion_length,
        importance_level=importance_level,
        rs_level=rs_level,
        rs_action=rs_action,
        rs_metric=rs_metric,
        rs_agg=rs_agg,
        rs_upper=rs_upper,
        rs_lower=rs_lower,
        on_invalid=on_invalid.value,
        kl_clamp=kl_clamp,
        is_threshold=is_threshold,
        m2_threshold=m2_threshold,
        current_version=current_version,
        distill_weight=distill_weight,
        rl_weight=rl_weight,
        max_new_tokens=max_new_tokens,
        names=names.value,
        convention=convention,
    )
    config.validate()
    for note in config.ppo_notes():
        typer.echo(f"grpo-cli: warning: {note}", err=True)
    dataset = open_dataset(paths, parse_column_map(column_map), preset.value if preset is not None else None)
    with _progress(dataset.n_tokens, quiet) as progress:
        result = run_analysis(dataset, config, progress=progress, workers=_workers(workers, device))
    warn_skipped(result.metrics)
    from grpo_cli.metrics.names import rename_result

    result, labels = rename_result(result, names.value)
    selected = _select_metrics(metric_names, result, defaults=[
        next((theirs for theirs, ours in labels.items() if ours == key), key) for key in DEFAULT_GROUP_METRICS
    ])
    extra = {"columns": result.columns}
    if preset is not None:
        extra["preset"] = preset.value
    if group_by is not None:
        extra["groups"] = result.groups

    def draw(console: Console) -> None:
        render_table(console, title="grpo-cli analyze", metrics=result.metrics, omitted=result.omitted,
                     inputs=result.inputs, config=result.config, sources=labels)
        if group_by is not None:
            render_group_table(console, group_by, result.groups, selected)

    _report(
        output_format,
        output,
        document=lambda: json_document(command="analyze", inputs=result.inputs, config=result.config,
                                       metrics=result.metrics, omitted=result.omitted, extra=extra),
        csv=lambda: to_csv(result.metrics, groups=result.groups if group_by is not None else None),
        table=draw,
    )


DEFAULT_GROUP_METRICS = ("n_valid_tokens", "kl/k3", "clip/ratio", "ratio/max", "logp/diff_mean")


def _select_metrics(names: str | None, result: AnalysisResult, defaults: list[str] | None = None) -> list[str]:
    """The per-group table's columns: ``--metrics`` (validated) or a default set, as far as reported."""
    available = set(result.metrics)
    for group in result.groups:
        available |= set(group["metrics"])
    if names is None:
        return [name for name in (DEFAULT_GROUP_METRICS if defaults is None else defaults) if name in available]
    chosen = [name.strip() for name in names.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in available]
    if unknown:
        raise UsageError(f"--metrics: not reported for this dump: {', '.join(unknown)} "
                         f"(available: {', '.join(sorted(available))})")
    return chosen


def _report(
    output_format: OutputFormat,
    output: Path | None,
    *,
    document: Callable[[], dict[str, Any]],
    csv: Callable[[], str],
    table: Callable[[Console], None],
) -> None:
    """Render one result in the chosen format to stdout or ``--output`` (every command's last step)."""
    from grpo_cli.render.console import make_console
    from grpo_cli.render.documents import dumps_json

    if _secondary_rank():
        return  # under torchrun only rank 0 writes the report

    if output_format is OutputFormat.json:
        _emit(dumps_json(document()), output)
    elif output_format is OutputFormat.csv:
        _emit(csv(), output)
    elif output is None:
        table(make_console())
    else:
        import io

        buffer = io.StringIO()
        table(make_console(file=buffer))
        _emit(buffer.getvalue(), output)


class ProxMethod(str, enum.Enum):
    loglinear = "loglinear"
    linear = "linear"
    rollout = "rollout"
    all = "all"


@app.command("compare-prox")
def compare_prox(
    paths: PathsArg,
    method: Annotated[
        list[ProxMethod] | None,
        typer.Option("--method", help="Approximation(s) to compare (repeatable; default all)."),
    ] = None,
    epsilon: EpsilonOpt = 0.2,
    epsilon_high: EpsilonHighOpt = None,
    c_clip: CClipOpt = None,
    importance_level: ImportanceLevelOpt = "token",
    rs_level: RsLevelOpt = None,
    rs_action: RsActionOpt = None,
    rs_metric: RsMetricOpt = None,
    rs_agg: RsAggOpt = None,
    rs_upper: RsUpperOpt = None,
    rs_lower: RsLowerOpt = None,
    tolerance: Annotated[
        float, typer.Option("--tolerance", help="Bound on a lag's abs_error_mean for the max-safe-lag verdict.")
    ] = 0.01,
    current_version: Annotated[
        int | None,
        typer.Option("--current-version", help="Trainer version v_θ when the dump has no current_version column."),
    ] = None,
    max_lag: Annotated[
        int, typer.Option("--max-lag", help="Lags 0..N-1 get a by-staleness row each; larger lags share one.")
    ] = 64,
    batch_tokens: BatchTokensOpt = 1 << 18,
    device: DeviceOpt = Device.cpu,
    output_format: FormatOpt = OutputFormat.table,
    output: OutputOpt = None,
    column_map: MapOpt = None,
    preset: PresetOpt = None,
    on_invalid: OnInvalidOpt = InvalidPolicy.error,
    names: NamesOpt = NamesChoice.grpo_cli,
    workers: WorkersOpt = None,
    quiet: QuietOpt = False,
) -> None:
    """How close AReaL's proximal approximations come to the recomputed prox_logp, by staleness lag.

    Rejection sampling is off unless an --rs-* option is given (the others then take AReaL's defaults:
    token, mask, ratio, mean, upper 5).
    """
    from grpo_cli.commands.compare_prox import CompareProxConfig
    from grpo_cli.commands.compare_prox import compare_prox as run_compare
    from grpo_cli.core.prox import PROX_APPROX_METHODS
    from grpo_cli.io.presets import open_dataset
    from grpo_cli.io.schema import parse_column_map
    from grpo_cli.render.documents import json_document, to_csv
    from grpo_cli.render.prox import render_compare_prox_table

    chosen = [m.value for m in method or [ProxMethod.all]]
    methods = PROX_APPROX_METHODS if "all" in chosen else tuple(dict.fromkeys(chosen))
    config = CompareProxConfig(
        methods=methods,
        epsilon=epsilon,
        epsilon_high=epsilon_high,
        c_clip=c_clip,
        importance_level=importance_level,
        rs_level=rs_level,
        rs_action=rs_action,
        rs_metric=rs_metric,
        rs_agg=rs_agg,
        rs_upper=rs_upper,
        rs_lower=rs_lower,
        tolerance=tolerance,
        current_version=current_version,
        max_lag=max_lag,
        on_invalid=on_invalid.value,
        batch_tokens=batch_tokens,
        device=_check_device(device),
    )
    config.validate()
    for note in config.ppo_notes():
        typer.echo(f"grpo-cli: warning: {note}", err=True)
    dataset = open_dataset(paths, parse_column_map(column_map), preset.value if preset is not None else None)
    if current_version is not None and "current_version" in dataset.columns:
        typer.echo("grpo-cli: warning: --current-version is ignored: the dump has a current_version column", err=True)
    with _progress(dataset.n_tokens, quiet) as progress:
        result = run_compare(dataset, config, progress=progress, workers=_workers(workers, device))
    warn_skipped(result.metrics)
    from grpo_cli.metrics.names import rename_result

    result, labels = rename_result(result, names.value)
    extra: dict[str, Any] = {"columns": result.columns, "recommendations": result.recommendations}
    if preset is not None:
        extra["preset"] = preset.value

    def draw(console: Console) -> None:
        if labels:  # renamed keys: the plain sectioned table (the side-by-side layout needs grpo-cli's keys)
            from grpo_cli.render.tables import render_table

            render_table(console, title="grpo-cli compare-prox", metrics=result.metrics, omitted=result.omitted,
                         inputs=result.inputs, config=result.config, sources=labels)
            return
        render_compare_prox_table(console, metrics=result.metrics, omitted=result.omitted, inputs=result.inputs,
                                  config=result.config, methods=methods, recommendations=result.recommendations,
                                  tolerance=tolerance)

    _report(
        output_format,
        output,
        document=lambda: json_document(command="compare-prox", inputs=result.inputs, config=result.config,
                                       metrics=result.metrics, omitted=result.omitted, extra=extra),
        csv=lambda: to_csv(result.metrics),
        table=draw,
    )


class CheckFormat(str, enum.Enum):
    """``check``'s report formats (JUnit XML is a separate file: ``--junit-xml``)."""

    table = "table"
    json = "json"
    github = "github"


@app.command()
def check(
    paths: PathsArg,
    rules: Annotated[
        list[Path] | None, typer.Option("--rules", "-r", help="TOML rules file (repeatable); see docs/check.md.")
    ] = None,
    rules_preset: Annotated[
        str | None, typer.Option("--rules-preset", help="Built-in rule set needing no file: sanity.")
    ] = None,
    baseline: Annotated[
        Path | None,
        typer.Option("--baseline", help="Earlier `analyze`/`check --format json` output (for max_rel_increase, "
                     "max_abs_change)."),
    ] = None,
    save_baseline: Annotated[
        Path | None, typer.Option("--save-baseline", help="Also write this run's figures as a baseline JSON.")
    ] = None,
    warn_only: Annotated[bool, typer.Option("--warn-only", help="Report violations but exit 0.")] = False,
    output_format: Annotated[CheckFormat, typer.Option("--format", "-f", help="Report format.")] = CheckFormat.table,
    output: OutputOpt = None,
    junit_xml_path: Annotated[
        Path | None, typer.Option("--junit-xml", help="Also write JUnit XML: one testcase per rule.")
    ] = None,
    epsilon: Annotated[
        float | None,
        typer.Option("--epsilon", "--clip-range", help="Lower clip width ε (default: the rules' [analyze], else 0.2)."),
    ] = None,
    epsilon_high: EpsilonHighOpt = None,
    temperature: Annotated[
        float | None, typer.Option("--temperature", help="Sampling temperature (default: the rules', else 1).")
    ] = None,
    on_invalid: Annotated[
        InvalidPolicy | None,
        typer.Option("--on-invalid", help="Invalid values (NaN/positive log-probs, ...): error (exit 2 at the "
                     "first) or skip (drop and accept them). Default: drop them and fail 'input passes validation'."),
    ] = None,
    batch_tokens: BatchTokensOpt = 1 << 18,
    device: DeviceOpt = Device.cpu,
    column_map: MapOpt = None,
    preset: PresetOpt = None,
    quiet: QuietOpt = False,
) -> None:
    """Regression gate for CI: exit 0 if every error rule holds, 1 if one is violated, 2 on bad input.

    Every rule is evaluated (never stopping at the first); a dump without a valid token never passes.
    """
    import os
    import time

    from grpo_cli.commands.check import RuleSet, analyze_config, load_baseline, load_rules, run_check
    from grpo_cli.commands.check import preset as rule_preset
    from grpo_cli.errors import CheckFailed
    from grpo_cli.io.presets import open_dataset
    from grpo_cli.io.schema import parse_column_map
    from grpo_cli.render.check import check_document, github_commands, junit_xml, markdown_summary, render_check_table
    from grpo_cli.render.documents import dumps_json

    if not rules and rules_preset is None and save_baseline is None:
        raise UsageError("check needs --rules FILE or --rules-preset sanity (or only --save-baseline PATH to "
                         "record a baseline)")
    rule_set = RuleSet()
    for path in rules or []:
        rule_set = rule_set.merge(load_rules(path))
    if rules_preset is not None:
        rule_set = rule_set.merge(rule_preset(rules_preset))
    config, require_valid = analyze_config(
        rule_set,
        all_figures=save_baseline is not None,
        epsilon=epsilon,
        epsilon_high=epsilon_high,
        temperature=temperature,
        batch_tokens=batch_tokens,
        device=_check_device(device),
        on_invalid=on_invalid.value if on_invalid is not None else None,
    )
    for note in config.ppo_notes():
        typer.echo(f"grpo-cli: warning: {note}", err=True)
    base = load_baseline(baseline) if baseline is not None else None
    dataset = open_dataset(paths, parse_column_map(column_map), preset.value if preset is not None else None)
    started = time.perf_counter()
    with _progress(dataset.n_tokens, quiet) as progress:
        report = run_check(dataset, rule_set, config, baseline=base, warn_only=warn_only,
                           require_valid_input=require_valid, progress=progress)
    elapsed = time.perf_counter() - started
    warn_skipped(report.metrics)
    for note in report.notes:
        typer.echo(f"grpo-cli: warning: {note}", err=True)

    def write(path: Path, text: str, option: str, mode: str = "w") -> None:
        try:
            with open(path, mode, encoding="utf-8") as handle:
                handle.write(text)
        except OSError as exc:
            raise UsageError(f"{option} {path}: cannot write ({exc.strerror or exc})") from None

    if junit_xml_path is not None:
        write(junit_xml_path, junit_xml(report, elapsed=elapsed), "--junit-xml")
    if save_baseline is not None:
        write(save_baseline, dumps_json(check_document(report)), "--save-baseline")
    if output_format is CheckFormat.github:
        _emit(github_commands(report), output)
        summary = os.environ.get("GITHUB_STEP_SUMMARY")
        if summary:
            write(Path(summary), markdown_summary(report), "$GITHUB_STEP_SUMMARY", mode="a")
    else:
        _report(
            OutputFormat(output_format.value),
            output,
            document=lambda: check_document(report),
            csv=lambda: "",  # not offered by CheckFormat
            table=lambda console: render_check_table(console, report),
        )
    if report.exit_code:
        raise CheckFailed(report.headline())


@app.command()
def report(
    paths: PathsArg,
    output: Annotated[Path, typer.Option("--output", "-o", help="Where to write the HTML page.")],
    rules: Annotated[
        list[Path] | None,
        typer.Option("--rules", "-r", help="Also show the verdict of these TOML rules (repeatable; docs/check.md); "
                     "their [analyze]/[compare_prox] options apply."),
    ] = None,
    epsilon: Annotated[
        float | None,
        typer.Option("--epsilon", "--clip-range", help="Lower clip width ε (default: the rules' [analyze], else 0.2)."),
    ] = None,
    epsilon_high: EpsilonHighOpt = None,
    temperature: Annotated[
        float | None, typer.Option("--temperature", help="Sampling temperature (default: the rules', else 1).")
    ] = None,
    top_k: Annotated[int, typer.Option("--top-k", help="List the k highest-KL tokens (0: off).")] = 10,
    tolerance: Annotated[
        float | None,
        typer.Option("--tolerance", help="compare-prox: bound on a lag's abs_error_mean for the max-safe-lag "
                     "verdict (default: the rules' [compare_prox], else 0.01)."),
    ] = None,
    current_version: Annotated[
        int | None,
        typer.Option("--current-version", help="Trainer version v_θ when the dump has no current_version column."),
    ] = None,
    on_invalid: Annotated[
        InvalidPolicy | None,
        typer.Option("--on-invalid", help="Invalid values: error (exit 2 at the first) or skip (drop and accept "
                     "them). Default, as check: drop them and fail 'input passes validation'."),
    ] = None,
    batch_tokens: BatchTokensOpt = 1 << 18,
    device: DeviceOpt = Device.cpu,
    column_map: MapOpt = None,
    preset: PresetOpt = None,
    quiet: QuietOpt = False,
) -> None:
    """One self-contained offline HTML page: per-step trends, distributions, staleness, compare-prox and the
    `check --rules-preset sanity` verdict (docs/report.md). Exit 0 whatever the verdicts say."""
    from grpo_cli.commands.check import load_rules
    from grpo_cli.commands.check import preset as rule_preset
    from grpo_cli.commands.report import build_report, report_configs
    from grpo_cli.io.presets import open_dataset
    from grpo_cli.io.schema import parse_column_map
    from grpo_cli.render.html import render_html

    rule_sets = [("sanity", rule_preset("sanity"))]
    if rules:
        from grpo_cli.commands.check import RuleSet

        merged = RuleSet()
        for path in rules:
            merged = merged.merge(load_rules(path))
        rule_sets.append(("rules", merged))
    analyze_config, prox_config, require_valid = report_configs(
        rule_sets,
        top_k=top_k,
        tolerance=tolerance,
        epsilon=epsilon,
        epsilon_high=epsilon_high,
        temperature=temperature,
        current_version=current_version,
        batch_tokens=batch_tokens,
        device=_check_device(device),
        on_invalid=on_invalid.value if on_invalid is not None else None,
    )
    for note in analyze_config.ppo_notes():
        typer.echo(f"grpo-cli: warning: {note}", err=True)
    dataset = open_dataset(paths, parse_column_map(column_map), preset.value if preset is not None else None)
    with _progress(dataset.n_tokens, quiet) as progress:
        result = build_report(dataset, rule_sets, analyze_config, prox_config, require_valid=require_valid,
                              progress=progress, preset=preset.value if preset is not None else None)
    warn_skipped(result.analysis.metrics)
    page = render_html(result)
    _emit(page, output)
    if not quiet:
        verdicts = "; ".join(f"{label}: {check.headline()}" for label, check in result.checks)
        typer.echo(f"wrote {output} ({len(page.encode()) / 1024:,.0f} KiB) — {verdicts}", err=True)


@app.command()
def schema(
    preset: PresetOpt = None,
    output_format: FormatOpt = OutputFormat.table,
    output: OutputOpt = None,
) -> None:
    """Print rollout schema v1 (columns, kinds, meanings) and, with --preset, a framework's column map."""
    from grpo_cli.io.presets import describe, format_description
    from grpo_cli.render.documents import dumps_json

    doc = describe(preset.value if preset is not None else None)
    if output_format is OutputFormat.csv:
        raise UsageError("schema: --format csv is not available (use table or json)")
    _emit(dumps_json(doc) if output_format is OutputFormat.json else format_description(doc), output)


class ConvertFormat(str, enum.Enum):
    slime_train = "slime-train"
    slime_rollout = "slime-rollout"
    torch_dict = "torch-dict"
    jsonl = "jsonl"


@app.command()
def convert(
    sources: Annotated[list[str], typer.Argument(help="Source files or directories.")],
    out_dir: Annotated[Path, typer.Option("--output", "-o", help="Output directory (new or empty).")],
    source_format: Annotated[
        ConvertFormat | None,
        typer.Option("--from", help="Source format; omit with --optimize to re-encode a schema-v1 dump."),
    ] = None,
    optimize: Annotated[
        bool, typer.Option("--optimize", help="Re-encode a schema-v1 dump with the fast reader settings.")
    ] = False,
    join: Annotated[
        list[str] | None,
        typer.Option("--join", help="slime: the other half of the dump (rollout dumps for slime-train, train dumps "
                     "for slime-rollout), joined on rollout position (repeatable)."),
    ] = None,
    column_map: MapOpt = None,
    preset: PresetOpt = None,
    on_invalid: OnInvalidOpt = InvalidPolicy.error,
    quiet: QuietOpt = False,
) -> None:
    """Convert slime debug dumps, torch.save'd tensor dicts or JSON lines into schema-v1 Parquet part files."""
    from grpo_cli.commands.convert import convert as run_convert
    from grpo_cli.io.schema import parse_column_map

    result = run_convert(
        sources,
        out_dir,
        source_format=source_format.value if source_format is not None else None,
        optimize=optimize,
        join=join or (),
        column_map=parse_column_map(column_map),
        preset=preset.value if preset is not None else None,
        on_invalid=on_invalid.value,
    )
    for note in result.notes:
        typer.echo(f"grpo-cli: note: {note}", err=True)
    if not quiet:
        sequences = f"{result.n_sequences:,} sequences, " if result.n_sequences >= 0 else ""
        typer.echo(f"wrote {len(result.files)} file(s) ({sequences}{result.n_tokens:,} tokens) to {out_dir}",
                   err=True)


class Estimator(str, enum.Enum):
    """``advantages --estimator``: ``grpo_cli.core.ADVANTAGE_ESTIMATORS`` (here so ``--help`` imports no torch)."""

    gae = "gae"
    grpo = "grpo"
    drgrpo = "drgrpo"
    rloo = "rloo"
    reinforce_pp = "reinforce_pp"


NormSpecHelp = "MEAN[/STD][,leave1out][,biased][,eps=E][,group_size=N]; levels batch|group|none (default none)"


@app.command()
def advantages(
    paths: PathsArg,
    estimator: Annotated[
        Estimator,
        typer.Option("--estimator", help="gae (AReaL: KL reward, token GAE, adv_norm), grpo, drgrpo, rloo "
                     "(per group) or reinforce_pp (return-to-go, whitened per batch)."),
    ],
    atol: Annotated[float, typer.Option("--atol", help="A token mismatches when |recomputed - dumped| > "
                                        "atol + rtol*|recomputed|.")] = 1e-5,
    rtol: Annotated[float, typer.Option("--rtol", help="Relative tolerance (see --atol).")] = 0.0,
    fail_on_mismatch: Annotated[
        bool, typer.Option("--fail-on-mismatch", help="Exit 1 when any sequence disagrees beyond the tolerance.")
    ] = False,
    write: Annotated[
        Path | None, typer.Option("--write", help="Also write the dump with the recomputed advantages here.")
    ] = None,
    valid_only: Annotated[
        bool, typer.Option("--valid-only", help="Compare loss-mask tokens only (default: every token of a "
                           "per-token advantages column; masked ones must match too, e.g. be 0).")
    ] = False,
    top_k: Annotated[int, typer.Option("--top-k", help="List this many worst sequences (0: none).")] = 10,
    batch_by: Annotated[
        str, typer.Option("--batch-by", help="Per-sequence int column that identifies a training batch for "
                          "batch-level statistics and group keys (auto: step if present; none: the whole dump).")
    ] = "auto",
    reward_bias: Annotated[float, typer.Option("--reward-bias", help="AReaL reward_bias.")] = 0.0,
    reward_scaling: Annotated[float, typer.Option("--reward-scaling", help="AReaL reward_scaling.")] = 1.0,
    reward_clip: Annotated[
        float | None, typer.Option("--reward-clip", help="AReaL reward_clip (its default is 20; here off).")
    ] = None,
    overlong_tokens: Annotated[
        int | None, typer.Option("--overlong-tokens", help="AReaL overlong penalty ramp width (enables it).")
    ] = None,
    overlong_penalty_factor: Annotated[
        float | None, typer.Option("--overlong-penalty-factor", help="AReaL overlong penalty at max length.")
    ] = None,
    max_new_tokens: Annotated[
        int | None, typer.Option("--max-new-tokens", help="Max response length: overlong penalty (default 1024) "
                                 "and, without an eos column, 'no EOS' = length >= it.")
    ] = None,
    reward_norm: Annotated[
        str | None, typer.Option("--reward-norm", help=f"AReaL reward_norm: {NormSpecHelp}.")
    ] = None,
    adv_norm: Annotated[str | None, typer.Option("--adv-norm", help=f"AReaL adv_norm (gae): {NormSpecHelp}.")] = None,
    kl_ctl: Annotated[float, typer.Option("--kl-ctl", help="AReaL kl_ctl (gae; its default is 0.1, here 0).")] = 0.0,
    kl_estimator: Annotated[str, typer.Option("--kl-estimator", help="k1|k2|k3 (gae KL reward).")] = "k1",
    discount: Annotated[float, typer.Option("--discount", help="γ (gae, reinforce_pp).")] = 1.0,
    gae_lambda: Annotated[float, typer.Option("--gae-lambda", help="λ (gae).")] = 1.0,
    mask_no_eos_with_zero: Annotated[
        bool, typer.Option("--mask-no-eos-with-zero", help="AReaL: sequences without EOS get reward 0 (gae).")
    ] = False,
    std_eps: Annotated[
        float | None, typer.Option("--std-eps", help="ε of grpo's std (default 1e-6) or reinforce_pp's whitening "
                                   "(1e-8).")
    ] = None,
    std_biased: Annotated[bool, typer.Option("--std-biased", help="grpo: divide the std by N, not N - 1.")] = False,
    rloo_singleton: Annotated[
        str, typer.Option("--rloo-singleton", help="rloo one-sequence group: keep (r, verl rloo) or zero.")
    ] = "keep",
    alignment: Annotated[
        str, typer.Option("--alignment", help="gae: token (the dump's columns are token-aligned; rolled to "
                          "AReaL's next-token alignment and back) or next (already next-token aligned).")
    ] = "token",
    batch_tokens: BatchTokensOpt = 1 << 18,
    device: DeviceOpt = Device.cpu,
    output_format: FormatOpt = OutputFormat.table,
    output: OutputOpt = None,
    column_map: MapOpt = None,
    quiet: QuietOpt = False,
) -> None:
    """Recompute advantages from the rewards and compare them with the dump's (exit 1 with --fail-on-mismatch)."""
    from grpo_cli.commands.advantages import AdvantageCheckConfig, check_advantages, parse_norm_spec
    from grpo_cli.errors import CheckFailed
    from grpo_cli.io.reader import RolloutDataset
    from grpo_cli.io.schema import parse_column_map
    from grpo_cli.render.advantages import render_advantages_table
    from grpo_cli.render.documents import json_document, to_csv

    config = AdvantageCheckConfig(
        estimator=estimator.value,
        atol=atol,
        rtol=rtol,
        valid_only=valid_only,
        top_k=top_k,
        batch_by=batch_by,
        reward_bias=reward_bias,
        reward_scaling=reward_scaling,
        reward_clip=reward_clip,
        overlong_tokens=overlong_tokens,
        overlong_penalty_factor=overlong_penalty_factor,
        max_new_tokens=max_new_tokens,
        reward_norm=parse_norm_spec(reward_norm, "--reward-norm"),
        adv_norm=parse_norm_spec(adv_norm, "--adv-norm"),
        kl_ctl=kl_ctl,
        kl_estimator=kl_estimator,
        discount=discount,
        gae_lambda=gae_lambda,
        mask_no_eos_with_zero=mask_no_eos_with_zero,
        std_eps=std_eps,
        std_unbiased=not std_biased,
        rloo_singleton=rloo_singleton,
        alignment=alignment,
        batch_tokens=batch_tokens,
        device=_check_device(device),
    )
    config.validate()
    dataset = RolloutDataset(paths, parse_column_map(column_map))
    result = check_advantages(dataset, config, write=write)
    if write is not None and not quiet:
        typer.echo(f"wrote {write}", err=True)
    _report(
        output_format,
        output,
        document=lambda: json_document(command="advantages", inputs=result.inputs, config=result.config,
                                       metrics=result.metrics, omitted=result.omitted,
                                       extra={"columns": result.columns, "written": result.written}),
        csv=lambda: to_csv(result.metrics),
        table=lambda console: render_advantages_table(console, result),
    )
    if fail_on_mismatch and result.mismatch:
        n = result.metrics["adv_check/n_sequences_mismatch"]
        raise CheckFailed(f"advantages: {n} sequence(s) differ from the recomputed {estimator.value} advantages "
                          f"beyond atol={atol}, rtol={rtol}")


@app.command()
def sample(
    out: Annotated[Path, typer.Argument(help="Where to write the sample Parquet file.")],
    seed: Annotated[int, typer.Option("--seed", help="Random seed (the run is deterministic for a seed).")] = 0,
    quiet: QuietOpt = False,
) -> None:
    """Write rollouts from a real tiny asynchronous GRPO run (CPU, under a minute)."""
    from grpo_cli.commands.sample import write_sample

    try:
        write_sample(out, seed=seed)
    except OSError as exc:
        raise UsageError(f"{out}: cannot write ({exc.strerror or exc})") from None
    if not quiet:
        typer.echo(f"wrote {out}", err=True)


def _secondary_rank() -> bool:
    """A torchrun rank other than 0 (``RANK``/``WORLD_SIZE`` set by the launcher): it computes but writes nothing."""
    import os

    return os.environ.get("RANK", "0") != "0" and os.environ.get("WORLD_SIZE", "1") not in ("", "0", "1")


def main(argv: list[str] | None = None) -> int:
    """Entry point: run the app and map every failure to one line on stderr and an exit code."""
    args = sys.argv[1:] if argv is None else list(argv)
    if _secondary_rank() and "--debug" not in args:
        import os

        # torchrun: rank 0 writes the report and every message (errors are agreed across ranks first).
        with open(os.devnull, "w") as null, contextlib.redirect_stdout(null), contextlib.redirect_stderr(null):
            return _main(args)
    return _main(args)


def _main(args: list[str]) -> int:
    # --debug is honoured anywhere on the line (also after the command), so it is taken out before parsing.
    _state["debug"] = "--debug" in args
    if _state["debug"]:
        args = [arg for arg in args if arg != "--debug"]
    command = typer.main.get_command(app)
    try:
        # Standalone mode: the parser reports usage errors itself (exit 2) and exits through SystemExit.
        command.main(args=args, prog_name="grpo-cli", standalone_mode=True)
    except SystemExit as exc:
        return _exit_code(exc.code)
    except GrpoCliError as exc:
        if _state["debug"]:
            traceback.print_exc()
        typer.echo(f"grpo-cli: error: {exc}", err=True)
        return exc.exit_code
    except KeyboardInterrupt:
        typer.echo("grpo-cli: interrupted", err=True)
        return 130
    except Exception as exc:  # an internal error: one line, the traceback only on request
        if _state["debug"]:
            traceback.print_exc()
            return EXIT_ERROR
        typer.echo(
            f"grpo-cli: internal error: {type(exc).__name__}: {exc} (rerun with --debug for the traceback)", err=True
        )
        return EXIT_ERROR
    return 0


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    typer.echo(str(code), err=True)
    return EXIT_ERROR


def run() -> None:
    sys.exit(main())
