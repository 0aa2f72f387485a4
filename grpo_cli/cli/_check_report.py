"""``check`` and ``report``: regression gates on a dump, and the offline HTML page with their verdicts."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from grpo_cli._choices import ON_INVALID
from grpo_cli.cli._app import app
from grpo_cli.cli._options import (
    DEFAULT_BATCH_TOKENS,
    BatchTokensOpt,
    CurrentVersionOpt,
    DeviceOpt,
    EpsilonHighOpt,
    ExecutorOpt,
    MapOpt,
    MaxStalenessOpt,
    OutputOpt,
    PathsArg,
    PresetOpt,
    ProxApproximationOpt,
    QuietOpt,
    WorkersOpt,
    check_device,
    emit,
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

__all__ = ["check", "report"]

# check and report take their defaults from the rules' [analyze] table: these options default to "not given".
GateEpsilonOpt = Annotated[
    float | None,
    typer.Option("--epsilon", "--clip-range", help="Lower clip width ε (default: the rules' [analyze], else 0.2)."),
]
GateTemperatureOpt = Annotated[
    float | None, typer.Option("--temperature", help="Sampling temperature (default: the rules', else 1).")
]
GateOnInvalidOpt = Annotated[
    str | None,
    typer.Option("--on-invalid", **one_of(*ON_INVALID),
                 help="Invalid values (NaN/positive log-probs, ...): error (exit 2 at the first) or skip (drop and "
                 "accept them). Default: drop them and fail 'input passes validation'."),
]

CHECK_FORMATS = ("table", "json", "github")
"""``check``'s report formats (JUnit XML is a separate file: ``--junit-xml``)."""


