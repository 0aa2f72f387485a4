"""Metric keys: the section each belongs to and a one-line meaning (the table's explanations).

Keys are a public contract (``docs/metrics.md`` has each formula and peer equivalent). Add freely; never rename or drop
one without bumping the JSON ``schema_version``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["KEYS", "SECTIONS", "KeyInfo", "section_of"]


@dataclass(frozen=True)
class KeyInfo:
    section: str
    meaning: str


SECTIONS: dict[str, str] = {
    "dump": "What was read",
    "logp": "Log-probabilities (valid tokens)",
    "kl": "KL between training and behaviour policy (samples from old)",
    "ratio": "PPO importance ratio exp(new − base), base = prox_logp if present else old_logp",
    "clip": "Clipping",
    "other": "Other",
}

KEYS: dict[str, KeyInfo] = {
    "n_sequences": KeyInfo("dump", "sequences (rows) read"),
    "n_tokens": KeyInfo("dump", "tokens read, masked or not"),
    "n_valid_tokens": KeyInfo("dump", "tokens with loss_mask = 1 (every other figure is over these)"),
    "logp/new_mean": KeyInfo("logp", "mean log π_θ"),
    "logp/old_mean": KeyInfo("logp", "mean behaviour log-prob"),
    "logp/diff_mean": KeyInfo("logp", "mean (new − old); > 0: trainer likes the samples more than the sampler did"),
    "policy_confidence": KeyInfo("logp", "exp(mean log π_θ): geometric-mean token probability"),
    "entropy/mean": KeyInfo("logp", "mean token entropy of π_θ"),
    "kl/k3": KeyInfo("kl", "mean(e^d − 1 − d), d = new − old: k3 estimate of KL(old ‖ new)"),
    "kl/k3_token_max": KeyInfo("kl", "largest per-token k3"),
    "ratio/max": KeyInfo("ratio", "largest per-token ratio"),
    "clip/ratio": KeyInfo("clip", "tokens clipped by PPO: clip/low + clip/high"),
    "clip/low": KeyInfo("clip", "r < 1 − ε with A < 0"),
    "clip/high": KeyInfo("clip", "r > 1 + ε_high with A > 0"),
    "clip/seq_ratio": KeyInfo("clip", "GSPO: sequences whose geometric-mean ratio is clipped"),
    "clip/seq_low": KeyInfo("clip", "GSPO: s < 1 − ε with mean A < 0"),
    "clip/seq_high": KeyInfo("clip", "GSPO: s > 1 + ε_high with mean A > 0"),
    "clip/cispo": KeyInfo("clip", "CISPO: r outside [1 − ε, 1 + ε_high], regardless of A"),
    "clip/cispo_low": KeyInfo("clip", "CISPO: r < 1 − ε"),
    "clip/cispo_high": KeyInfo("clip", "CISPO: r > 1 + ε_high"),
    "top_kl": KeyInfo("kl", "the highest-k3 tokens"),
}


def section_of(key: str) -> str:
    """The section of a key: declared, else its prefix before '/', else 'other'."""
    if key in KEYS:
        return KEYS[key].section
    prefix = key.split("/", 1)[0]
    return prefix if prefix in SECTIONS else "other"
