"""The ``grpo-cli`` command line: thin wrappers that parse options, call the library and hand results to ``render``.

Exit codes: 0 ok, 1 a check failed, 2 usage/input/internal error. Results go to stdout (or ``--output``); progress,
warnings and errors go to stderr.
"""

from __future__ import annotations

import contextlib
import enum
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from grpo_cli import __version__
from grpo_cli.errors import EXIT_ERROR, GrpoCliError, UsageError

if TYPE_CHECKING:
    from rich.console import Console

    from grpo_cli.analysis import AnalysisResult

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
    _state["debug"] = debug


# -- shared option types ------------------------------------------------------------------------------------------
PathsArg = Annotated[list[str], typer.Argument(help="Parquet files, directories (recursive) or quoted globs.")]
EpsilonOpt = Annotated[float, typer.Option("--epsilon", "--clip-range", help="Lower clip width ε.")]
EpsilonHighOpt = Annotated[
    float | None, typer.Option("--epsilon-high", "--clip-range-high", help="Upper clip width (default ε).")
]
TemperatureOpt = Annotated[
    float, typer.Option("--temperature", help="Sampling temperature; log-probs are rescaled by it as the seed does.")
]
BatchTokensOpt = Annotated[int, typer.Option("--batch-tokens", help="Token budget per streamed batch.")]
DeviceOpt = Annotated[Device, typer.Option("--device", help="Where the core runs.")]
FormatOpt = Annotated[OutputFormat, typer.Option("--format", "-f", help="Output format.")]
OutputOpt = Annotated[Path | None, typer.Option("--output", "-o", help="Write the report here instead of stdout.")]
MapOpt = Annotated[
    list[str] | None, typer.Option("--map", help="Rename a column: canonical=actual (repeatable).")
]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")]


@contextlib.contextmanager
def _progress(total: int, quiet: bool) -> Iterator[Callable[[int], None] | None]:
    """A token progress bar on stderr, only on a terminal and for inputs big enough to wait for."""
    if quiet or total < 2_000_000 or not sys.stderr.isatty():
        yield None
        return
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from grpo_cli.render import make_console

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


def _check_device(device: Device) -> str:
    if device is Device.cuda:
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--device cuda: no CUDA device is available (torch.cuda.is_available() is False)")
    return device.value


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
    batch_tokens: BatchTokensOpt = 1 << 20,
    device: DeviceOpt = Device.cpu,
    output_format: FormatOpt = OutputFormat.table,
    output: OutputOpt = None,
    column_map: MapOpt = None,
    group_by: Annotated[
        str | None, typer.Option("--group-by", help="Also report every figure per value of this per-sequence column.")
    ] = None,
    metric_names: Annotated[
        str | None, typer.Option("--metrics", help="Comma-separated metrics for the per-group table.")
    ] = None,
    quiet: QuietOpt = False,
) -> None:
    """Every diagnostic of a rollout dump, streamed in one pass."""
    from grpo_cli.analysis import AnalyzeConfig
    from grpo_cli.analysis import analyze as run_analysis
    from grpo_cli.io.reader import RolloutDataset
    from grpo_cli.io.schema import parse_column_map
    from grpo_cli.render import json_document, render_group_table, render_table, to_csv

    config = AnalyzeConfig(
        epsilon=epsilon,
        epsilon_high=epsilon_high,
        temperature=temperature,
        top_k=top_k,
        batch_tokens=batch_tokens,
        device=_check_device(device),
        group_by=group_by,
    )
    config.validate()
    dataset = RolloutDataset(paths, parse_column_map(column_map))
    with _progress(dataset.n_tokens, quiet) as progress:
        result = run_analysis(dataset, config, progress=progress)
    selected = _select_metrics(metric_names, result)
    extra = {"columns": result.columns}
    if group_by is not None:
        extra["groups"] = result.groups

    def draw(console: Console) -> None:
        render_table(console, title="grpo-cli analyze", metrics=result.metrics, omitted=result.omitted,
                     inputs=result.inputs, config=result.config)
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


def _select_metrics(names: str | None, result: AnalysisResult) -> list[str]:
    """The per-group table's columns: ``--metrics`` (validated) or a default set, as far as reported."""
    available = set(result.metrics)
    for group in result.groups:
        available |= set(group["metrics"])
    if names is None:
        return [name for name in DEFAULT_GROUP_METRICS if name in available]
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
    from grpo_cli.render import dumps_json, make_console

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


@app.command()
def sample(
    out: Annotated[Path, typer.Argument(help="Where to write the sample Parquet file.")],
    seed: Annotated[int, typer.Option("--seed", help="Random seed (the run is deterministic for a seed).")] = 0,
    quiet: QuietOpt = False,
) -> None:
    """Write rollouts from a real tiny asynchronous GRPO run (CPU, under a minute)."""
    from grpo_cli.sample import write_sample

    try:
        write_sample(out, seed=seed)
    except OSError as exc:
        raise UsageError(f"{out}: cannot write ({exc.strerror or exc})") from None
    if not quiet:
        typer.echo(f"wrote {out}", err=True)


def main(argv: list[str] | None = None) -> int:
    """Entry point: run the app and map every failure to one line on stderr and an exit code."""
    args = sys.argv[1:] if argv is None else list(argv)
    _state["debug"] = "--debug" in args
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