@app.command()
def check(
    ctx: typer.Context,
    paths: PathsArg,
    rules: Annotated[
        list[Path] | None, typer.Option("--rules", "-r", help="TOML rules file (repeatable); see docs/check.md.")
    ] = None,
    rules_preset: Annotated[
        str | None, typer.Option("--rules-preset", help="Built-in rule set needing no file: sanity.")
    ] = None,
    baseline: Annotated[
        list[Path] | None,
        typer.Option("--baseline", help="Earlier `analyze`/`check --format json` output, or the baseline run's "
                     "dump (repeatable; bounds then fail only beyond noise), for max_rel_increase, max_abs_change."),
    ] = None,
    save_baseline: Annotated[
        Path | None, typer.Option("--save-baseline", help="Also write this run's figures as a baseline JSON.")
    ] = None,
    warn_only: Annotated[bool, typer.Option("--warn-only", help="Report violations but exit 0.")] = False,
    output_format: Annotated[
        str, typer.Option("--format", "-f", **one_of(*CHECK_FORMATS), help="Report format.")
    ] = "table",
    output: OutputOpt = None,
    junit_xml_path: Annotated[
        Path | None, typer.Option("--junit-xml", help="Also write JUnit XML: one testcase per rule.")
    ] = None,
    epsilon: GateEpsilonOpt = None,
    epsilon_high: EpsilonHighOpt = None,
    temperature: GateTemperatureOpt = None,
    on_invalid: GateOnInvalidOpt = None,
    batch_tokens: BatchTokensOpt = DEFAULT_BATCH_TOKENS,
    device: DeviceOpt = "cpu",
    column_map: MapOpt = None,
    preset: PresetOpt = None,
    quiet: QuietOpt = False,
    workers: WorkersOpt = None,
    executor: ExecutorOpt = "local",
    select: Annotated[
        list[str] | None,
        typer.Option("--select", help="Built-in detectors to run, by code (GRP101), code prefix (GRP1) or category "
                     "(alignment); repeatable (default: all). `grpo-cli explain CODE` describes each."),
    ] = None,
    ignore: Annotated[
        list[str] | None, typer.Option("--ignore", help="Built-in detectors to leave out (code, prefix or category).")
    ] = None,
    max_staleness: MaxStalenessOpt = 4,
    prox_approximation: ProxApproximationOpt = None,
) -> None:
    """Regression gate for CI: exit 0 if every error rule holds, 1 if one is violated, 2 on bad input.

    The built-in detectors (findings, `grpo-cli explain CODE`) always run as rules: an error finding fails the gate.
    Every rule is evaluated (never stopping at the first); a dump without a valid token never passes.
    """
    import os
    import time

    from grpo_cli.commands._check_rules import RuleSet, load_rules
    from grpo_cli.commands._check_rules import preset as rule_preset
    from grpo_cli.findings import DetectConfig, check_patterns

    # Usage errors first, torch-free: a bad rules file costs no torch import (grpo_cli/_keys.json).
    check_patterns(select or [], "--select")
    check_patterns(ignore or [], "--ignore")
    rule_set = RuleSet()
    for path in rules or []:
        rule_set = rule_set.merge(load_rules(path))
    if rules_preset is not None:
        rule_set = rule_set.merge(rule_preset(rules_preset))

    from grpo_cli.commands.check import analyze_config, is_json_baseline, load_baseline, run_check
    from grpo_cli.errors import CheckFailed
    from grpo_cli.render.check import check_document, github_commands, junit_xml, markdown_summary, render_check_table
    from grpo_cli.render.documents import dumps_json
    config, require_valid = analyze_config(
        rule_set,
        all_figures=save_baseline is not None,
        epsilon=epsilon,
        epsilon_high=epsilon_high,
        temperature=temperature,
        batch_tokens=batch_tokens,
        device=check_device(device),
        on_invalid=on_invalid,
    )
    for note in config.ppo_notes():
        typer.echo(f"grpo-cli: warning: {note}", err=True)
    json_baseline = bool(baseline) and is_json_baseline(baseline or [])
    base = load_baseline((baseline or [])[0]) if json_baseline else None
    # An unreadable file is skipped only under an explicit --on-invalid skip (check's own default stays strict).
    read_as = "error" if require_valid else config.on_invalid
    dataset = open_input(paths, column_map, preset, read_as)
    # The dump's recorded options fill what neither the command line nor the rules' [analyze] table set.
    plain_config = config
    options, from_metadata = metadata_defaults(ctx, dataset.files, config, fixed=rule_set.analyze)
    config = with_options(config, options)
    base_dump, base_config = None, None
    if baseline and not json_baseline:
        # The baseline run is measured with its own recorded options, as diff and report --compare read each run.
        base_dump = open_input([str(p) for p in baseline], column_map, preset, read_as)
        base_found, _ = metadata_defaults(ctx, base_dump.files, plain_config, fixed=rule_set.analyze)
        base_config = with_options(plain_config, base_found)
    started = time.perf_counter()
    with streaming(dataset, quiet, executor) as progress:
        report = run_check(dataset, rule_set, config, baseline=base, warn_only=warn_only,
                           require_valid_input=require_valid, progress=progress,
                           findings=DetectConfig(max_staleness=max_staleness, prox_approximation=prox_approximation),
                           select=select or None, ignore=ignore or (), all_figures=save_baseline is not None,
                           baseline_dump=base_dump, baseline_config=base_config,
                           workers=resolve_workers(workers, config.device))
    elapsed = time.perf_counter() - started
    if from_metadata:
        report.config["from_metadata"] = from_metadata
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
    if output_format == "github":
        emit(github_commands(report), output)
        summary = os.environ.get("GITHUB_STEP_SUMMARY")
        if summary:
            write(Path(summary), markdown_summary(report), "$GITHUB_STEP_SUMMARY", mode="a")
    else:
        write_result(
            output_format,
            output,
            document=lambda: check_document(report),
            csv=lambda: "",  # not among CHECK_FORMATS
            table=lambda console: render_check_table(console, report),
        )
    if report.exit_code:
        # The verdict once: the table already ends with it when it went to this terminal.
        on_terminal = (output is None and output_format == "table" and sys.stdout.isatty()
                       and sys.stderr.isatty())
        raise CheckFailed("" if on_terminal else report.headline())


