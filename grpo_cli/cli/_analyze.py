"""``analyze`` and ``compare-prox``: options → config → the command → a rendering."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from grpo_cli._choices import PROX_APPROX_METHODS
from grpo_cli.cli._app import app
from grpo_cli.cli._options import (
    DEFAULT_BATCH_TOKENS,
    BatchTokensOpt,
    CClipOpt,
    CurrentVersionOpt,
    DeviceOpt,
    EpsilonHighOpt,
    EpsilonOpt,
    ExecutorOpt,
    FormatOpt,
    ImportanceLevelOpt,
    IsThresholdOpt,
    KlClampOpt,
    MapOpt,
    MaxStalenessOpt,
    NamesOpt,
    OnInvalidOpt,
    OutputOpt,
    PathsArg,
    PresetOpt,
    ProxApproximationOpt,
    QuietOpt,
    RolloutIsOpt,
    RolloutIsThresholdOpt,
    RolloutRsOpt,
    RolloutRsThresholdOpt,
    RsActionOpt,
    RsAggOpt,
    RsLevelOpt,
    RsLowerOpt,
    RsMetricOpt,
    RsUpperOpt,
    TemperatureOpt,
    VllmIsClipMaxOpt,
    VllmIsClipMinOpt,
    VllmIsModeOpt,
    WorkersOpt,
    check_device,
    config_from,
    metadata_defaults,
    one_of,
    open_input,
    resolve_workers,
    streaming,
    warn_skipped,
    with_options,
    write_result,
)
from grpo_cli.errors import UsageError

if TYPE_CHECKING:
    from rich.console import Console

    from grpo_cli.engine.run import AnalysisResult

__all__ = ["analyze", "compare_prox"]


@app.command()
def analyze(
    ctx: typer.Context,
    paths: PathsArg,
    epsilon: EpsilonOpt = 0.2,
    epsilon_high: EpsilonHighOpt = None,
    temperature: TemperatureOpt = 1.0,
    top_k: Annotated[int, typer.Option("--top-k", help="Report the k highest-KL tokens (0: off).")] = 10,
    batch_tokens: BatchTokensOpt = DEFAULT_BATCH_TOKENS,
    device: DeviceOpt = "cpu",
    output_format: FormatOpt = "table",
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
    on_invalid: OnInvalidOpt = "error",
    kl_clamp: KlClampOpt = None,
    is_threshold: IsThresholdOpt = 2.0,
    m2_threshold: Annotated[
        float | None, typer.Option("--m2-threshold", help="M2PO threshold on the mean (old - prox)^2 (default: off).")
    ] = None,
    current_version: CurrentVersionOpt = None,
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
    names: NamesOpt = "grpo-cli",
    convention: Annotated[
        str | None, typer.Option("--convention", help="With --names: an older peer release whose figures differ "
                                 "(verl<=0.7: rollout_is statistics of the raw weights).")
    ] = None,
    rollout_is: RolloutIsOpt = "token",
    rollout_is_threshold: RolloutIsThresholdOpt = None,
    rollout_rs: RolloutRsOpt = None,
    rollout_rs_threshold: RolloutRsThresholdOpt = None,
    vllm_is_mode: VllmIsModeOpt = "sequence_mask",
    vllm_is_clip_max: VllmIsClipMaxOpt = 3.0,
    vllm_is_clip_min: VllmIsClipMinOpt = None,
    workers: WorkersOpt = None,
    executor: ExecutorOpt = "local",
    quiet: QuietOpt = False,
    all_tables: Annotated[
        bool, typer.Option("--all", help="Show every figure's table after the findings (default: the headline ones).")
    ] = False,
    max_staleness: MaxStalenessOpt = 4,
    prox_approximation: ProxApproximationOpt = None,
    select: Annotated[
        list[str] | None,
        typer.Option("--select", help="Compute only these metric groups (loss, staleness, ...) or the groups of these "
                     "key patterns (is/*, kl/k3); repeatable. Findings need every group: use with --no-findings."),
    ] = None,
    findings: Annotated[
        bool, typer.Option("--findings/--no-findings", help="Diagnose the run (default); --no-findings skips the "
                           "detectors' statistics, about twice as fast on large dumps (docs/performance.md).")
    ] = True,
    wide: Annotated[
        bool, typer.Option("--wide", help="With --format csv: one row per group key, one column per figure.")
    ] = False,
    tensorboard: Annotated[
        Path | None,
        typer.Option("--tensorboard", help="Also write the per-step figures (and the findings) as TensorBoard "
                     "scalars into DIR (needs the 'tensorboard' extra)."),
    ] = None,
) -> None:
    """Every diagnostic of a rollout dump, streamed in one pass, and what is wrong with the run (findings)."""
    from grpo_cli.commands.analyze import AnalyzeConfig
    from grpo_cli.commands.analyze import analyze as run_analysis
    from grpo_cli.findings import DetectConfig
    from grpo_cli.render.documents import analyze_document, to_csv, to_wide_csv
    from grpo_cli.render.findings import render_findings, render_headline
    from grpo_cli.render.tables import render_group_table, render_table

    config = config_from(
        AnalyzeConfig, locals(), device=check_device(device),
        losses=None if not loss else tuple(name for item in loss for name in item.split(",") if name),
    )
    config.validate()
    for note in config.ppo_notes():
        typer.echo(f"grpo-cli: warning: {note}", err=True)
    dataset = open_input(paths, column_map, preset)
    options, from_metadata = metadata_defaults(ctx, dataset.files, config)
    config = with_options(config, options)
    # TensorBoard curves are per step: without --group-by the step split is computed for them alone.
    by_step = tensorboard is not None and group_by is None and "step" in dataset.columns
    if by_step:
        config = dataclasses.replace(config, group_by="step")
    detect = DetectConfig(max_staleness=max_staleness, prox_approximation=prox_approximation) if findings else None
    with streaming(dataset, quiet, executor) as progress:
        result = run_analysis(dataset, config, progress=progress, workers=resolve_workers(workers, device),
                              findings=detect, select=select or ())
    if from_metadata:
        result.config["from_metadata"] = from_metadata
    warn_skipped(result.metrics)
    if tensorboard is not None:
        from grpo_cli.render.tensorboard import write_tensorboard

        steps = result.groups if by_step or group_by == "step" else []
        write_tensorboard(tensorboard, groups=steps, metrics=result.metrics, config=result.config,
                          notes=[*dataset.notes, *(f"{f['code']} {f['severity']} [{f['category']}]: {f['title']}"
                                                   for f in result.findings)])
        if by_step:
            result.groups = []
            result.config["group_by"] = None
    from grpo_cli.metrics.names import rename_result

    result, labels = rename_result(result, names)
    selected = _select_metrics(metric_names, result, defaults=[
        next((theirs for theirs, ours in labels.items() if ours == key), key) for key in DEFAULT_GROUP_METRICS
    ])

    def draw(console: Console) -> None:
        render_findings(console, result.findings, n_tokens=int(result.metrics.get("n_tokens", 0)),
                        inputs=result.inputs)
        if not all_tables:
            render_headline(console, result.metrics, labels)
            if group_by is not None:
                render_group_table(console, group_by, result.groups, selected)
            return
        render_table(console, title="grpo-cli analyze", metrics=result.metrics, omitted=result.omitted,
                     inputs=result.inputs, config=result.config, sources=labels)
        if group_by is not None:
            render_group_table(console, group_by, result.groups, selected)

    write_result(
        output_format,
        output,
        document=lambda: analyze_document(result, preset=preset),
        csv=lambda: (to_wide_csv(result.metrics, result.groups if group_by is not None else None, group_by=group_by)
                     if wide else to_csv(result.metrics, groups=result.groups if group_by is not None else None,
                                         findings=result.findings)),
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
        import difflib

        def close(name: str) -> str:
            matches = difflib.get_close_matches(name, sorted(available), n=3, cutoff=0.6)
            return f"'{name}' (did you mean {' or '.join(repr(m) for m in matches)}?)" if matches else f"'{name}'"

        raise UsageError(f"--metrics: not reported for this dump: {', '.join(close(name) for name in unknown)}; "
                         "--format json lists every reported key")
    return chosen




@app.command("compare-prox")
def compare_prox(
    ctx: typer.Context,
    paths: PathsArg,
    method: Annotated[
        list[str] | None,
        typer.Option("--method", **one_of(*PROX_APPROX_METHODS, "all"),
            help="Approximation(s) to compare (repeatable; default all)."),
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
    current_version: CurrentVersionOpt = None,
    max_lag: Annotated[
        int, typer.Option("--max-lag", help="Lags 0..N-1 get a by-staleness row each; larger lags share one.")
    ] = 64,
    batch_tokens: BatchTokensOpt = DEFAULT_BATCH_TOKENS,
    device: DeviceOpt = "cpu",
    output_format: FormatOpt = "table",
    output: OutputOpt = None,
    column_map: MapOpt = None,
    preset: PresetOpt = None,
    on_invalid: OnInvalidOpt = "error",
    names: NamesOpt = "grpo-cli",
    workers: WorkersOpt = None,
    executor: ExecutorOpt = "local",
    quiet: QuietOpt = False,
) -> None:
    """How close AReaL's proximal approximations come to the recomputed prox_logp, by staleness lag.

    Rejection sampling is off unless an --rs-* option is given (the others then take AReaL's defaults:
    token, mask, ratio, mean, upper 5).
    """
    from grpo_cli.commands.compare_prox import CompareProxConfig
    from grpo_cli.commands.compare_prox import compare_prox as run_compare
    from grpo_cli.core.prox import PROX_APPROX_METHODS
    from grpo_cli.render.documents import compare_prox_document, to_csv
    from grpo_cli.render.prox import render_compare_prox_table

    chosen = method or ["all"]
    methods = PROX_APPROX_METHODS if "all" in chosen else tuple(dict.fromkeys(chosen))
    config = config_from(CompareProxConfig, locals(), methods=methods, device=check_device(device))
    config.validate()
    for note in config.ppo_notes():
        typer.echo(f"grpo-cli: warning: {note}", err=True)
    dataset = open_input(paths, column_map, preset)
    options, from_metadata = metadata_defaults(ctx, dataset.files, config)
    config = with_options(config, options)
    if current_version is not None and "current_version" in dataset.columns:
        typer.echo("grpo-cli: warning: --current-version is ignored: the dump has a current_version column", err=True)
    with streaming(dataset, quiet, executor) as progress:
        result = run_compare(dataset, config, progress=progress, workers=resolve_workers(workers, device))
    if from_metadata:
        result.config["from_metadata"] = from_metadata
    warn_skipped(result.metrics)
    from grpo_cli.metrics.names import rename_result

    result, labels = rename_result(result, names)

    def draw(console: Console) -> None:
        if labels:  # renamed keys: the plain sectioned table (the side-by-side layout needs grpo-cli's keys)
            from grpo_cli.render.tables import render_table

            render_table(console, title="grpo-cli compare-prox", metrics=result.metrics, omitted=result.omitted,
                         inputs=result.inputs, config=result.config, sources=labels)
            return
        render_compare_prox_table(console, metrics=result.metrics, omitted=result.omitted, inputs=result.inputs,
                                  config=result.config, methods=methods, recommendations=result.recommendations,
                                  tolerance=tolerance)

    write_result(
        output_format,
        output,
        document=lambda: compare_prox_document(result, preset=preset),
        csv=lambda: to_csv(result.metrics),
        table=draw,
    )
