"""The commands that describe, convert, recompute or make a dump: ``schema``, ``convert``, ``advantages`` and
``sample``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from grpo_cli._choices import ADVANTAGE_ESTIMATORS, CONVERT_FORMATS, PRESET_NAMES
from grpo_cli.cli._app import app
from grpo_cli.cli._options import (
    DEFAULT_BATCH_TOKENS,
    BatchTokensOpt,
    DeviceOpt,
    ExecutorOpt,
    FormatOpt,
    MapOpt,
    OnInvalidOpt,
    OutputOpt,
    PathsArg,
    PresetOpt,
    QuietOpt,
    WorkersOpt,
    check_device,
    config_from,
    emit,
    one_of,
    open_input,
    resolve_workers,
    streaming,
    warn_skipped,
    write_result,
)
from grpo_cli.errors import EXIT_CHECK_FAILED, UsageError

__all__ = ["advantages", "convert", "sample", "schema"]


@app.command()
def schema(
    preset: Annotated[
        str | None,
        typer.Option("--preset", **one_of(*PRESET_NAMES),
                     help="Also show this framework's column map: the tensors each schema column is read from "
                     "(first present wins), its alignment and window, and notes on its conventions."),
    ] = None,
    output_format: FormatOpt = "table",
    output: OutputOpt = None,
) -> None:
    """Print rollout schema v1 (columns, kinds, meanings) and, with --preset, a framework's column map."""
    from grpo_cli.io.preset_table import describe, format_description
    from grpo_cli.render.documents import dumps_json

    doc = describe(preset)
    if output_format == "csv":
        raise UsageError("schema: --format csv is not available (use table or json)")
    emit(dumps_json(doc) if output_format == "json" else format_description(doc), output)


@app.command()
def convert(
    sources: Annotated[list[str], typer.Argument(help="Source files or directories.")],
    out_dir: Annotated[str, typer.Option("--output", "-o", help="Output directory or object-storage prefix "
                                         "(s3://bucket/prefix, gs://, hdfs://, abfs://; new or empty).")],
    source_format: Annotated[
        str | None,
        typer.Option("--from", **one_of(*CONVERT_FORMATS),
            help="Source format; omit with --optimize to re-encode a schema-v1 dump."),
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
    on_invalid: OnInvalidOpt = "error",
    quiet: QuietOpt = False,
) -> None:
    """Convert slime debug dumps, torch.save'd tensor dicts or JSON lines into schema-v1 Parquet part files."""
    from grpo_cli.commands.convert import convert as run_convert
    from grpo_cli.io.schema import parse_column_map

    result = run_convert(
        sources,
        out_dir,
        source_format=source_format,
        optimize=optimize,
        join=join or (),
        column_map=parse_column_map(column_map),
        preset=preset,
        on_invalid=on_invalid,
    )
    for note in result.notes:
        typer.echo(f"grpo-cli: note: {note}", err=True)
    if not quiet:
        sequences = f"{result.n_sequences:,} sequences, " if result.n_sequences >= 0 else ""
        typer.echo(f"wrote {len(result.files)} file(s) ({sequences}{result.n_tokens:,} tokens) to {out_dir}",
                   err=True)


NormSpecHelp = "MEAN[/STD][,leave1out][,biased][,eps=E][,group_size=N]; levels batch|group|none (default none)"


@app.command()
def advantages(
    paths: PathsArg,
    estimator: Annotated[
        str,
        typer.Option("--estimator", **one_of(*ADVANTAGE_ESTIMATORS),
            help="gae (AReaL: KL reward, token GAE, adv_norm), grpo, drgrpo, rloo "
                     "(per group) or reinforce_pp (return-to-go, whitened per batch)."),
    ],
    atol: Annotated[float, typer.Option("--atol", help="A token mismatches when |recomputed - dumped| > "
                                        "atol + rtol*|recomputed|.")] = 1e-5,
    rtol: Annotated[float, typer.Option("--rtol", help="Relative tolerance (see --atol).")] = 0.0,
    fail_on_mismatch: Annotated[
        bool, typer.Option("--fail-on-mismatch", help="Exit 1 when any sequence disagrees beyond the tolerance.")
    ] = False,
    write: Annotated[
        str | None, typer.Option("--write", help="Also write the dump with the recomputed advantages to this Parquet "
                                 "file (or object, s3://bucket/key.parquet).")
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
    batch_tokens: BatchTokensOpt = DEFAULT_BATCH_TOKENS,
    device: DeviceOpt = "cpu",
    workers: WorkersOpt = None,
    executor: ExecutorOpt = "local",
    on_invalid: OnInvalidOpt = "error",
    output_format: FormatOpt = "table",
    output: OutputOpt = None,
    column_map: MapOpt = None,
    preset: PresetOpt = None,
    quiet: QuietOpt = False,
) -> None:
    """Recompute advantages from the rewards and compare them with the dump's; on a mismatch, say which common
    variant of the estimator matches (exit 1 with --fail-on-mismatch)."""
    from grpo_cli.commands.advantages import AdvantageCheckConfig, check_advantages, parse_norm_spec
    from grpo_cli.io.storage import to_path
    from grpo_cli.render.advantages import mismatch_line, render_advantages_table
    from grpo_cli.render.documents import json_document, to_csv

    config = config_from(
        AdvantageCheckConfig,
        locals(),
        reward_norm=parse_norm_spec(reward_norm, "--reward-norm"),
        adv_norm=parse_norm_spec(adv_norm, "--adv-norm"),
        std_unbiased=not std_biased,
        device=check_device(device),
    )
    config.validate()
    dataset = open_input(paths, column_map, preset, on_invalid)
    with streaming(dataset, True, executor):
        result = check_advantages(dataset, config, write=None if write is None else to_path(write),
                                  workers=resolve_workers(workers, device))
    warn_skipped(result.metrics)
    if write is not None and not quiet:
        typer.echo(f"wrote {write}", err=True)
    write_result(
        output_format,
        output,
        document=lambda: json_document(command="advantages", inputs=result.inputs, config=result.config,
                                       metrics=result.metrics, omitted=result.omitted, extra=result.extra()),
        csv=lambda: to_csv(result.metrics),
        table=lambda console: render_advantages_table(console, result),
    )
    if fail_on_mismatch and result.mismatch:
        # A mismatch is the check's result, not a failure of the tool: one line (no "error:") and exit 1.
        typer.echo(f"grpo-cli: advantages: {mismatch_line(result)}", err=True)
        raise typer.Exit(EXIT_CHECK_FAILED)


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
