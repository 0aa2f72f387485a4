"""A simulator of realistic GRPO/PPO rollout dumps with switchable faults, for the diagnosis detectors.

The "model" is a per-token categorical policy over a small vocabulary whose logits depend on the previous token
(a Markov chain, ``logits[v][prev] ∈ R^V``) and drift with the policy version as a random walk in logit space
(``W[v] = W[0] + Σ_{u ≤ v} drift·ε_u``), so neighbouring versions are close and far ones are not, like successive
optimiser steps. Token 0 is EOS.

One training step ``s`` (trainer version ``v = s + max_lag``):

* ``prompts_per_step`` prompts (uniform random tokens, masked: loss_mask 0, versions −1), each sampled
  ``group_size`` times by a behaviour "engine" at version ``v − lag`` (lag drawn per group from ``lags``): logits
  rounded to bfloat16 (as vLLM/SGLang run the model), divided by the engine temperature, optionally truncated to
  the top-p set; responses end at EOS (``eos = 1``) or at ``max_new_tokens`` (``eos = 0``);
* ``old_logp`` = the engine's log-prob of each token (bf16 logits plus Gaussian kernel noise of
  ``kernel_noise`` on every logit, the numerical difference of a different kernel); the sampling itself uses the
  bf16 logits without that noise;
* ``new_logp`` = the trainer's float32 log-prob at version ``v`` (temperature ``temperature``), ``prox_logp`` at
  ``v − 1`` (the proximal policy of decoupled PPO), ``ref_logp`` at version 0, ``entropy`` of the trainer's
  distribution;
* rewards ~ Bernoulli(q_g) with a per-prompt success rate q_g ~ U(0.15, 0.85); advantages are GRPO's
  ``(r − mean_g r) / (std_g r + 1e-6)`` with the unbiased std (TRL ``GRPOTrainer``), one value per sequence.

Faults (:class:`SimConfig` fields) hit a fraction ``fault_frac`` of the prompt groups of every step (a broken
rollout worker serves whole prompts), except the run-wide ones (entropy collapse and too-large updates, which hit
the last ``fault_frac`` of the versions). Everything is drawn from ``torch.Generator``\\ s seeded by ``seed``, so a
config gives bit-identical files on one machine and torch build.

Example:
    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as d:
    ...     info = simulate(healthy_small(), d)
    >>> info.n_sequences
    32
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import Tensor

from grpo_cli.io import RolloutWriter

__all__ = [
    "FAULTS",
    "HEALTHY",
    "SimConfig",
    "SimInfo",
    "fault_config",
    "healthy_async",
    "healthy_on_policy",
    "healthy_small",
    "healthy_tempered",
    "simulate",
]

EOS = 0


@dataclass(frozen=True)
class SimConfig:
    """What to simulate. Defaults: a healthy asynchronous run (lags 0–3, T = 1, no truncation).

    Attributes:
        seed: seeds every random draw.
        steps, prompts_per_step, group_size: sizes (one part file per step).
        vocab: vocabulary size (token 0 is EOS).
        prompt_len: inclusive range of prompt lengths.
        max_new_tokens: response length limit (responses cut there get ``eos = 0``).
        eos_prob: EOS probability at version 0 in every context (sets the typical response length).
        logit_scale: scale of the initial logits (sets the entropy).
        drift: scale of one version's random-walk step in logit space.
        lags: inclusive range of the per-group lag ``current_version − versions``.
        temperature: sampling temperature of the engine and the trainer.
        kernel_noise: std of the Gaussian noise on the engine's logits (train/inference numerics).
        on_policy_exact: the dump's ``old_logp`` is the trainer's own recompute (``old == new`` bitwise, lag 0).
        columns: optional per-token columns to write.
        fault_frac: fraction of prompt groups (or of versions, for run-wide faults) a fault hits.
        shift: write ``old_logp`` shifted by this many tokens within each sequence (+1: one token late).
        behaviour_temperature: the engine samples and scores at this temperature, the trainer at ``temperature``.
        top_p: the engine samples from the top-p set and reports log-probs renormalised over it.
        mask_fault: ``"prompt"`` (prompt tokens in the loss, old_logp 0 there), ``"padding"`` (8 padding tokens
            with every log-prob 0 in the loss), ``"missing"`` (a quarter of the response tokens out of the loss).
        weight_sync_rate: the engine's weights lag by ``floor(rate · step)`` versions more than ``versions``
            records (the weight sync stops working after step 0).
        mismatch_noise: std of extra Gaussian noise on the engine's logits.
        advantage_fault: ``"sign"`` (A → −A), ``"grouping"`` (group statistics over a window shifted by half a
            group), ``"normalisation"`` (divided by the group variance instead of the std).
        zero_variance: the hit groups get all-equal rewards.
        ref_equals: ``"old"`` or ``"new"``: ``ref_logp`` is a copy of that column.
        duplicate: the hit groups are written twice (same seq_id).
        entropy_collapse: the logits of version v are multiplied by ``1 + entropy_collapse · v'`` (v' counts the
            hit versions).
        truncation: the hit groups almost never emit EOS.
        update_scale: the hit versions take a random-walk step this many times larger (too-large updates).
        heavy_tail_frac: fraction of the hit sequences' response tokens whose engine log-prob is lowered by the
            magnitude of a heavy-tailed (Student-t-like, ν = 1.5) draw of scale 1: w = exp(new − old) gets a heavy
            upper tail, as low-probability tokens do under kernel mismatch.
        stale_lags: the hit groups draw their lag from this inclusive range instead of ``lags`` (a rollout worker
            far behind the trainer).
    """

    seed: int = 0
    steps: int = 6
    prompts_per_step: int = 16
    group_size: int = 8
    vocab: int = 48
    prompt_len: tuple[int, int] = (4, 12)
    max_new_tokens: int = 48
    eos_prob: float = 0.07
    logit_scale: float = 3.0
    drift: float = 0.04
    lags: tuple[int, int] = (0, 3)
    temperature: float = 1.0
    kernel_noise: float = 0.01
    on_policy_exact: bool = False
    columns: tuple[str, ...] = ("prox_logp", "ref_logp", "entropy", "versions")
    fault_frac: float = 1.0
    shift: int = 0
    behaviour_temperature: float | None = None
    top_p: float = 1.0
    mask_fault: str | None = None
    weight_sync_rate: float = 0.0
    mismatch_noise: float = 0.0
    advantage_fault: str | None = None
    zero_variance: bool = False
    ref_equals: str | None = None
    duplicate: bool = False
    entropy_collapse: float = 0.0
    truncation: bool = False
    update_scale: float = 1.0
    heavy_tail_frac: float = 0.0
    stale_lags: tuple[int, int] | None = None
    metadata: dict[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class SimInfo:
    """What :func:`simulate` wrote.

    Attributes:
        files: the part files, in step order.
        n_sequences: rows written (duplicates included).
        n_tokens: tokens written.
        hit: ``(file_index, row)`` of every sequence a per-group fault hit.
    """

    files: list[Path]
    n_sequences: int
    n_tokens: int
    hit: frozenset[tuple[int, int]]


def healthy_async(**overrides: object) -> SimConfig:
    """A healthy asynchronous run: lags 0–3, T = 1, bf16 engine."""
    return replace(SimConfig(), **overrides)


def healthy_on_policy(**overrides: object) -> SimConfig:
    """Strictly on-policy: ``old_logp`` is the trainer's recompute, bitwise equal to ``new_logp``."""
    return replace(SimConfig(lags=(0, 0), on_policy_exact=True), **overrides)


