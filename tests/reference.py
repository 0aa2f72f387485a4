"""Independent float64 references in plain Python (loops over sequences and tokens), for tests only.

Nothing here imports grpo_cli: figures are recomputed from their written definitions so that a test compares the
implementation with the definition, never with itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


@dataclass
class Seq:
    new: list[float]
    old: list[float] | None = None
    prox: list[float] | None = None
    ref: list[float] | None = None
    entropy: list[float] | None = None
    mask: list[int] | None = None
    versions: list[int] | None = None
    advantage: float | None = None
    reward: float | None = None
    current_version: int | None = None
    step: int | None = None
    group_id: int | None = None
    extra: dict = field(default_factory=dict)

    def valid(self) -> list[int]:
        mask = self.mask if self.mask is not None else [1] * len(self.new)
        return [t for t, m in enumerate(mask) if m]


def policy_reference(seqs: list[Seq], eps: float = 0.2, eps_high: float | None = None) -> dict[str, float]:
    """The GRPOMetric-family figures (analyze keys) by their definitions; ratio base = prox if given else old."""
    eps_high = eps if eps_high is None else eps_high
    lo, hi = np.float32(1 - eps), np.float32(1 + eps_high)  # float32 data compares against float32 bounds
    n = 0
    s_new = s_old = s_diff = s_k3 = 0.0
    k3_max = ratio_max = -math.inf
    clip_low = clip_high = c_low = c_high = 0
    seqs_used = seq_low = seq_high = 0
    ent_n, ent_s = 0, 0.0
    for s in seqs:
        idx = s.valid()
        log_ratios, advs = [], []
        for t in idx:
            new = float(s.new[t])
            n += 1
            s_new += new
            if s.entropy is not None:
                ent_n += 1
                ent_s += float(s.entropy[t])
            if s.old is not None:
                d = new - float(s.old[t])
                s_old += float(s.old[t])
                s_diff += d
                k3 = math.exp(d) - 1 - d
                s_k3 += k3
                k3_max = max(k3_max, k3)
            base = s.prox if s.prox is not None else s.old
            if base is not None:
                lr = float(np.float32(s.new[t]) - np.float32(base[t]))
                r = np.float32(math.exp(lr))
                ratio_max = max(ratio_max, float(r))
                c_low += r < lo
                c_high += r > hi
                if s.advantage is not None:
                    a = s.advantage
                    clip_low += (r < lo) and a < 0
                    clip_high += (r > hi) and a > 0
                    log_ratios.append(lr)
                    advs.append(a)
        if log_ratios:
            seqs_used += 1
            sr = np.float32(math.exp(sum(log_ratios) / len(log_ratios)))
            a = sum(advs) / len(advs)
            seq_low += (sr < lo) and a < 0
            seq_high += (sr > hi) and a > 0
    out: dict[str, float] = {"n_valid_tokens": n, "logp/new_mean": s_new / n,
                             "policy_confidence": math.exp(s_new / n)}
    if ent_n:
        out["entropy/mean"] = ent_s / ent_n
    if seqs and seqs[0].old is not None:
        out.update({"logp/old_mean": s_old / n, "logp/diff_mean": s_diff / n, "kl/k3": s_k3 / n,
                    "kl/k3_token_max": k3_max})
    if ratio_max > -math.inf:
        out.update({"ratio/max": ratio_max, "clip/cispo_low": c_low / n, "clip/cispo_high": c_high / n,
                    "clip/cispo": (c_low + c_high) / n})
        if seqs[0].advantage is not None:
            out.update({"clip/low": clip_low / n, "clip/high": clip_high / n,
                        "clip/ratio": (clip_low + clip_high) / n, "clip/seq_low": seq_low / seqs_used,
                        "clip/seq_high": seq_high / seqs_used, "clip/seq_ratio": (seq_low + seq_high) / seqs_used})
    return out


def random_sequences(
    n_seq: int = 60, seed: int = 0, *, with_prox: bool = False, max_len: int = 40, spread: float = 0.3
) -> list[Seq]:
    """Random but plausible sequences: log-probs ≤ 0, old/prox near new, prompt tokens masked."""
    rng = np.random.default_rng(seed)
    seqs = []
    for i in range(n_seq):
        length = int(rng.integers(1, max_len))
        prompt = int(rng.integers(0, min(5, length)))
        new = -rng.exponential(1.0, length).astype(np.float32)
        old = np.minimum(new + rng.normal(0, spread, length), 0).astype(np.float32)
        prox = np.minimum(new + rng.normal(0, spread, length), 0).astype(np.float32)
        mask = [0] * prompt + [1] * (length - prompt)
        current = int(rng.integers(2, 8))
        versions = [-1] * prompt + [int(current - rng.integers(0, 3)) for _ in range(length - prompt)]
        seqs.append(Seq(
            new=new.tolist(), old=old.tolist(), prox=prox.tolist() if with_prox else None,
            ref=np.minimum(new + rng.normal(0, 0.1, length), 0).astype(np.float32).tolist(),
            entropy=rng.random(length).astype(np.float32).tolist(), mask=mask, versions=versions,
            advantage=float(np.float32(rng.normal())), reward=float(rng.integers(0, 2)), current_version=current,
            step=i // 10, group_id=i // 4,
        ))
    return seqs


def write_sequences(path: str, seqs: list[Seq], *, row_group_size: int = 16, token_layout: bool = False) -> None:
    """Write sequences as a schema-v1 file (sequence-per-row, or token-per-row with ``seq_id``)."""
    f32 = pa.float32()
    cols: dict[str, pa.Array] = {}
    first = seqs[0]
    per_token = {"new_logp": "new", "old_logp": "old", "prox_logp": "prox", "ref_logp": "ref", "entropy": "entropy"}
    if not token_layout:
        for name, attr in per_token.items():
            if getattr(first, attr) is not None:
                cols[name] = pa.array([getattr(s, attr) for s in seqs], pa.list_(f32))
        if first.mask is not None:
            cols["loss_mask"] = pa.array([s.mask for s in seqs], pa.list_(pa.int8()))
        if first.versions is not None:
            cols["versions"] = pa.array([s.versions for s in seqs], pa.list_(pa.int32()))
        seq_cols = {"advantages": ("advantage", f32), "rewards": ("reward", f32),
                    "current_version": ("current_version", pa.int64()), "step": ("step", pa.int64()),
                    "group_id": ("group_id", pa.int64())}
        for name, (attr, typ) in seq_cols.items():
            if getattr(first, attr) is not None:
                cols[name] = pa.array([getattr(s, attr) for s in seqs], typ)
        cols["seq_id"] = pa.array(list(range(len(seqs))), pa.int64())
    else:
        def tok(attr: str) -> list:
            return [v for s in seqs for v in getattr(s, attr)]

        def rep(attr: str) -> list:
            return [getattr(s, attr) for s in seqs for _ in s.new]

        for name, attr in per_token.items():
            if getattr(first, attr) is not None:
                cols[name] = pa.array(tok(attr), f32)
        if first.mask is not None:
            cols["loss_mask"] = pa.array(tok("mask"), pa.int8())
        if first.versions is not None:
            cols["versions"] = pa.array(tok("versions"), pa.int32())
        if first.advantage is not None:
            cols["advantages"] = pa.array(rep("advantage"), f32)
        if first.current_version is not None:
            cols["current_version"] = pa.array(rep("current_version"), pa.int64())
        if first.group_id is not None:
            cols["group_id"] = pa.array(rep("group_id"), pa.int64())
        cols["seq_id"] = pa.array([i for i, s in enumerate(seqs) for _ in s.new], pa.int64())
    pq.write_table(pa.table(cols), path, row_group_size=row_group_size)


# -- off-policy diagnostics (independent float64 references) ---------------------------------------------


def exact_lower_quantile(values: list[float], q: float) -> float:
    """x_(k) with k = max(1, ⌈q·n⌉) (numpy's 'inverted_cdf'), k computed in exact rationals."""
    from fractions import Fraction

    ordered = sorted(values)
    k = max(1, math.ceil(Fraction(str(q)) * len(ordered)))
    return ordered[k - 1]


def _pop_std(values: list[float]) -> float:
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


def _clamp(v: float, bound: float | None) -> float:
    return v if bound is None else max(-bound, min(bound, v))


def _f32_ratio(new: float, base: float) -> np.float32:
    # As the core computes it for float32 data: a float32 difference, exp rounded to float32.
    return np.float32(math.exp(float(np.float32(new) - np.float32(base))))


def offpolicy_reference(
    seqs: list[Seq],
    *,
    kl_clamp: float | None = None,
    ref_kl_clamp: float | None = None,
    is_threshold: float = 2.0,
    eps: float = 0.2,
    eps_high: float | None = None,
    current_version: int | None = None,
) -> dict:
    """The off-policy figures by their written definitions (loops over sequences and tokens, float64).

    Returns the scalar figures under their analyze keys, plus ``"_ratio"`` / ``"_abs_diff"`` (the value lists, for
    quantile checks) and ``by_staleness`` / ``staleness/hist`` as lists of dicts.
    """
    eps_high = eps if eps_high is None else eps_high
    c = is_threshold
    out: dict = {}
    toks = [(s, t) for s in seqs for t in s.valid()]
    n = len(toks)
    has_old, has_ref, has_prox = seqs[0].old is not None, seqs[0].ref is not None, seqs[0].prox is not None

    if has_old:
        xs = [s.new[t] - s.old[t] for s, t in toks]
        out["kl/k1"] = sum(_clamp(-x, kl_clamp) for x in xs) / n
        out["kl/k2"] = sum(_clamp(x * x / 2, kl_clamp) for x in xs) / n
        out["kl/k3"] = sum(_clamp(math.exp(x) - 1 - x, kl_clamp) for x in xs) / n
        out["kl/abs_diff_mean"] = sum(abs(x) for x in xs) / n
        out["kl/abs_diff_max"] = max(abs(x) for x in xs)
        # importance weights
        w = [math.exp(x) for x in xs]
        out["is/mean"] = sum(w) / n
        out["is/min"], out["is/max"] = min(w), max(w)
        wt = [min(max(v, 1 / c), c) for v in w]
        mean_t = sum(wt) / n
        out["is/std"] = _pop_std(wt)
        out["is/ess"] = 1 / (sum((v / mean_t) ** 2 for v in wt) / n)
        out["is/frac_high"] = sum(v > c for v in w) / n
        out["is/frac_low"] = sum(v < 1 / c for v in w) / n
        out["is/chi2_token"] = sum(v * v for v in w) / n - 1
        out["spikes/n_ratio_gt_1e3"] = sum(v > 1e3 for v in w)
        a = [math.exp(s.new[t]) for s, t in toks]
        b = [math.exp(s.old[t]) for s, t in toks]
        ma, mb = sum(a) / n, sum(b) / n
        cov = sum((x - ma) * (y - mb) for x, y in zip(a, b)) / n
        out["prob/pearson"] = cov / (_pop_std(a) * _pop_std(b))
        out["_abs_diff"] = [abs(x) for x in xs]
        out["abs_diff/mean"] = out["kl/abs_diff_mean"]
        out["abs_diff/max"] = out["kl/abs_diff_max"]
        out["abs_diff/min"] = min(out["_abs_diff"])
        out["abs_diff/std"] = _pop_std(out["_abs_diff"])
    if has_ref:
        ys = [s.ref[t] - s.new[t] for s, t in toks]
        out["kl_ref/k1"] = sum(_clamp(-y, ref_kl_clamp) for y in ys) / n
        out["kl_ref/k2"] = sum(_clamp(y * y / 2, ref_kl_clamp) for y in ys) / n
        out["kl_ref/k3"] = sum(_clamp(math.exp(y) - 1 - y, ref_kl_clamp) for y in ys) / n

    # per non-empty sequence: perplexities and the sequence χ²
    ppl_new, ppl_old, diffs, chi2 = [], [], [], []
    for s in seqs:
        idx = s.valid()
        if not idx:
            continue
        mean_new = sum(s.new[t] for t in idx) / len(idx)
        ppl_new.append(math.exp(-mean_new))
        if has_old:
            mean_old = sum(s.old[t] for t in idx) / len(idx)
            ppl_old.append(math.exp(-mean_old))
            diffs.append(mean_old - mean_new)
            log_w = sum(s.new[t] - s.old[t] for t in idx)
            chi2.append(math.exp(2 * max(-20.0, min(20.0, log_w))) - 1)
    out["ppl/new"] = sum(ppl_new) / len(ppl_new)
    if has_old:
        m = len(diffs)
        out["ppl/old"] = sum(ppl_old) / m
        out["ppl/log_diff_mean"] = sum(diffs) / m
        out["ppl/log_diff_abs_mean"] = sum(abs(d) for d in diffs) / m
        out["ppl/ratio"] = sum(math.exp(d) for d in diffs) / m
        out["is/chi2_seq"] = sum(chi2) / m

    # the PPO ratio (base = prox if present, else old)
    if has_old or has_prox:
        base = "prox" if has_prox else "old"
        r = [math.exp(s.new[t] - getattr(s, base)[t]) for s, t in toks]
        out["_ratio"] = r
        out["ratio/mean"], out["ratio/min"], out["ratio/std"] = sum(r) / n, min(r), _pop_std(r)

    # decoupled PPO without rejection sampling
    if has_prox and has_old:
        d = [s.prox[t] - s.old[t] for s, t in toks]
        wb = [math.exp(v) for v in d]
        out["behave/imp_weight_mean"] = sum(wb) / n
        out["behave/imp_weight_min"], out["behave/imp_weight_max"] = min(wb), max(wb)
        out["behave/approx_kl"] = sum(d) / n

    # staleness over valid generated tokens
    if seqs[0].versions is not None:
        per_lag: dict[int, list[tuple]] = {}
        on_policy = []
        for s, t in toks:
            v = s.versions[t]
            if v < 0:
                continue
            cur = s.current_version if s.current_version is not None else current_version
            lag = cur - v
            entry = [None, None, None, None]
            if has_old:
                x = s.new[t] - s.old[t]
                entry[0] = _clamp(math.exp(x) - 1 - x, kl_clamp)
                entry[2] = math.exp(x)
                entry[3] = abs(x)
                if lag == 0:
                    on_policy.append(abs(math.exp(x) - 1))
            base = s.prox if has_prox else s.old
            if base is not None and s.advantage is not None:
                r32 = _f32_ratio(s.new[t], base[t])
                lo, hi = np.float32(1 - eps), np.float32(1 + eps_high)
                entry[1] = bool((r32 < lo and s.advantage < 0) or (r32 > hi and s.advantage > 0))
            per_lag.setdefault(lag, []).append(tuple(entry))
        lags = [lag for lag, items in per_lag.items() for _ in items]
        m = len(lags)
        if m:
            out["staleness/n_tokens"] = m
            out["staleness/theta_mean"] = sum(lags) / m
            out["staleness/theta_min"], out["staleness/theta_max"] = min(lags), max(lags)
            out["staleness/proximal_mean"] = sum(lag - 1 for lag in lags) / m
            out["staleness/proximal_min"] = min(lags) - 1
            out["staleness/proximal_max"] = max(lags) - 1
            out["staleness/hist"] = [{"lag": lag, "n_tokens": len(per_lag[lag])} for lag in sorted(per_lag)]
            rows = []
            for lag in sorted(per_lag):
                items = per_lag[lag]
                row = {"lag": lag, "n_tokens": len(items)}
                if has_old:
                    row["kl/k3"] = sum(e[0] for e in items) / len(items)
                if items[0][1] is not None:
                    row["clip/ratio"] = sum(e[1] for e in items) / len(items)
                if has_old:
                    row["is/mean"] = sum(e[2] for e in items) / len(items)
                    row["abs_diff/mean"] = sum(e[3] for e in items) / len(items)
                rows.append(row)
            out["by_staleness"] = rows
            if has_old:
                out["sanity/n_on_policy_tokens"] = len(on_policy)
                if on_policy:
                    out["sanity/on_policy_ratio_dev"] = max(on_policy)

    # sequences and groups
    lengths = [len(s.valid()) for s in seqs]
    out["seq/len_mean"] = sum(lengths) / len(lengths)
    out["seq/len_min"], out["seq/len_max"] = min(lengths), max(lengths)
    if seqs[0].advantage is not None:
        adv = [s.advantage for s, _ in toks]
        out["adv/mean"] = sum(adv) / n
        out["adv/std"] = _pop_std(adv)
        out["adv/pos_frac"] = sum(a > 0 for a in adv) / n
        out["adv/neg_frac"] = sum(a < 0 for a in adv) / n
        out["adv/zero_frac"] = sum(a == 0 for a in adv) / n
    if seqs[0].reward is not None:
        rewards = [s.reward for s in seqs]
        out["reward/mean"] = sum(rewards) / len(rewards)
        out["reward/std"] = _pop_std(rewards)
        if seqs[0].group_id is not None:
            groups: dict[int, list[float]] = {}
            for s in seqs:
                groups.setdefault(s.group_id, []).append(s.reward)
            out["groups/n"] = len(groups)
            out["groups/zero_std_frac"] = sum(len(set(g)) == 1 for g in groups.values()) / len(groups)
    return out


def rejection_reference(
    seqs: list[Seq], *, level: str, action: str, metric: str, agg: str = "mean", upper: float = 5.0,
    lower: float | None = None,
) -> dict:
    """AReaL's rejection sampling of π_prox/π_old (AReaL ``apply_rejection_sampling``) and the behave stats over kept
    tokens.

    Covers metric ``ratio`` (token/sequence, mask/clamp, agg mean/sum/max) and ``kl_k1/k2/k3`` (mask).
    """
    def in_bounds(v: float) -> bool:
        return v <= upper if lower is None else lower <= v <= upper

    def token_metric(d: float) -> float:  # d = prox − old
        if metric == "ratio":
            return math.exp(d)
        return {"kl_k1": d, "kl_k2": d * d / 2, "kl_k3": math.exp(-d) - 1 + d}[metric]

    n = kept_n = filtered = 0
    kept_w: list[float] = []
    kept_d: list[float] = []
    for s in seqs:
        idx = s.valid()
        ds = [s.prox[t] - s.old[t] for t in idx]
        n += len(ds)
        if not ds:
            continue
        if level == "token":
            weights = [math.exp(d) for d in ds]
            if action == "mask":
                keep = [in_bounds(token_metric(d)) for d in ds]
            else:
                lo = 0.0 if lower is None else lower
                clamped = [min(max(w, lo), upper) for w in weights]
                filtered += sum(cw != w for cw, w in zip(clamped, weights))
                weights, keep = clamped, [True] * len(ds)
        else:
            values = ds if metric == "ratio" else [token_metric(d) for d in ds]
            seq_value = {"sum": sum(values), "mean": sum(values) / len(values), "max": max(values)}[agg]
            seq_metric = math.exp(seq_value) if metric == "ratio" else seq_value
            geo = math.exp(sum(ds) / len(ds))
            weights = [geo] * len(ds) if metric == "ratio" else [math.exp(d) for d in ds]
            ok = in_bounds(seq_metric)
            if action == "mask":
                keep = [ok] * len(ds)
            else:
                keep = [True] * len(ds)
                if not ok:
                    lo = 0.0 if lower is None else lower
                    clamped = [min(max(w, lo), upper) for w in weights]
                    filtered += sum(cw != w for cw, w in zip(clamped, weights))
                    weights = clamped
        if action == "mask":
            filtered += sum(not k for k in keep)
        for k, w, d in zip(keep, weights, ds):
            if k:
                kept_n += 1
                kept_w.append(w)
                kept_d.append(d)
    out = {"rs/filtered_fraction": filtered / n}
    if kept_n:
        out.update({
            "behave/imp_weight_mean": sum(kept_w) / kept_n, "behave/imp_weight_min": min(kept_w),
            "behave/imp_weight_max": max(kept_w), "behave/approx_kl": sum(kept_d) / kept_n,
        })
    return out


def m2po_reference(second_moments: list[float], threshold: float) -> int:
    """How many tokens M2PO masks: drop the largest until the mean of the rest is below the threshold (AReaL;
    ``n − 1`` when that never happens)."""
    v = sorted(second_moments, reverse=True)
    n = len(v)
    for k in range(n):
        tail = v[k:]
        if sum(tail) / len(tail) < threshold:
            return k
    return n - 1


# ------------------------------------------------------------------------------------------------------------
# the peers' logged figures (``--names verl|trl|areal``), by their published definitions
# ------------------------------------------------------------------------------------------------------------

_VERL_BOUND = 20.0  # verl's SAFETY_BOUND


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _sample_std(values: list[float]) -> float:
    if len(values) < 2:
        return 0.0
    mu = _mean(values)
    return math.sqrt(sum((v - mu) ** 2 for v in values) / (len(values) - 1))


def _valid_pairs(seqs: list[Seq], train: str, rollout: str = "old") -> list[tuple[list[float], list[float]]]:
    """Per sequence (every one, an all-masked one empty): its valid tokens' (train, rollout) log-probs."""
    return [([float(getattr(s, train)[t]) for t in s.valid()], [float(getattr(s, rollout)[t]) for t in s.valid()])
            for s in seqs]


def verl_rollout_corr_reference(
    seqs: list[Seq], train: str = "prox", *, threshold: float = 2.0, lower: float | None = None,
    level: str = "token", truncate: bool = True,
) -> dict[str, float]:
    """verl 0.9.1 ``rollout_corr_helper.compute_is_metrics`` and ``compute_offpolicy_metrics`` of one batch (the
    ``rollout_corr/*`` keys without the prefix), ℓ = train − rollout (rollout = ``old``). Weights: ``exp(clamp(ℓ,
    ±20))`` per token, or ``exp(clamp(Σℓ, ±20))`` on every token of a sequence; truncated at ``C`` (TIS) or zeroed
    outside ``[lower, C]`` (IcePop); ``truncate=False`` is verl 0.7's statistics of the raw weights."""
    c, b = threshold, _VERL_BOUND
    lo = 1.0 / c if lower is None else lower
    rows = _valid_pairs(seqs, train)
    stat_tok, raw_tok, spread, seq_stat, seq_raw, row_logs = [], [], [], [], [], []
    mu_t, mu_r, kl, k3, rho2, chi2_seq = [], [], [], [], [], []
    for tr, ro in rows:
        lrs = [x - y for x, y in zip(tr, ro)]
        row_log = sum(lrs)
        row_logs.append(row_log)
        raws = ([math.exp(min(max(row_log, -b), b))] * len(lrs) if level == "sequence"
                else [math.exp(min(max(x, -b), b)) for x in lrs])
        weights = [min(w, c) if lower is None else (w if lower <= w <= c else 0.0) for w in raws]
        stats = weights if truncate else raws
        stat_tok += stats
        raw_tok += raws
        spread += [min(max(w, 0.0), c) for w in weights] if truncate else [min(max(w, lo), c) for w in raws]
        seq_stat.append(_mean(stats) if stats else 0.0)
        seq_raw.append(_mean(raws) if raws else 0.0)
        mu_t.append(_mean(tr) if tr else 0.0)
        mu_r.append(_mean(ro) if ro else 0.0)
        kl += [-x for x in lrs]
        k3 += [math.exp(x) - 1.0 - x for x in lrs]
        rho2 += [math.exp(min(max(x, -b), b)) ** 2 for x in lrs]
        chi2_seq.append(math.exp(2.0 * min(max(row_log, -b), b)))
    mean_v = _mean(spread)
    out = {"rollout_is_mean": _mean(stat_tok)}
    if level == "sequence":
        out.update(rollout_is_max=math.exp(min(max(row_logs), b)), rollout_is_min=math.exp(min(row_logs)),
                   rollout_is_ratio_fraction_high=_mean([float(x > math.log(c)) for x in row_logs]),
                   rollout_is_ratio_fraction_low=_mean([float(x < math.log(lo)) for x in row_logs]))
    else:
        out.update(rollout_is_max=max(stat_tok), rollout_is_min=min(stat_tok),
                   rollout_is_ratio_fraction_high=_mean([float(w > c) for w in raw_tok]),
                   rollout_is_ratio_fraction_low=_mean([float(w < lo) for w in raw_tok]))
    out.update(
        rollout_is_std=_pop_std(spread) if len(spread) > 1 else 0.0,
        rollout_is_eff_sample_size=1.0 / _mean([(v / (mean_v + 1e-8)) ** 2 for v in spread]),
        rollout_is_seq_mean=_mean(seq_stat), rollout_is_seq_std=_sample_std(seq_stat),
        rollout_is_seq_max=max(seq_stat), rollout_is_seq_min=min(seq_stat),
        rollout_is_seq_max_deviation=max(abs(x - 1.0) for x in seq_stat),
        rollout_is_seq_fraction_high=_mean([float(x > c) for x in seq_raw]),
        rollout_is_seq_fraction_low=_mean([float(x < lo) for x in seq_raw]),
    )
    if lower is not None:
        out["rollout_is_oob_ratio"] = _mean([float(w < lo or w > c) for w in raw_tok])
    diff = [r - t for r, t in zip(mu_r, mu_t)]
    out.update(
        training_ppl=_mean([math.exp(-x) for x in mu_t]), training_log_ppl=_mean([-x for x in mu_t]),
        kl=_mean(kl), k3_kl=_mean(k3), rollout_ppl=_mean([math.exp(-x) for x in mu_r]),
        rollout_log_ppl=_mean([-x for x in mu_r]), log_ppl_diff=_mean(diff),
        log_ppl_abs_diff=_mean([abs(x) for x in diff]), log_ppl_diff_max=max(diff), log_ppl_diff_min=min(diff),
        ppl_ratio=_mean([math.exp(x) for x in diff]), chi2_token=_mean(rho2) - 1.0, chi2_seq=_mean(chi2_seq) - 1.0,
    )
    return out


def verl_rollout_rs_reference(
    seqs: list[Seq], train: str, bounds: dict[str, tuple[float | None, float]]
) -> dict[str, float]:
    """verl 0.9.1 ``compute_rollout_rejection_mask`` and ``compute_rs_metrics`` (the ``rollout_rs_*`` keys) for the
    options of ``bounds`` (``{option: (lower, upper)}``, k1 options with both). ℓ = clamp(train − old, ±20); k1 =
    −ℓ, k2 = ℓ²/2, k3 = e^ℓ − 1 − ℓ; k1 keeps log lower ≤ stat ≤ log upper, the others stat ≤ upper."""
    b = _VERL_BOUND
    rows = []
    for tr, ro in _valid_pairs(seqs, train):
        lrs = [min(max(x - y, -b), b) for x, y in zip(tr, ro)]
        rows.append({"k1": [-x for x in lrs], "k2": [x * x / 2.0 for x in lrs],
                     "k3": [math.exp(x) - 1.0 - x for x in lrs]})
    n_tokens = sum(len(r["k1"]) for r in rows)
    ne = [i for i, r in enumerate(rows) if r["k1"]]
    keep_all = [[True] * len(r["k1"]) for r in rows]
    out: dict[str, float] = {}
    for option, (lower, upper) in bounds.items():
        k1 = option.endswith("k1")
        lo_t, hi_t = (math.log(lower) if lower else 0.0, math.log(upper)) if k1 else (0.0, upper)
        stats, seq_values = [], []
        for r in rows:
            values = r[option[-2:]]
            if option.startswith("token"):
                stats.append(values)
                seq_values.append(_mean(values) if values else 0.0)
                continue
            seq = (sum(values) if option.startswith("seq_sum") else _mean(values) if option.startswith("seq_mean")
                   else max(values)) if values else 0.0
            stats.append([seq] * len(values))
            seq_values.append(seq)
        keep = [[(lo_t <= x <= hi_t) if k1 else x <= hi_t for x in row] for row in stats]
        keep_all = [[a and k for a, k in zip(ka, kr)] for ka, kr in zip(keep_all, keep)]
        flat = [x for row in stats for x in row]
        sv = [seq_values[i] for i in ne]
        units = flat if option.startswith("token") else sv
        clamped = [min(max(x, lo_t), hi_t) for x in flat]
        p = f"rollout_rs_{option}_"
        out.update({
            p + "mean": _mean(flat), p + "max": max(units), p + "min": min(units),
            p + "fraction_high": _mean([float(x > hi_t) for x in units]),
            p + "fraction_low": _mean([float(x < lo_t) for x in units]) if k1 else 0.0,
            p + "std": _pop_std(clamped) if len(flat) > 1 else 0.0,
            p + "seq_mean": _mean(sv), p + "seq_std": _sample_std(sv), p + "seq_max": max(sv), p + "seq_min": min(sv),
            p + "seq_max_deviation": max(abs(x) for x in sv),
            p + "seq_fraction_high": _mean([float(x > hi_t) for x in sv]),
            p + "masked_fraction": sum(not k for row in keep for k in row) / n_tokens,
            p + "seq_masked_fraction": _mean([float(not all(keep[i])) for i in ne]),
        })
        if k1:
            out[p + "seq_fraction_low"] = _mean([float(x < lo_t) for x in sv])
    out["rollout_rs_masked_fraction"] = sum(not k for row in keep_all for k in row) / n_tokens
    out["rollout_rs_seq_masked_fraction"] = _mean([float(not all(row)) for row in keep_all])
    return out


def trl_reference(
    seqs: list[Seq], *, level: str = "token", eps: float = 0.2, eps_high: float | None = None,
    advantages: list[list[float]] | None = None, mode: str = "sequence_mask", clip_min: float | None = None,
    clip_max: float | None = 3.0,
) -> dict[str, float]:
    """TRL 1.16's logged ``clip_ratio/*``, ``cispo_clip_ratio``, ``kl`` and ``sampling/*`` of one batch (no
    micro-batches), as ``--names trl`` reads a dump: ``coef_1 = exp(new − base)`` (base = prox, else old) per token,
    or exp of the sequence's mean log-ratio; advantages one per sequence (TRL's ``(B,)``) unless ``advantages``
    gives them per token (``(B, T)``); TRL's CISPO cap = 1 + ``eps_high``; the vLLM ratio of prox against old."""
    eps_high = eps if eps_high is None else eps_high
    per_sequence = level == "sequence" and advantages is None
    low, high, low_frac, high_frac, kl = [], [], [], [], []
    ratios, diffs = [], []
    for i, s in enumerate(seqs):
        v = s.valid()
        base = s.prox if s.prox is not None else s.old
        lrs = [float(s.new[t]) - float(base[t]) for t in v]
        coefs = [math.exp(x) for x in lrs] if level == "token" else [math.exp(_mean(lrs) if lrs else 0.0)] * len(v)
        ys = [float(s.ref[t]) - float(s.new[t]) for t in v]
        kl += [(math.exp(y) - y - 1.0) * c for y, c in zip(ys, coefs)]
        if per_sequence:  # one indicator per sequence, an empty one with ratio 1
            c, a = (coefs[0] if coefs else 1.0), s.advantage
            lo, hi = float(c < 1 - eps and a < 0), float(c > 1 + eps_high and a > 0)
            low.append(lo)
            high.append(hi)
            low_frac.append(lo)
            high_frac.append(hi)
        else:
            adv = [s.advantage] * len(v) if advantages is None else [float(advantages[i][t]) for t in v]
            lo_t = [float(c < 1 - eps and a < 0) for c, a in zip(coefs, adv)]
            hi_t = [float(c > 1 + eps_high and a > 0) for c, a in zip(coefs, adv)]
            low += lo_t
            high += hi_t
            if v:
                low_frac.append(_mean(lo_t))
                high_frac.append(_mean(hi_t))
        deltas = [float(s.prox[t]) - float(s.old[t]) for t in v]
        diffs += [abs(d) for d in deltas]
        raw = [math.exp(sum(deltas))] if mode.startswith("sequence") else [math.exp(d) for d in deltas]
        lo_b = -math.inf if clip_min is None else clip_min
        hi_b = math.inf if clip_max is None else clip_max
        ratios += ([min(max(r, lo_b), hi_b) for r in raw] if mode.endswith("truncate")
                   else [r if lo_b <= r <= hi_b else 0.0 for r in raw])
    return {
        "clip_ratio/low_mean": _mean(low), "clip_ratio/high_mean": _mean(high),
        "clip_ratio/region_mean": _mean([a + b for a, b in zip(low, high)]),
        "clip_ratio/low_min": min(low_frac), "clip_ratio/high_max": max(high_frac),
        "cispo_clip_ratio": _mean(high), "kl": _mean(kl),
        "sampling/sampling_logp_difference/mean": _mean(diffs), "sampling/sampling_logp_difference/max": max(diffs),
        "sampling/importance_sampling_ratio/min": min(ratios), "sampling/importance_sampling_ratio/mean": _mean(ratios),
        "sampling/importance_sampling_ratio/max": max(ratios),
    }
