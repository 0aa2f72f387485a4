"""``analyze`` and ``compare-prox``: options → config → the command → a rendering."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from grpo_cli._choices import PROX_APPROX_METHODS
from grpo_cli._constants import (
    DEFAULT_BETA,
    DEFAULT_DISTILL_WEIGHT,
    DEFAULT_EPSILON,
    DEFAULT_IS_THRESHOLD,
    DEFAULT_MAX_COMPLETION_LENGTH,
    DEFAULT_RL_WEIGHT,
    DEFAULT_TAU_POS,
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_K,
    DEFAULT_VLLM_IS_CLIP_MAX,
    DEFAULT_VLLM_IS_MODE,
)
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

__all__ = ["analyze", "compare_prox"]


@app.command()
def analyze(
    ctx: typer.Context,
    paths: PathsArg,
    epsilon: EpsilonOpt = DEFAULT_EPSILON,
    epsilon_high: EpsilonHighOpt = None,
    temperature: TemperatureOpt = DEFAULT_TEMPERATURE,
    top_k: Annotated[int, typer.Option("--top-k", help="Report the k highest-KL tokens (0: off).")
    ] = DEFAULT_TOP_K,
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
    beta: Annotated[float, typer.Option("--beta", help="KL penalty coefficient of the GRPO-family losses.")
    ] = DEFAULT_BETA,
    tau_pos: Annotated[float, typer.Option("--tau-pos", help="SAPO gate temperature for A > 0.")] = DEFAULT_TAU_POS,
    tau_neg: Annotated[float | None, typer.Option("--tau-neg", help="SAPO gate temperature for A < 0.")] = None,
    max_completion_length: Annotated[
        int, typer.Option("--max-completion-length", help="Dr.GRPO's fixed normaliser.")
    ] = DEFAULT_MAX_COMPLETION_LENGTH,
    importance_level: ImportanceLevelOpt = "token",
    rs_level: RsLevelOpt = None,
    rs_action: RsActionOpt = None,
    rs_metric: RsMetricOpt = None,
    rs_agg: RsAggOpt = None,
    rs_upper: RsUpperOpt = None,
    rs_lower: RsLowerOpt = None,
    on_invalid: OnInvalidOpt = "error",
    kl_clamp: KlClampOpt = None,
    is_threshold: IsThresholdOpt = DEFAULT_IS_THRESHOLD,
    m2_threshold: Annotated[
        float | None, typer.Option("--m2-threshold", help="M2PO threshold on the mean (old - prox)^2 (default: off).")
    ] = None,
    current_version: CurrentVersionOpt = None,
    distill_weight: Annotated[
        float, typer.Option("--distill-weight", help="AReaL distill_loss_weight w_d of loss/kd (teacher_logp).")
    ] = DEFAULT_DISTILL_WEIGHT,
    rl_weight: Annotated[
        float, typer.Option("--rl-weight", help="AReaL rl_loss_weight; 0 selects the importance-sampled loss/kd.")
    ] = DEFAULT_RL_WEIGHT,
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
    vllm_is_mode: VllmIsModeOpt = DEFAULT_VLLM_IS_MODE,
    vllm_is_clip_max: VllmIsClipMaxOpt = DEFAULT_VLLM_IS_CLIP_MAX,
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
    from grpo_cli.metrics.names import rename_result
    from grpo_cli.render.analyze import analyze_csv, group_table_metrics, render_analyze
    from grpo_cli.render.documents import analyze_document

    config = config_from(
        AnalyzeConfig, locals(), device=check_device(device),
        losses=None if not loss else tuple(name for item in loss for name in item.split(",") if name),
    )
    config.validate()
    if tensorboard is not None:
        from grpo_cli.render.tensorboard import export_tensorboard, require_tensorboard, with_step_split

        require_tensorboard()  # a missing extra fails now, not after the whole dump has been read
    for note in config.ppo_notes():
        typer.echo(f"grpo-cli: warning: {note}", err=True)
    dataset = open_input(paths, column_map, preset, config.on_invalid)
    options, from_metadata = metadata_defaults(ctx, dataset.files, config)
    config = with_options(config, options)
    split_added = False
    if tensorboard is not None:
        config, split_added = with_step_split(config, dataset.columns)
    detect = DetectConfig(max_staleness=max_staleness, prox_approximation=prox_approximation) if findings else None
    with streaming(dataset, quiet, executor) as progress:
        result = run_analysis(dataset, config, progress=progress, workers=resolve_workers(workers, device),
                              findings=detect, select=select or ())
    if from_metadata:
        result.config["from_metadata"] = from_metadata
    warn_skipped(result.metrics)
    if tensorboard is not None:
        export_tensorboard(tensorboard, result, split_added=split_added, notes=dataset.notes)
    result, labels = rename_result(result, names)
    selected = group_table_metrics(metric_names, result, labels)
    write_result(
        output_format,
        output,
        document=lambda: analyze_document(result, preset=preset),
        csv=lambda: analyze_csv(result, group_by=group_by, wide=wide),
        table=lambda console: render_analyze(console, result, labels, group_by=group_by, metrics=selected,
                                             all_tables=all_tables),
    )


@app.command("compare-prox")
def compare_prox(
    ctx: typer.Context,
    paths: PathsArg,
    method: Annotated[
        list[str] | None,
        typer.Option("--method", **one_of(*PROX_APPROX_METHODS, "all"),
            help="Approximation(s) to compare (repeatable; default all)."),
    ] = None,
    epsilon: EpsilonOpt = DEFAULT_EPSILON,
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
    from grpo_cli.render.prox import render_compare_prox

    chosen = method or ["all"]
    methods = PROX_APPROX_METHODS if "all" in chosen else tuple(dict.fromkeys(chosen))
    config = config_from(CompareProxConfig, locals(), methods=methods, device=check_device(device))
    config.validate()
    for note in config.ppo_notes():
        typer.echo(f"grpo-cli: warning: {note}", err=True)
    dataset = open_input(paths, column_map, preset, config.on_invalid)
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

    write_result(
        output_format,
        output,
        document=lambda: compare_prox_document(result, preset=preset),
        csv=lambda: to_csv(result.metrics),
        table=lambda console: render_compare_prox(console, result, labels, methods=methods, tolerance=tolerance),
    )
