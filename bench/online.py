"""Benchmark: what :class:`grpo_cli.Diagnoser` adds to a training step, against a tiny model's own step.

    python bench/online.py                               # CPU, the defaults below (docs/performance.md)
    python bench/online.py --device cuda --d-model 512   # a GPU
    python bench/online.py --json out.json

Each step trains a small causal LM (``grpo_cli.commands._sample_model.TinyCausalLM``) on ``--micro-batches``
micro-batches of ``--batch`` right-padded sequences of up to ``--length`` tokens with a clipped PPO loss
(forward, backward, Adam). Every micro-batch's tensors go to ``Diagnoser.update`` (new, behaviour, proximal and
reference log-probs, entropy, versions, mask, advantages, rewards, group and sequence ids, EOS), and
``Diagnoser.step_end`` ends the step. It reports the median time per step of the training step, of the updates and
of ``step_end`` (run judgement and the step judged alone), the overhead per token, and the diagnoser's state size
after each step (its growth per step), then over ``--memory-steps`` further steps of the diagnoser alone, the
state size and the process's peak RSS.
"""

from __future__ import annotations

import argparse
import itertools
import json
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from grpo_cli import Diagnoser
from grpo_cli.commands._sample_model import TinyCausalLM

VOCAB = 64
GROUP = 8


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _batch(model: TinyCausalLM, args: argparse.Namespace, step: int, mb: int, gen: torch.Generator,
           device: torch.device) -> dict[str, Any]:
    b, t = args.batch, args.length
    tokens = torch.randint(0, VOCAB, (b, t), generator=gen).to(device)
    lengths = torch.randint(t // 2, t + 1, (b,), generator=gen).to(device)
    prompt = t // 8
    pos = torch.arange(t, device=device)
    mask = (pos[None] >= prompt) & (pos[None] < lengths[:, None])
    rewards = torch.rand(b, generator=gen).to(device)
    grouped = rewards.view(-1, GROUP)
    advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)).view(-1)
    first = (step * args.micro_batches + mb) * b
    return {"tokens": tokens, "lengths": lengths, "mask": mask, "rewards": rewards, "advantages": advantages,
            "seq_id": torch.arange(first, first + b, device=device), "group_id": torch.arange(first, first + b,
                                                                                             device=device) // GROUP,
            "eos": (lengths < t).to(torch.int64)}


def _logp_entropy(model: TinyCausalLM, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(tokens)[:, :-1].float()
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, tokens[:, 1:, None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    pad = torch.zeros(tokens.shape[0], 1, device=tokens.device)
    return torch.cat([pad, logp], 1), torch.cat([pad, entropy], 1)


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    model = TinyCausalLM(VOCAB, args.length, d_model=args.d_model, n_heads=4, n_layers=args.layers,
                         d_ff=4 * args.d_model).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    diagnoser = Diagnoser(epsilon=0.2)
    train_s, update_s, end_s, sizes, tokens_per_step = [], [], [], [], []
    for step in range(args.warmup + args.steps):
        t_train = t_update = 0.0
        n_tokens = 0
        for mb in range(args.micro_batches):
            data = _batch(model, args, step, mb, gen, device)
            _sync(device)
            start = time.perf_counter()
            new, entropy = _logp_entropy(model, data["tokens"])
            old = (new + 0.01 * torch.randn_like(new)).detach().clamp(max=0)
            ratio = torch.exp(new - old)
            adv = data["advantages"][:, None]
            surrogate = torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
            loss = -(surrogate * data["mask"]).sum() / data["mask"].sum()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            _sync(device)
            t_train += time.perf_counter() - start
            start = time.perf_counter()
            new_d = new.detach()
            diagnoser.update(new_logp=new_d, old_logp=old, prox_logp=old, ref_logp=old, entropy=entropy.detach(),
                             loss_mask=data["mask"], lengths=data["lengths"],
                             versions=torch.full_like(data["tokens"], step), current_version=step,
                             advantages=data["advantages"], rewards=data["rewards"], group_id=data["group_id"],
                             seq_id=data["seq_id"], eos=data["eos"], step=step)
            _sync(device)
            t_update += time.perf_counter() - start
            n_tokens += int(data["mask"].sum())
        start = time.perf_counter()
        diagnoser.step_end(step)
        _sync(device)
        t_end = time.perf_counter() - start
        if step >= args.warmup:
            train_s.append(t_train)
            update_s.append(t_update)
            end_s.append(t_end)
            tokens_per_step.append(n_tokens)
        sizes.append(_state_bytes(diagnoser))
    growth = [b - a for a, b in itertools.pairwise(sizes)]
    timed_bytes = _state_bytes(diagnoser)
    # the diagnoser alone, for the memory over a long run: the same batches without the model
    for step in range(args.warmup + args.steps, args.warmup + args.steps + args.memory_steps):
        for mb in range(args.micro_batches):
            data = _batch(model, args, step, mb, gen, device)
            new = -torch.rand(data["tokens"].shape, generator=gen).to(device)
            diagnoser.update(new_logp=new, old_logp=new, loss_mask=data["mask"], lengths=data["lengths"],
                             versions=torch.full_like(data["tokens"], step), current_version=step,
                             advantages=data["advantages"], rewards=data["rewards"], group_id=data["group_id"],
                             seq_id=data["seq_id"], eos=data["eos"], step=step)
        diagnoser.step_end(step)
    median = statistics.median
    tokens = median(tokens_per_step)
    sequences = args.batch * args.micro_batches
    total_steps = args.warmup + args.steps + args.memory_steps
    return {
        "device": str(device), "torch": torch.__version__, "threads": torch.get_num_threads(),
        "micro_batches": args.micro_batches, "sequences_per_step": sequences, "loss_tokens_per_step": tokens,
        "model_parameters": sum(p.numel() for p in model.parameters()),
        "train_step_ms": 1e3 * median(train_s), "updates_ms": 1e3 * median(update_s),
        "step_end_ms": 1e3 * median(end_s),
        "overhead_vs_train": (median(update_s) + median(end_s)) / median(train_s),
        "update_us_per_token": 1e6 * median(update_s) / tokens,
        "state_bytes_first_steps": sizes[:3], "state_growth_bytes_per_step": median(growth),
        "state_growth_bytes_per_sequence": median(growth) / sequences,
        "state_bytes_after_steps": {args.warmup + args.steps: timed_bytes, total_steps: _state_bytes(diagnoser)},
        # past the window, only the per-step and per-GRPO-group rows still grow
        "state_growth_bytes_per_step_late": (_state_bytes(diagnoser) - timed_bytes) / max(args.memory_steps, 1),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def _state_bytes(diagnoser: Diagnoser) -> int:
    return sum(v.numel() * v.element_size() for s in diagnoser._run or [] for v in s.values.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=32, help="sequences per micro-batch (a multiple of 8)")
    parser.add_argument("--length", type=int, default=256, help="padded length")
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--memory-steps", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (training and diagnoser)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    result = run(args)
    for key, value in result.items():
        print(f"{key:34} {value:.4g}" if isinstance(value, float) else f"{key:34} {value}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
