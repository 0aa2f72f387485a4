"""A physically real corpus of rollout dumps: a tiny causal LM trained by an asynchronous GRPO loop, with the faults
that real stacks have injected where they break.

Every number in a dump comes from a forward pass of a real model, and the faults act where they act in a trainer or
an inference engine (a temperature on one side, a renormalised top-k/top-p set, fp8 engine weights, an engine whose
weight refit stopped, re-tokenised responses, a mask or alignment slip in the dump code, a wrong advantage), so the
detectors of :mod:`grpo_cli.findings` are tested on dumps nobody shaped to them.

The model and task are those of :mod:`grpo_cli.commands.sample` (:class:`TinyCausalLM`, reverse a 2–4 digit string),
with two differences that make the run look like RL after supervised fine-tuning: the policy is first trained with
cross-entropy on correct answers for ``sft_steps`` (so it is peaked: most sampled tokens have p > 0.9, as an LLM's
are), and generation is batched over the groups that share an engine snapshot.

The loop (one trainer version per step, AReaL-style):

* ``prompts_per_step`` prompt groups of ``group_size`` samples; group ``g`` is served by rollout worker ``g mod 4``
  at a lag drawn uniformly from ``lags`` (capped by the version); a worker's engine is a bfloat16 copy of the
  weights it last synced (fp8 weights with per-tensor scales when ``engine_fp8``); it samples at
  ``behaviour_temperature`` (default: the trainer's ``temperature``) from the ``top_k``/``top_p`` set and reports
  the processed log-probs (vLLM ``logprobs_mode=processed_logprobs``: after temperature, renormalised over the set);
* the trainer (float32) scores the tokens it was given at ``temperature`` (``new_logp``, version v), recomputes
  ``prox_logp`` with the version v − 1 weights (``prox="recompute"``; ``"old"`` copies the behaviour log-probs, no
  recompute; ``"loglinear"`` uses AReaL's approximation old + (k − 1)/k·(new − old)), ``ref_logp`` with the
  post-SFT weights, then takes ``n_minibatches`` Adam steps of the decoupled PPO loss (:mod:`.sample`).

Faults hit the groups of the first ``round(4 · fault_frac)`` workers (a broken worker serves whole prompts), except
the run-wide ones; :attr:`RunInfo.hit` lists the rows they touched, for localisation tests.

Example:
    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as d:
    ...     info = generate_run(RunSpec(steps=2, prompts_per_step=2, group_size=4, sft_steps=20), d)
    >>> info.n_sequences
    16
"""

from __future__ import annotations

import copy
import math
import random
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from grpo_cli.commands._sample_model import TinyCausalLM
from grpo_cli.commands.sample import _decoupled_ppo_loss, _group_advantages, _reward, _teacher_forced
from grpo_cli.io.writer import RolloutWriter

__all__ = ["WORKERS", "RunInfo", "RunSpec", "generate_run"]

_N_DIGITS = 6
_BOS, _SEP, _EOS = _N_DIGITS, _N_DIGITS + 1, _N_DIGITS + 2
_VOCAB = _N_DIGITS + 3
_MIN_K, _MAX_K = 2, 4
_MODEL = {"d_model": 64, "n_heads": 4, "n_layers": 1, "d_ff": 128}
WORKERS = 4
"""Rollout workers; a partial fault breaks whole workers."""


