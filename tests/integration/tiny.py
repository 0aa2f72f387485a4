"""A tiny "add a and b" GRPO setup built locally: word-level tokenizer, random-init 2-layer Llama, two rewards.

Nothing is downloaded: the tokenizer is built with ``tokenizers`` and wrapped in ``PreTrainedTokenizerFast``, the
model is a randomly initialised ``LlamaForCausalLM`` (hidden size 64) saved to a directory, and the dataset is made
in memory.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any


def import_trl() -> Any:
    """``trl``, or a skip of the calling test module with one line when it cannot be imported: the TRL tier's files
    skip together, with the same reason."""
    import pytest

    try:
        import trl
    except ImportError as exc:  # not installed (or a broken install)
        pytest.skip(f"trl cannot be imported ({exc}); pip install -e '.[dev,trl]' runs the TRL tier",
                    allow_module_level=True)
    return trl


WORDS = ["add", "and", "the", "sum", "is", "so", "then", "maybe", "yes", "no", *[str(i) for i in range(19)]]
SPECIAL = ["[PAD]", "[UNK]", "[BOS]", "[EOS]"]


def build_model_dir(path: Path, seed: int = 0, initializer_range: float = 0.3) -> Path:
    """Write a tokenizer and a random 2-layer Llama (hidden size 64) to ``path``; returns ``path``.

    ``initializer_range`` is larger than Llama's 0.02 so that next-token distributions, and with them the token
    entropies, differ from token to token (near-uniform distributions would make every average look alike).
    """
    import torch
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL + WORDS)}
    core = Tokenizer(WordLevel(vocab=vocab, unk_token="[UNK]"))
    core.pre_tokenizer = WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="[PAD]", unk_token="[UNK]", bos_token="[BOS]", eos_token="[EOS]"
    )
    tokenizer.padding_side = "left"
    config = LlamaConfig(
        vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=64, pad_token_id=vocab["[PAD]"], bos_token_id=vocab["[BOS]"],
        eos_token_id=vocab["[EOS]"], tie_word_embeddings=False, initializer_range=initializer_range,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        pad_token_id=vocab["[PAD]"], bos_token_id=vocab["[BOS]"], eos_token_id=vocab["[EOS]"]
    )
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def make_dataset(n: int, seed: int = 0) -> Any:
    """``n`` prompts "add a and b" with the answer ``a + b`` in an ``answer`` column."""
    from datasets import Dataset

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        rows.append({"prompt": f"add {a} and {b}", "answer": str(a + b)})
    return Dataset.from_list(rows)


def reward_correct(completions: list[str], answer: list[str], **kwargs: Any) -> list[float]:
    """1.0 when one of the completion's first four words is the answer, else 0.0."""
    return [1.0 if ans in text.split()[:4] else 0.0 for text, ans in zip(completions, answer)]


def reward_short(completions: list[str], completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
    """0.5 for a completion of at most 4 tokens (an EOS ends it early), else 0.0."""
    return [0.5 if len(ids) <= 4 else 0.0 for ids in completion_ids]
