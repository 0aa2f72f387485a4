"""``diff``: two runs' options → one config → the command → a rendering."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from grpo_cli._constants import DEFAULT_EPSILON, DEFAULT_IS_THRESHOLD, DEFAULT_TEMPERATURE
from grpo_cli._format import format_value
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
    OnInvalidOpt,
    OutputOpt,
    PresetOpt,
    QuietOpt,
    TemperatureOpt,
    WorkersOpt,
    check_device,
    config_from,
    metadata_defaults,
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

__all__ = ["diff", "split_runs"]


def split_runs(
    runs: list[str] | None, base: list[str] | None, new: list[str] | None, labels: list[str] | None
) -> tuple[list[str], list[str], tuple[str, str]]:
    """The two runs' paths (``BASE NEW`` positionals, each extended by ``--base``/``--new``) and their labels."""
    runs = list(runs or [])
    if len(runs) not in (0, 2):
        raise UsageError(f"diff takes two runs, BASE and NEW (got {len(runs)} paths; more paths per run: --base/--new)")
    base_paths = runs[:1] + list(base or [])
    new_paths = runs[1:] + list(new or [])
    if not base_paths or not new_paths:
        raise UsageError("diff needs both runs: BASE NEW, or --base PATH and --new PATH")
    names = list(labels or [])
    if len(names) > 2:
        raise UsageError(f"--label: at most two (BASE's, then NEW's), got {len(names)}")
    names += ["base", "new"][len(names):]
    if names[0] == names[1]:
        raise UsageError(f"--label: the two runs need different labels, got '{names[0]}' twice")
    return base_paths, new_paths, (names[0], names[1])


@app.command()
def diff(
    ctx: typer.Context,
    runs: Annotated[
        list[str] | None,
        typer.Argument(metavar="BASE NEW", help="The two runs: each a Parquet file, a directory (recursive) or a "
                       "quoted glob."),
    ] = None,
    base: Annotated[
        list[str] | None, typer.Option("--base", help="Another path of the base run (repeatable).")
    ] = None,
    new: Annotated[list[str] | None, typer.Option("--new", help="Another path of the new run (repeatable).")] = None,
    label: Annotated[
        list[str] | None, typer.Option("--label", help="Name the runs: first BASE, then NEW (default base, new).")
    ] = None,
    z: Annotated[
        float,
        typer.Option("--z", help="Half-width of the change's interval in jackknife standard errors; a change is "
                     "beyond noise when its interval excludes 0 (docs/diff.md)."),
    ] = 3.0,
    blocks: Annotated[
        int, typer.Option("--blocks", help="Jackknife blocks per run without (enough) steps: hashed prompt groups.")
    ] = 20,
    fail_on_change: Annotated[
        bool, typer.Option("--fail-on-change", help="Exit 1 when any figure changed beyond noise.")
    ] = False,
    show_all: Annotated[
        bool, typer.Option("--all", help="Table: every figure, not only the closest to noise.")
    ] = False,
    epsilon: EpsilonOpt = DEFAULT_EPSILON,
    epsilon_high: EpsilonHighOpt = None,
    temperature: TemperatureOpt = DEFAULT_TEMPERATURE,
    c_clip: CClipOpt = None,
    importance_level: ImportanceLevelOpt = "token",
    is_threshold: IsThresholdOpt = DEFAULT_IS_THRESHOLD,
    kl_clamp: KlClampOpt = None,
    current_version: CurrentVersionOpt = None,
    batch_tokens: BatchTokensOpt = DEFAULT_BATCH_TOKENS,
    device: DeviceOpt = "cpu",
    output_format: FormatOpt = "table",
    output: OutputOpt = None,
    column_map: MapOpt = None,
    preset: PresetOpt = None,
    on_invalid: OnInvalidOpt = "error",
    workers: WorkersOpt = None,
    executor: ExecutorOpt = "local",
    quiet: QuietOpt = False,
) -> None:
    """Is the difference between two runs real? Every figure side by side, its change and a jackknife interval."""
    from grpo_cli.commands.diff import DiffConfig, diff_results, measure
    from grpo_cli.render.diff import diff_csv, diff_document, render_diff

    base_paths, new_paths, labels = split_runs(runs, base, new, label)
    config = config_from(DiffConfig, locals(), device=check_device(device))
    config.validate()
    for note in config.ppo_notes():
        typer.echo(f"grpo-cli: warning: {note}", err=True)
    measured, options, used = [], [], []
    for paths, name in zip((base_paths, new_paths), labels):
        dataset = open_input(paths, column_map, preset, config.on_invalid)
        # Each run is measured with its own dump's recorded options where the command line gave none.
        found, reported = metadata_defaults(ctx, dataset.files, config)
        with streaming(dataset, quiet, executor) as progress:
            run = measure(dataset, with_options(config, found), name, progress=progress,
                          workers=resolve_workers(workers, device))
        warn_skipped(run.result.metrics)
        measured.append(run)
        options.append(found)
        used.append(reported)
    # The config reports a recorded option where both runs used the same value; from_metadata says each run's.
    common = {k: v for k, v in options[0].items() if k in options[1] and options[1][k] == v}
    for key in sorted((options[0].keys() | options[1].keys()) - common.keys()):
        base_value, new_value = (format_value(found.get(key, getattr(config, key))) for found in options)
        typer.echo(f"grpo-cli: warning: {key} differs between the runs ({labels[0]} {base_value}, {labels[1]} "
                   f"{new_value}, from their metadata): each run's figures use its own", err=True)
    result = diff_results(measured[0], measured[1], with_options(config, common))
    if any(used):
        result.config["from_metadata"] = {"base": used[0], "new": used[1]}

    def draw(console: Console) -> None:
        render_diff(console, result, show_all=show_all)

    write_result(output_format, output, document=lambda: diff_document(result), csv=lambda: diff_csv(result),
                 table=draw)
    if fail_on_change and result.significant:
        raise typer.Exit(1)