@dataclass(frozen=True)
class RunSpec:
    """One run of the corpus. Defaults: a healthy asynchronous run (lags 0–3, T = 1, bf16 engine, fp32 trainer).

    Attributes:
        seed: seeds weights, prompts, lags and sampling.
        steps, prompts_per_step, group_size: sizes (one part file per step).
        lags: inclusive range of the per-group lag (capped by the version).
        sft_steps: supervised warm-up steps (cross-entropy on correct answers) before the RL loop.
        lr, n_minibatches: the RL optimiser (Adam) and updates per step.
        lr_scale, lr_scale_from: the learning rate is multiplied by ``lr_scale`` from that step on (a blow-up).
        temperature: the trainer's temperature (and the engine's unless ``behaviour_temperature``).
        behaviour_temperature: the engine samples and reports log-probs at this temperature.
        top_k, top_p: the engine samples from this set and reports log-probs renormalised over it (0 / 1: off).
        extra_tokens: generation stops after k + extra_tokens tokens (the answer needs k + 1).
        short_limit: hit workers stop generating after k tokens (a length limit below the answer's).
        fault_frac: fraction of the rollout workers a per-group fault hits (multiples of 1/4).
        shift: the dump writes ``old_logp`` this many tokens late (+1) or early (−1) in hit sequences.
        mask_fault: ``"prompt"`` (prompt tokens in the loss), ``"missing"`` (the last response token out of it).
        engine_bits: hit workers' engines run fp8 (8) or int4 (4) weights instead of bfloat16 (16).
        weight_sync_from: hit workers' engines stop loading new weights from this step on (the version stamp
            still advances).
        retokenize: hit sequences reach the trainer re-tokenised: one response token (in that fraction of the
            hit sequences) has another id than the sampled one.
        prox: ``"recompute"``, ``"old"`` (hit workers' batches get no proximal recompute) or ``"loglinear"``
            (AReaL's approximation).
        ref_equals: ``"new"``: the dump's ``ref_logp`` of hit rows is the actor's ``new_logp`` tensor.
        duplicate: hit groups are written twice (same ``seq_id``).
        advantage_fault: ``"sign"`` (−A in hit groups), ``"grouping"`` (statistics over groups shifted by half a
            group), ``"unnormalised"`` (hit groups not divided by their std).
        zero_reward: hit groups get reward 0 (a broken reward server).
        metadata: recorded in the dump (e.g. ``{"max_staleness": 6}``).
    """

    seed: int = 0
    steps: int = 8
    prompts_per_step: int = 16
    group_size: int = 8
    lags: tuple[int, int] = (0, 3)
    sft_steps: int = 30
    lr: float = 1e-3
    n_minibatches: int = 4
    lr_scale: float = 1.0
    lr_scale_from: int = 0
    temperature: float = 1.0
    behaviour_temperature: float | None = None
    top_k: int = 0
    top_p: float = 1.0
    extra_tokens: int = 3
    short_limit: bool = False
    fault_frac: float = 1.0
    shift: int = 0
    mask_fault: str | None = None
    engine_bits: int = 16
    weight_sync_from: int | None = None
    retokenize: float = 0.0
    prox: str = "recompute"
    ref_equals: str | None = None
    duplicate: bool = False
    advantage_fault: str | None = None
    zero_reward: bool = False
    metadata: dict[str, Any] = field(default_factory=dict)

    def with_(self, **changes: Any) -> RunSpec:
        """A copy with ``changes``."""
        return replace(self, **changes)


@dataclass(frozen=True)
class RunInfo:
    """What :func:`generate_run` wrote.

    Attributes:
        files: the part files, in step order (file index = position here).
        n_sequences, n_tokens: rows and response tokens written.
        hit: ``(file_index, row)`` of every sequence a per-group fault touched.
    """

    files: list[Path]
    n_sequences: int
    n_tokens: int
    hit: frozenset[tuple[int, int]]


def _engine(model: TinyCausalLM, bits: int) -> TinyCausalLM:
    """The inference engine's copy of ``model``: bfloat16 (``bits`` 16); fp8 e4m3 weights with one scale per tensor
    (8, as fp8 rollout serving stores them); or int4 weights with one scale per output channel (4, as
    GPTQ/AWQ-style quantised rollouts do)."""
    out = copy.deepcopy(model)
    with torch.no_grad():
        for p in out.parameters():
            if bits == 8:
                scale = p.abs().max().clamp_min(1e-12) / 448.0
                p.copy_((p / scale).to(torch.float8_e4m3fn).to(torch.float32) * scale)
            elif bits == 4 and p.dim() == 2:
                scale = p.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 7.0
                p.copy_((p / scale).round().clamp(-8, 7) * scale)
    return out.to(torch.bfloat16).eval()