def healthy_tempered(**overrides: object) -> SimConfig:
    """The same non-1 temperature (0.7) on the engine and in the trainer."""
    return replace(SimConfig(temperature=0.7), **overrides)


def healthy_small(**overrides: object) -> SimConfig:
    """A small dump (32 sequences, about 2k tokens)."""
    return replace(SimConfig(steps=2, prompts_per_step=4, group_size=4, max_new_tokens=40), **overrides)


HEALTHY: dict[str, SimConfig] = {
    "async": healthy_async(),
    "on_policy": healthy_on_policy(),
    "tempered": healthy_tempered(),
    "small": healthy_small(),
}

#: Each fault's injection (as :class:`SimConfig` overrides) and the category a detector must report.
FAULTS: dict[str, tuple[dict[str, object], str]] = {
    "shift_late": ({"shift": 1}, "alignment"),
    "shift_early": ({"shift": -1}, "alignment"),
    "temperature": ({"behaviour_temperature": 0.6}, "temperature"),
    "top_p": ({"top_p": 0.8}, "truncated-sampling"),
    "mask_prompt": ({"mask_fault": "prompt"}, "mask"),
    "mask_padding": ({"mask_fault": "padding"}, "mask"),
    "mask_missing": ({"mask_fault": "missing"}, "mask"),
    "weight_sync": ({"weight_sync_rate": 1.0, "steps": 8}, "weight-sync"),
    "mismatch": ({"mismatch_noise": 0.6}, "mismatch"),
    "adv_sign": ({"advantage_fault": "sign"}, "advantage"),
    "adv_grouping": ({"advantage_fault": "grouping"}, "advantage"),
    "adv_normalisation": ({"advantage_fault": "normalisation"}, "advantage"),
    "zero_variance": ({"zero_variance": True}, "no-signal"),
    "ref_old": ({"ref_equals": "old"}, "reference"),
    "ref_new": ({"ref_equals": "new"}, "reference"),
    "duplicates": ({"duplicate": True}, "duplicates"),
    "entropy_collapse": ({"entropy_collapse": 0.6, "steps": 8}, "entropy-collapse"),
    "truncation": ({"truncation": True}, "length-truncation"),
    "clipping": ({"update_scale": 12.0}, "clipping"),
    "heavy_tails": ({"heavy_tail_frac": 0.05}, "importance-weights"),
    "staleness": ({"stale_lags": (5, 12)}, "staleness"),
    "prox_lag": ({"stale_lags": (4, 12), "drift": 0.1}, "prox-approximation"),
}