@app.command()
def report(
    ctx: typer.Context,
    paths: PathsArg,
    output: Annotated[Path, typer.Option("--output", "-o", help="Where to write the HTML page.")],
    rules: Annotated[
        list[Path] | None,
        typer.Option("--rules", "-r", help="Also show the verdict of these TOML rules (repeatable; docs/check.md); "
                     "their [analyze]/[compare_prox] options apply."),
    ] = None,
    epsilon: GateEpsilonOpt = None,
    epsilon_high: EpsilonHighOpt = None,
    temperature: GateTemperatureOpt = None,
    top_k: Annotated[
        int, typer.Option("--top-k", help="List the k highest-KL and highest-ratio tokens (0: off).")
    ] = 10,
    tolerance: Annotated[
        float | None,
        typer.Option("--tolerance", help="compare-prox: bound on a lag's abs_error_mean for the max-safe-lag "
                     "verdict (default: the rules' [compare_prox], else 0.01)."),
    ] = None,
    current_version: CurrentVersionOpt = None,
    on_invalid: GateOnInvalidOpt = None,
    batch_tokens: BatchTokensOpt = DEFAULT_BATCH_TOKENS,
    device: DeviceOpt = "cpu",
    column_map: MapOpt = None,
    preset: PresetOpt = None,
    compare: Annotated[
        list[str] | None,
        typer.Option("--compare", help="A base run (file, directory or quoted glob; repeatable) analysed with the "
                     "same options and drawn dashed on every trend chart (docs/diff.md)."),
    ] = None,
    quiet: QuietOpt = False,
    workers: WorkersOpt = None,
    executor: ExecutorOpt = "local",
) -> None:
    """One self-contained offline HTML page: per-step trends, distributions, staleness, compare-prox and the
    `check --rules-preset sanity` verdict (docs/report.md). Exit 0 whatever the verdicts say."""
    from grpo_cli.commands.check import load_rules
    from grpo_cli.commands.check import preset as rule_preset
    from grpo_cli.commands.report import build_report, report_configs
    from grpo_cli.render.html import render_html

    rule_sets = [("sanity", rule_preset("sanity"))]
    if rules:
        from grpo_cli.commands.check import RuleSet

        merged = RuleSet()
        for path in rules:
            merged = merged.merge(load_rules(path))
        rule_sets.append(("rules", merged))
    options = dict(epsilon=epsilon, epsilon_high=epsilon_high, temperature=temperature,
                   current_version=current_version, batch_tokens=batch_tokens, device=check_device(device),
                   on_invalid=on_invalid)
    analyze_config, prox_config, require_valid = report_configs(rule_sets, top_k=top_k, tolerance=tolerance,
                                                                **options)
    for note in analyze_config.ppo_notes():
        typer.echo(f"grpo-cli: warning: {note}", err=True)
    read_as = "error" if require_valid else analyze_config.on_invalid  # skip unreadable files only if asked
    dataset = open_input(paths, column_map, preset, read_as)
    # The dump's recorded options fill what neither the command line nor a rules file set; the configs are chosen
    # again so compare-prox's follow analyze's as usual (a rules file's [compare_prox] still wins there).
    in_rules = {name for _, rule_set in rule_sets for name in rule_set.analyze}
    found, from_metadata = metadata_defaults(ctx, dataset.files, analyze_config, fixed=in_rules)
    plain_config = analyze_config
    if found:
        analyze_config, prox_config, require_valid = report_configs(rule_sets, top_k=top_k, tolerance=tolerance,
                                                                    **{**options, **found})
    baseline, base_config = None, None
    base_metadata: dict[str, Any] = {}
    if compare:
        # The base run is read with its own recorded options, as diff reads each run.
        baseline = open_input(compare, column_map, preset, read_as)
        base_found, base_metadata = metadata_defaults(ctx, baseline.files, plain_config, fixed=in_rules)
        base_config = with_options(plain_config, base_found)
    with streaming(dataset, quiet, executor) as progress:
        result = build_report(dataset, rule_sets, analyze_config, prox_config, require_valid=require_valid,
                              progress=progress, preset=preset, baseline=baseline, baseline_config=base_config,
                              workers=resolve_workers(workers, analyze_config.device))
    if from_metadata:
        result.analysis.config["from_metadata"] = from_metadata
    if result.baseline is not None and base_metadata:
        result.baseline.config["from_metadata"] = base_metadata
    warn_skipped(result.analysis.metrics)
    page = render_html(result)
    emit(page, output)
    if not quiet:
        verdicts = "; ".join(f"{label}: {check.headline()}" for label, check in result.checks)
        typer.echo(f"wrote {output} ({len(page.encode()) / 1024:,.0f} KiB) — {verdicts}", err=True)