def _processed_logp(logits: Tensor, temperature: float, top_k: int, top_p: float) -> Tensor:
    """The sampler's log-probs over the vocabulary: after temperature, renormalised over the top-k/top-p set
    (−inf outside it), in float32."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    keep = torch.ones_like(logp, dtype=torch.bool)
    if top_k > 0:
        kth = logp.topk(top_k, dim=-1).values[..., -1:]
        keep &= logp >= kth
    if top_p < 1.0:
        sorted_lp, order = logp.sort(dim=-1, descending=True)
        before = sorted_lp.exp().cumsum(-1) - sorted_lp.exp()  # mass of the tokens ranked above
        keep &= torch.zeros_like(keep).scatter(-1, order, before < top_p)
    if top_k > 0 or top_p < 1.0:
        logp = torch.log_softmax(torch.where(keep, logp, -math.inf), dim=-1)
    return logp


@torch.no_grad()
def _generate(engine: TinyCausalLM, prompts: Tensor, max_new: int, spec: RunSpec, temperature: float,
              gen: torch.Generator) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Sample one response per prompt row; returns (tokens [B, P + max_new] EOS-padded, response length [B],
    behaviour log-probs [B, P + max_new] (prompt positions from the prefill, 0 at position 0), eos [B])."""
    b, p = prompts.shape
    seq = prompts
    done = torch.zeros(b, dtype=torch.bool)
    lengths = torch.zeros(b, dtype=torch.long)
    logps = torch.zeros(b, p + max_new)
    for t in range(max_new):
        logits = engine(seq)
        if t == 0:  # the prefill: teacher-forced prompt log-probs at the engine's temperature
            pre = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
            logps[:, 1:p] = pre.gather(-1, seq[:, 1:, None]).squeeze(-1)
        logp = _processed_logp(logits[:, -1], temperature, spec.top_k, spec.top_p)
        nxt = torch.multinomial(logp.exp(), 1, generator=gen).squeeze(-1)
        active = ~done
        logps[:, p + t] = torch.where(active, logp.gather(-1, nxt[:, None]).squeeze(-1), 0.0)
        lengths += active.long()
        done |= nxt == _EOS
        seq = torch.cat([seq, torch.where(active, nxt, _EOS)[:, None]], dim=1)
        if bool(done.all()):
            break
    tokens = torch.full((b, p + max_new), _EOS, dtype=torch.long)
    tokens[:, : seq.shape[1]] = seq
    return tokens, lengths, logps, done


def _prompt(rng: random.Random) -> list[int]:
    k = rng.randint(_MIN_K, _MAX_K)
    return [_BOS, *(rng.randrange(_N_DIGITS) for _ in range(k)), _SEP]


_SFT_CACHE: dict[tuple[int, int, int], dict[str, Tensor]] = {}