def fault_config(name: str, frac: float = 1.0, **overrides: object) -> SimConfig:
    """The healthy asynchronous config with fault ``name`` of :data:`FAULTS` hitting ``frac`` of the groups."""
    changes, _ = FAULTS[name]
    return replace(SimConfig(), fault_frac=frac, **{**changes, **overrides})


# -- the policy ----------------------------------------------------------------------------------------------------
def _version_tables(cfg: SimConfig, n_versions: int, hit_versions: Tensor, gen: torch.Generator) -> Tensor:
    """``[n_versions, V, V]`` float32 logits: a random walk from ``W[0]``, EOS offset, entropy-collapse scale."""
    v = cfg.vocab
    base = torch.randn(v, v, generator=gen) * cfg.logit_scale
    steps = torch.randn(n_versions, v, v, generator=gen) * cfg.drift
    steps[0] = 0.0
    big = hit_versions.float() * (cfg.update_scale - 1.0) + 1.0
    walk = torch.cumsum(steps * big[:, None, None], dim=0)
    tables = base + walk
    others = torch.logsumexp(tables[0, :, 1:], dim=-1)
    tables[:, :, EOS] += (others + math.log(cfg.eos_prob / (1.0 - cfg.eos_prob)) - tables[0, :, EOS])[None, :]
    if cfg.entropy_collapse:
        collapse = torch.cumsum(hit_versions.float(), 0) * cfg.entropy_collapse
        tables = tables * (1.0 + collapse)[:, None, None]
    return tables