def _sft(policy: TinyCausalLM, spec: RunSpec, rng: random.Random) -> None:
    """Cross-entropy on correct answers (digits reversed, then EOS) for ``spec.sft_steps`` steps (memoised per seed:
    the warm start is the same for every fault of one seed)."""
    key = (spec.seed, spec.sft_steps, spec.extra_tokens)
    if key in _SFT_CACHE:
        policy.load_state_dict(_SFT_CACHE[key])
        rng.setstate(random.Random(spec.seed * 7919 + 1).getstate())
        return
    opt = torch.optim.Adam(policy.parameters(), lr=3e-3)
    for _ in range(spec.sft_steps):
        rows = []
        for _ in range(64):
            prompt = _prompt(rng)
            rows.append(prompt + prompt[1:-1][::-1] + [_EOS])
        width = max(map(len, rows))
        tokens = torch.full((len(rows), width), _EOS)
        target_mask = torch.zeros(len(rows), width, dtype=torch.bool)
        for i, r in enumerate(rows):
            tokens[i, : len(r)] = torch.tensor(r)
            k = (len(r) - 3) // 2
            target_mask[i, k + 2: len(r)] = True
        logp = torch.log_softmax(policy(tokens[:, :-1]), -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
        loss = -(logp * target_mask[:, 1:]).sum() / target_mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    _SFT_CACHE[key] = copy.deepcopy(policy.state_dict())
    rng.setstate(random.Random(spec.seed * 7919 + 1).getstate())


def _advantages(rewards: list[float], group_size: int, fault: str | None, hit: list[bool]) -> list[float]:
    groups = [rewards[i: i + group_size] for i in range(0, len(rewards), group_size)]
    out: list[float] = []
    for g, r in enumerate(groups):
        a = _group_advantages(r)
        if hit[g] and fault == "sign":
            a = [-x for x in a]
        elif hit[g] and fault == "unnormalised":
            mean = math.fsum(r) / len(r)
            a = [x - mean for x in r]
        out += a
    if fault == "grouping":  # statistics over windows shifted by half a group: boundaries do not match group_id
        half = group_size // 2
        rolled = rewards[half:] + rewards[:half]
        shifted = [x for i in range(0, len(rolled), group_size) for x in _group_advantages(rolled[i: i + group_size])]
        shifted = shifted[-half:] + shifted[:-half]
        out = [s if hit[i // group_size] else a for i, (a, s) in enumerate(zip(out, shifted))]
    return out


def generate_run(spec: RunSpec, directory: str | Path) -> RunInfo:
    """Train the tiny LM with asynchronous GRPO under ``spec`` and dump every consumed batch to ``directory``.

    Deterministic for a spec on one machine and torch build: seeded generators, one intra-op thread (restored).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.seed)
            return _run(spec, Path(directory))
    finally:
        torch.set_num_threads(threads)


def _run(spec: RunSpec, directory: Path) -> RunInfo:  # one loop, read top to bottom
    rng = random.Random(spec.seed)
    gen = torch.Generator().manual_seed(spec.seed)
    max_len = _MAX_K + 2 + _MAX_K + spec.extra_tokens
    policy = TinyCausalLM(_VOCAB, max_len, **_MODEL)
    _sft(policy, spec, rng)
    reference = copy.deepcopy(policy).eval()
    optimizer = torch.optim.Adam(policy.parameters(), lr=spec.lr)
    t_engine = spec.behaviour_temperature or spec.temperature
    hit_workers = set(range(round(WORKERS * spec.fault_frac)))
    snapshots: list[TinyCausalLM] = []  # fp32 weights of every version
    engines: dict[tuple[int, int], TinyCausalLM] = {}
    hit_rows: set[tuple[int, int]] = set()
    files: list[Path] = []
    n_seq = n_tok = 0
    seq_id = group_id = 0
    meta = {"temperature": spec.temperature, **spec.metadata}
    with RolloutWriter(directory, metadata=meta, fsync=False) as writer:
        for v in range(spec.steps):
            snapshots.append(copy.deepcopy(policy).eval())
            if spec.lr_scale != 1.0 and v == spec.lr_scale_from:
                for param_group in optimizer.param_groups:
                    param_group["lr"] = spec.lr * spec.lr_scale
            # ---- rollouts: each group from its worker's engine at its lag ----
            plan = []
            for g in range(spec.prompts_per_step):
                worker = g % WORKERS
                hit = worker in hit_workers
                lag = rng.randint(spec.lags[0], min(spec.lags[1], v)) if v >= spec.lags[0] else 0
                version = v - lag
                loaded = version
                if hit and spec.weight_sync_from is not None and version > spec.weight_sync_from:
                    loaded = spec.weight_sync_from  # the refit failed: old weights behind a new version stamp
                plan.append((_prompt(rng), version, loaded, spec.engine_bits if hit else 16, hit))
            rows: list[dict[str, Any]] = []
            by_engine: dict[tuple[int, int, int], list[int]] = {}
            for i, (prompt, _, loaded, fp8, _) in enumerate(plan):
                by_engine.setdefault((loaded, fp8, len(prompt)), []).append(i)
            results: dict[int, tuple[Tensor, Tensor, Tensor, Tensor]] = {}
            for (loaded, fp8, plen), members in sorted(by_engine.items()):
                if (loaded, fp8) not in engines:
                    w = snapshots[loaded]
                    engines[(loaded, fp8)] = _engine(w, fp8)
                prompts = torch.tensor([plan[i][0] for i in members]).repeat_interleave(spec.group_size, 0)
                k = plen - 2
                extra = 0 if spec.short_limit and plan[members[0]][4] else spec.extra_tokens
                out = _generate(engines[(loaded, fp8)], prompts, k + extra, spec, t_engine, gen)
                for j, i in enumerate(members):
                    sl = slice(j * spec.group_size, (j + 1) * spec.group_size)
                    results[i] = tuple(x[sl] for x in out)  # type: ignore[assignment]
            rewards: list[float] = []
            for i, (prompt, version, _, _, hit) in enumerate(plan):
                tokens, lengths, logps, eos = results[i]
                digits = prompt[1:-1]
                p = len(prompt)
                for s in range(spec.group_size):
                    n = p + int(lengths[s])
                    toks = tokens[s, :n].clone()
                    rewards.append(_reward(digits, toks[p:].tolist()))
                    rows.append({"tokens": toks, "old": logps[s, :n].clone(), "prompt": p, "eos": bool(eos[s]),
                                 "version": version, "hit": hit, "group": group_id + i})
            hit_groups = [plan[i][4] for i in range(len(plan))]
            if spec.zero_reward:
                rewards = [0.0 if hit_groups[j // spec.group_size] else r for j, r in enumerate(rewards)]
            adv = _advantages(rewards, spec.group_size, spec.advantage_fault, hit_groups)
            group_id += len(plan)
            # ---- the trainer's view: re-tokenised rows get another id at one response position ----
            for r in rows:
                if r["hit"] and spec.retokenize and rng.random() < spec.retokenize:
                    p, n = r["prompt"], r["tokens"].numel()
                    digits_at = [j for j in range(p, n) if int(r["tokens"][j]) < _N_DIGITS]
                    if digits_at:
                        j = rng.choice(digits_at)
                        r["tokens"][j] = (int(r["tokens"][j]) + 1 + rng.randrange(_N_DIGITS - 1)) % _N_DIGITS
                        r["retok"] = True
            width = max(r["tokens"].numel() for r in rows)
            b = len(rows)
            tokens = torch.full((b, width), _EOS)
            old = torch.zeros(b, width)
            lengths = torch.tensor([r["tokens"].numel() for r in rows])
            for i, r in enumerate(rows):
                tokens[i, : lengths[i]] = r["tokens"]
                old[i, : lengths[i]] = r["old"]
            pos = torch.arange(width)
            inside = pos < lengths[:, None]
            prompt_len = torch.tensor([r["prompt"] for r in rows])
            response = inside & (pos >= prompt_len[:, None])
            row_lag = torch.tensor([v - r["version"] for r in rows], dtype=torch.float32)
            with torch.no_grad():
                new, entropy = _teacher_forced(policy, tokens, spec.temperature)
                prox_rc, _ = _teacher_forced(snapshots[max(v - 1, 0)], tokens, spec.temperature)
                ref, _ = _teacher_forced(reference, tokens, spec.temperature)
            if spec.prox == "old":  # the hit workers' batches skip the recompute
                prox = torch.where(torch.tensor([r["hit"] for r in rows])[:, None], old, prox_rc)
            elif spec.prox == "loglinear":
                alpha = torch.where(row_lag >= 1, (row_lag - 1) / row_lag.clamp_min(1), 0.0)[:, None]
                prox = old + alpha * (new - old)
            else:
                prox = prox_rc
            adv_t = torch.tensor(adv, dtype=torch.float32)
            # ---- train: decoupled PPO minibatches -> version v + 1 ----
            policy.train()
            order = list(range(b))
            rng.shuffle(order)
            per_mb = math.ceil(b / spec.n_minibatches)
            for start in range(0, b, per_mb):
                mb = torch.tensor(order[start: start + per_mb])
                logp, _ = _teacher_forced(policy, tokens[mb], spec.temperature)
                loss = _decoupled_ppo_loss(logp, prox[mb], old[mb], adv_t[mb, None], response[mb])
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
            policy.eval()
            # ---- the dump, with the dump code's own faults ----
            dump_old = old.clone()
            mask = response.clone()
            versions = torch.where(response, torch.tensor([r["version"] for r in rows])[:, None], -1)
            for i, r in enumerate(rows):
                if not r["hit"]:
                    continue
                n, p = int(lengths[i]), r["prompt"]
                if spec.shift:
                    dump_old[i, :n] = torch.roll(old[i, :n], spec.shift)
                if spec.mask_fault == "prompt":
                    mask[i, 1:p] = True
                elif spec.mask_fault == "missing" and n > p:
                    mask[i, n - 1] = False
            hit_row = torch.tensor([r["hit"] for r in rows])[:, None]
            ref_out = torch.where(hit_row, new, ref) if spec.ref_equals == "new" else ref
            step_rows = list(range(b))
            if spec.duplicate:
                step_rows += [i for i, r in enumerate(rows) if r["hit"]]
            idx = torch.tensor(step_rows)
            ids = torch.arange(seq_id, seq_id + b)
            writer.add(
                step=v, new_logp=new[idx], old_logp=dump_old[idx], prox_logp=prox[idx], ref_logp=ref_out[idx],
                entropy=entropy[idx], loss_mask=mask[idx], versions=versions[idx], lengths=lengths[idx],
                advantages=adv_t[idx], rewards=torch.tensor(rewards)[idx], current_version=v,
                group_id=torch.tensor([r["group"] for r in rows])[idx], seq_id=ids[idx],
                eos=torch.tensor([int(r["eos"]) for r in rows])[idx],
            )
            faulty = (spec.shift or spec.mask_fault or spec.engine_bits != 16 or spec.weight_sync_from is not None
                      or spec.advantage_fault or spec.zero_reward or spec.duplicate or spec.short_limit)
            for row, i in enumerate(step_rows):
                touched = (rows[i].get("retok") or (faulty and rows[i]["hit"])
                           or (spec.duplicate and row >= b))
                if touched and not (spec.weight_sync_from is not None and rows[i]["version"] <= spec.weight_sync_from
                                    and spec.engine_bits == 16):
                    hit_rows.add((v, row))
            seq_id += b
            n_seq += len(step_rows)
            n_tok += int(response[idx].sum())
    files = sorted(directory.glob("part-*.parquet"))
    return RunInfo(files, n_seq, n_tok, frozenset(hit_rows))