def _top_p_keep(logits: Tensor, top_p: float) -> Tensor:
    """Boolean ``[N, V]`` of the top-p set (the smallest prefix of the sorted probabilities with mass ≥ top_p)."""
    if top_p >= 1.0:
        return torch.ones_like(logits, dtype=torch.bool)
    probs = torch.softmax(logits, dim=-1)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    before = torch.cumsum(sorted_p, dim=-1) - sorted_p
    keep_sorted = before < top_p
    keep = torch.zeros_like(keep_sorted)
    keep.scatter_(-1, order, keep_sorted)
    return keep


def _engine_logits(tables: Tensor, version: Tensor, prev: Tensor, temperature: Tensor) -> Tensor:
    """Engine logits: bf16-rounded, divided by the (per-row) temperature, in float32."""
    raw = tables[version, prev].to(torch.bfloat16).to(torch.float32)
    return raw / temperature[:, None]


def _trainer_logp(tables: Tensor, version: Tensor, prev: Tensor, tokens: Tensor, temperature: float) -> Tensor:
    logits = tables[version, prev] / temperature
    return torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None]).squeeze(1)


def _pick(n: int, frac: float, gen: torch.Generator) -> Tensor:
    """A bool ``[n]`` with exactly ``round(frac·n)`` True entries at random places."""
    k = round(frac * n)
    hit = torch.zeros(n, dtype=torch.bool)
    hit[torch.randperm(n, generator=gen)[:k]] = True
    return hit


def _group_advantages(rewards: Tensor, group: int, fault: str | None, hit_groups: Tensor) -> Tensor:
    """GRPO advantages of ``[n_groups·group]`` rewards, with the advantage fault on the hit groups."""
    r = rewards.view(-1, group).double()
    adv = (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)
    if fault == "sign":
        adv = torch.where(hit_groups[:, None], -adv, adv)
    elif fault == "normalisation":
        wrong = (r - r.mean(1, keepdim=True)) / (r.var(1, keepdim=True) + 1e-6)
        adv = torch.where(hit_groups[:, None], wrong, adv)
    elif fault == "grouping":
        half = group // 2
        rolled = torch.roll(rewards.double(), -half).view(-1, group)
        mean = torch.roll(rolled.mean(1, keepdim=True).expand(-1, group).reshape(-1), half).view(-1, group)
        std = torch.roll(rolled.std(1, keepdim=True).expand(-1, group).reshape(-1), half).view(-1, group)
        wrong = (r - mean) / (std + 1e-6)
        adv = torch.where(hit_groups[:, None], wrong, adv)
    return adv.reshape(-1).float()


# -- the run -------------------------------------------------------------------------------------------------------
def simulate(cfg: SimConfig, out_dir: str | Path) -> SimInfo:
    """Write the dump ``cfg`` describes to ``out_dir`` (one part file per step) and say what was written.

    Runs with one intra-op thread (restored afterwards): the tensors are small, and several threads only wait
    on each other.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _simulate(cfg, out_dir)
    finally:
        torch.set_num_threads(threads)


def _simulate(cfg: SimConfig, out_dir: str | Path) -> SimInfo:
    gen = torch.Generator().manual_seed(cfg.seed)
    lo, hi = cfg.lags
    offset = max(hi, 1, cfg.stale_lags[1] if cfg.stale_lags else 0)
    n_versions = cfg.steps + offset + 1
    hit_versions = torch.zeros(n_versions, dtype=torch.bool)
    n_hit_versions = round(cfg.fault_frac * cfg.steps)
    if n_hit_versions:  # the trainer versions of the last steps (step s trains version s + offset)
        hit_versions[offset + cfg.steps - n_hit_versions: offset + cfg.steps] = True
    tables = _version_tables(cfg, n_versions, hit_versions, gen)
    g = cfg.group_size
    files: list[Path] = []
    hit_rows: set[tuple[int, int]] = set()
    n_seq_total = n_tok_total = 0
    seq_counter = 0
    metadata = {"framework": "simulate", "temperature": cfg.temperature, **cfg.metadata}
    with RolloutWriter(out_dir, metadata=metadata) as writer:
        for step in range(cfg.steps):
            current = step + offset
            n_groups = cfg.prompts_per_step
            b = n_groups * g
            hit_groups = _pick(n_groups, cfg.fault_frac, gen)
            hit_seq = hit_groups.repeat_interleave(g)
            lag = torch.randint(lo, hi + 1, (n_groups,), generator=gen)
            if cfg.stale_lags is not None:
                stale = torch.randint(cfg.stale_lags[0], cfg.stale_lags[1] + 1, (n_groups,), generator=gen)
                lag = torch.where(hit_groups, stale, lag)
            lag = lag.repeat_interleave(g)
            if cfg.on_policy_exact:
                lag.zero_()
            behaviour = (current - lag).clamp_min(0)
            engine_version = behaviour.clone()
            if cfg.weight_sync_rate:
                extra = math.floor(cfg.weight_sync_rate * step)
                engine_version = torch.where(hit_seq, (behaviour - extra).clamp_min(0), behaviour)
            t_engine = torch.full((b,), cfg.temperature)
            if cfg.behaviour_temperature is not None:
                t_engine = torch.where(hit_seq, torch.tensor(cfg.behaviour_temperature), t_engine)
            top_p = torch.where(hit_seq, torch.tensor(cfg.top_p), torch.tensor(1.0))
            eos_penalty = torch.where(hit_seq & torch.tensor(cfg.truncation), torch.tensor(-30.0), torch.tensor(0.0))

            # prompts: one per group, shared by its samples
            p_len = torch.randint(cfg.prompt_len[0], cfg.prompt_len[1] + 1, (n_groups,), generator=gen)
            p_max = int(p_len.max())
            prompts = torch.randint(1, cfg.vocab, (n_groups, p_max), generator=gen)
            p_len_seq = p_len.repeat_interleave(g)
            prompts_seq = prompts.repeat_interleave(g, dim=0)

            # responses: sampled token by token by the engine (bf16 logits, engine temperature, top-p)
            width = p_max + cfg.max_new_tokens
            tokens = torch.zeros(b, width, dtype=torch.int64)
            tokens[:, :p_max] = prompts_seq
            resp = torch.zeros(b, cfg.max_new_tokens, dtype=torch.int64)
            resp_len = torch.full((b,), cfg.max_new_tokens)
            alive = torch.ones(b, dtype=torch.bool)
            prev = prompts_seq.gather(1, (p_len_seq - 1)[:, None]).squeeze(1)
            truncated = [(p, top_p == p) for p in top_p.unique().tolist() if p < 1.0]
            for t in range(cfg.max_new_tokens):
                logits = _engine_logits(tables, engine_version, prev, t_engine)
                logits[:, EOS] += eos_penalty
                keep = torch.ones_like(logits, dtype=torch.bool)
                for p, rows in truncated:
                    keep[rows] = _top_p_keep(logits[rows], p)
                gumbel = -torch.log(-torch.log(torch.rand(logits.shape, generator=gen).clamp_min(1e-20)))
                choice = torch.where(keep, logits + gumbel, torch.tensor(-torch.inf)).argmax(1)
                choice = torch.where(alive, choice, torch.zeros_like(choice))
                resp[:, t] = choice
                ended = alive & (choice == EOS)
                resp_len = torch.where(ended, torch.tensor(t + 1), resp_len)
                alive = alive & ~ended
                prev = choice
                if not bool(alive.any()):
                    break
            eos = (resp_len < cfg.max_new_tokens) | (resp.gather(1, (resp_len - 1)[:, None]).squeeze(1) == EOS)
            lengths = p_len_seq + resp_len
            # place each response right after its prompt
            j = torch.arange(cfg.max_new_tokens)
            placed = j[None, :] < resp_len[:, None]
            seq_idx = torch.arange(b)[:, None].expand(-1, cfg.max_new_tokens)
            tokens[seq_idx[placed], (p_len_seq[:, None] + j[None, :])[placed]] = resp[placed]
            width = int(lengths.max())
            tokens = tokens[:, :width]
            pos = torch.arange(width)
            exists = pos[None, :] < lengths[:, None]
            is_response = exists & (pos[None, :] >= p_len_seq[:, None])
            predicted = exists & (pos[None, :] >= 1)

            # per-token log-probs of every predicted position (prompt and response)
            rows, cols = torch.nonzero(predicted, as_tuple=True)
            tok = tokens[rows, cols]
            prv = tokens[rows, cols - 1]
            cur = torch.full_like(rows, current)
            new = _trainer_logp(tables, cur, prv, tok, cfg.temperature)
            prox = _trainer_logp(tables, cur - 1, prv, tok, cfg.temperature)
            ref = _trainer_logp(tables, torch.zeros_like(rows), prv, tok, cfg.temperature)
            full = torch.log_softmax(tables[cur, prv] / cfg.temperature, dim=-1)
            ent = -(full.exp() * full).sum(-1)
            eng = _engine_logits(tables, engine_version[rows], prv, t_engine[rows])
            keep = torch.ones_like(eng, dtype=torch.bool)
            tp = top_p[rows]
            resp_tok = is_response[rows, cols]
            for p in tp.unique().tolist():
                if p < 1.0:  # the set the engine sampled from (before kernel noise), which holds the sampled token
                    sel = (tp == p) & resp_tok
                    keep[sel] = _top_p_keep(eng[sel], p)
            keep[torch.arange(tok.numel()), tok] = True
            extra_noise = torch.where(hit_seq[rows], torch.tensor(cfg.mismatch_noise), torch.tensor(0.0))
            noise_std = cfg.kernel_noise + extra_noise
            eng = eng + torch.randn(eng.shape, generator=gen) * noise_std[:, None]
            eng = torch.where(keep, eng, torch.tensor(-torch.inf))
            old = torch.log_softmax(eng, dim=-1).gather(1, tok[:, None]).squeeze(1)
            if cfg.heavy_tail_frac:
                tail = hit_seq[rows] & resp_tok & (torch.rand(rows.shape, generator=gen) < cfg.heavy_tail_frac)
                t_noise = _student_t(rows.numel(), 1.5, gen)
                old = torch.where(tail, old - t_noise.abs(), old)
            if cfg.on_policy_exact:
                old = new.clone()
                prox = new.clone()

            new_d, old_d, prox_d, ref_d, ent_d = (_dense(x, rows, cols, (b, width)) for x in (new, old, prox, ref, ent))
            mask = is_response.clone()
            versions = torch.where(is_response, behaviour[:, None], torch.tensor(-1)).to(torch.int32)

            # -- per-sequence faults ------------------------------------------------------------------------------
            if cfg.shift:
                shifted = torch.roll(old_d, cfg.shift, dims=1)
                if cfg.shift > 0:
                    shifted[:, : cfg.shift] = 0.0
                else:
                    shifted = torch.where(pos[None, :] >= (lengths + cfg.shift)[:, None], 0.0, shifted)
                old_d = torch.where(hit_seq[:, None], shifted, old_d)
            if cfg.mask_fault == "prompt":
                prompt_part = exists & ~is_response & hit_seq[:, None]
                mask = mask | prompt_part
                old_d = torch.where(prompt_part, 0.0, old_d)
            elif cfg.mask_fault == "missing":
                drop = is_response & hit_seq[:, None] & (torch.rand(b, width, generator=gen) < 0.25)
                mask = mask & ~drop
            if cfg.ref_equals == "old":
                ref_d = torch.where(hit_seq[:, None], old_d, ref_d)
            elif cfg.ref_equals == "new":
                ref_d = torch.where(hit_seq[:, None], new_d, ref_d)
            if cfg.mask_fault == "padding":
                pad = 8
                pad_len = torch.where(hit_seq, pad, 0)
                grow = torch.zeros(b, pad)
                padded = [torch.cat([x, grow], 1) for x in (new_d, old_d, prox_d, ref_d, ent_d)]
                new_d, old_d, prox_d, ref_d, ent_d = padded
                mask = torch.cat([mask, torch.zeros(b, pad, dtype=torch.bool)], 1)
                versions = torch.cat([versions, torch.full((b, pad), -1, dtype=torch.int32)], 1)
                wpos = torch.arange(width + pad)
                pad_part = (wpos[None, :] >= lengths[:, None]) & (wpos[None, :] < (lengths + pad_len)[:, None])
                mask = mask | pad_part
                lengths = lengths + pad_len

            # rewards and advantages
            q = torch.rand(n_groups, generator=gen) * 0.7 + 0.15
            if cfg.zero_variance:
                q = torch.where(hit_groups, (torch.rand(n_groups, generator=gen) < 0.5).float(), q)
            rewards = (torch.rand(b, generator=gen) < q.repeat_interleave(g)).float()
            adv = _group_advantages(rewards, g, cfg.advantage_fault, hit_groups)

            group_id = torch.arange(n_groups).repeat_interleave(g) + step * n_groups
            seq_id = torch.arange(b) + seq_counter
            seq_counter += b
            order = torch.arange(b)
            if cfg.duplicate:
                order = torch.cat([order, torch.nonzero(hit_seq).flatten()])

            take = _Take(order)
            token_cols: dict[str, Tensor] = {"old_logp": take(old_d)}
            optional = {"prox_logp": prox_d, "ref_logp": ref_d, "entropy": ent_d, "versions": versions}
            for name in cfg.columns:
                token_cols[name] = take(optional[name])
            writer.add(
                step=step,
                new_logp=take(new_d),
                loss_mask=take(mask).to(torch.int8),
                lengths=take(lengths),
                advantages=take(adv),
                rewards=take(rewards),
                current_version=current,
                group_id=take(group_id),
                seq_id=take(seq_id),
                eos=take(eos.to(torch.int8)),
                **token_cols,
            )
            file_index = len(files)
            files.append(Path(out_dir) / f"part-step{step:06d}-rank000.parquet")
            hit_index = torch.nonzero(take(hit_seq)).flatten().tolist()
            hit_rows.update((file_index, r) for r in hit_index)
            n_seq_total += order.numel()
            n_tok_total += int(take(lengths).sum())
    return SimInfo(files=files, n_sequences=n_seq_total, n_tokens=n_tok_total, hit=frozenset(hit_rows))


def _dense(values: Tensor, rows: Tensor, cols: Tensor, shape: tuple[int, int]) -> Tensor:
    out = torch.zeros(shape, dtype=torch.float32)
    out[rows, cols] = values.float()
    return out


class _Take:
    """Rows of a per-sequence tensor in write order (duplicates repeated)."""

    def __init__(self, order: Tensor) -> None:
        self.order = order

    def __call__(self, x: Tensor) -> Tensor:
        return x.index_select(0, self.order)


def _student_t(n: int, nu: float, gen: torch.Generator) -> Tensor:
    """``n`` heavy-tailed draws like Student-t with ν degrees of freedom, z / sqrt(χ²_ν / ν), from a seeded generator.

    χ²_ν comes from the Wilson–Hilferty normal approximation (``torch.distributions.Gamma`` takes no generator),
    floored so the draw stays finite; the tails are what matters here, not the exact law.
    """
    z = torch.randn(n, generator=gen)
    w = torch.randn(n, generator=gen)
    h = 2.0 / (9.0 * nu)
    chi = (nu * (1.0 - h + w * math.sqrt(h)).clamp_min(0.05) ** 3).clamp_min(1e-3)
    return z / torch.sqrt(chi / nu)
