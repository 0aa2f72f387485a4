"""The writer calls of docs/recipes/*.md, fed tensors shaped as each framework shapes them.

Each test builds one framework's tensors from token-aligned ground truth (value t belongs to token t), applies
that framework's conventions by hand (rolls, padding, windows), makes the recipe's ``add`` call and checks that
the dump holds the ground truth again.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from dump_columns import f32s, read_columns

from grpo_cli.io import RolloutWriter


def test_areal_packed_next_token(tmp_path):
    # Two sequences, token-aligned truth: A = p p r r (4 tokens), B = p r r (3 tokens); versions -1 on prompts.
    behave = [[0.0, -0.9, -0.3, -0.4], [0.0, -0.5, -0.6]]
    new = [[0.0, -0.8, -0.2, -0.45], [0.0, -0.55, -0.65]]
    mask = [[0, 0, 1, 1], [0, 1, 1]]
    versions = [[-1, -1, 5, 5], [-1, 6, 6]]

    def rolled(rows, fill=0.0):  # AReaL: torch.roll(x, -1) per sequence; the last slot wraps (garbage)
        return [[*row[1:], fill] for row in rows]

    def packed(rows, dtype=torch.float32):
        return torch.tensor([v for row in rows for v in row] + [7.0, 7.0], dtype=dtype)  # + 2 padding tokens

    cu = torch.tensor([0, 4, 7])
    input_data = {
        "cu_seqlens": cu, "logprobs": packed(rolled(behave)), "loss_mask": packed(rolled(mask), torch.int32),
        "versions": packed(versions, torch.int32), "advantages": packed(rolled([[1.0] * 4, [-1.0] * 3])),
        "grpo_seq_id": packed([[10] * 4, [11] * 3], torch.int64),
    }
    logprobs = packed(rolled(new)).requires_grad_()
    n = int(cu[-1])
    get = lambda key: None if input_data.get(key) is None else input_data[key][:n]  # noqa: E731
    with RolloutWriter(tmp_path, dedupe=True) as writer:
        for _ in range(2):  # a second PPO epoch sees the same sequences: dedupe keeps the first forward
            writer.add(
                step=3, current_version=3, cu_seqlens=cu, new_logp=logprobs.detach()[:n], entropy=None,
                old_logp=get("logprobs"), prox_logp=None, ref_logp=get("ref_logp"), teacher_logp=get("teacher_logp"),
                loss_mask=get("loss_mask"), versions=get("versions"), advantages=get("advantages"),
                seq_id=input_data["grpo_seq_id"][:n][cu[:-1]],
                alignment="next_token", column_alignment={"versions": "token"},
            )
    got = read_columns(tmp_path)
    # token 0 of each sequence has no value after un-rolling: fill 0.0 and mask 0 (it is a prompt token anyway)
    assert got["new_logp"] == f32s(new)
    assert got["old_logp"] == f32s(behave)
    assert got["loss_mask"] == [[bool(m) for m in row] for row in mask]
    assert got["versions"] == versions
    assert got["advantages"] == [[0.0, 1.0, 1.0, 1.0], [0.0, -1.0, -1.0]]
    assert got["seq_id"] == [10, 11] and got["current_version"] == [3, 3]
    assert "ref_logp" not in got["columns"] and "prox_logp" not in got["columns"]


def test_verl_response_window(tmp_path):
    # [b, R] right-padded response tensors, token-aligned; verl's old_log_probs is the proximal recompute.
    new = torch.tensor([[-0.1, -0.2, -0.3], [-0.4, -0.5, 0.0]])
    rollout = torch.tensor([[-0.12, -0.22, -0.32], [-0.42, -0.52, 0.0]])
    old_log_probs = torch.tensor([[-0.11, -0.21, -0.31], [-0.41, -0.51, 0.0]])
    response_mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    t = {"response_mask": response_mask, "old_log_probs": old_log_probs, "advantages": torch.tensor([[0.5] * 3,
         [-0.5] * 3]), "rollout_log_probs": rollout, "grpo_step": torch.tensor([[4], [4]]),
         "grpo_seq_id": torch.tensor([[7], [8]]), "grpo_group_id": torch.tensor([[0], [0]])}
    with RolloutWriter(tmp_path) as writer:
        writer.add(
            step=int(t["grpo_step"].reshape(-1)[0]), new_logp=new,
            old_logp=t.get("rollout_log_probs"), prox_logp=t["old_log_probs"], ref_logp=t.get("ref_log_prob"),
            loss_mask=t["response_mask"], advantages=t["advantages"],
            seq_id=t["grpo_seq_id"].reshape(-1), group_id=t["grpo_group_id"].reshape(-1), window="response",
        )
    got = read_columns(tmp_path)
    assert got["lengths"] == [3, 2]  # the padded slot of row 1 is not a token
    assert got["prox_logp"] == f32s([[-0.11, -0.21, -0.31], [-0.41, -0.51]])
    assert got["old_logp"] == f32s([[-0.12, -0.22, -0.32], [-0.42, -0.52]])
    assert got["step"] == [4, 4] and got["seq_id"] == [7, 8] and got["group_id"] == [0, 0]


def test_trl_completion_with_tool_mask(tmp_path):
    # [B, C] completions right-padded; tool tokens (mask 0) sit inside the completion and stay as tokens.
    new = torch.tensor([[-0.1, -0.2, -0.3, -0.4], [-0.5, -0.6, 0.0, 0.0]])
    completion_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    tool_mask = torch.tensor([[1, 0, 1, 1], [1, 1, 1, 1]])
    inputs = {"completion_mask": completion_mask, "tool_mask": tool_mask, "advantages": torch.tensor([1.0, -1.0]),
              "sampling_per_token_logps": new - 0.01, "grpo_seq_id": torch.tensor([0, 1]),
              "grpo_group_id": torch.tensor([0, 0])}
    mask = inputs["completion_mask"] * inputs["tool_mask"]
    with RolloutWriter(tmp_path, dedupe=True) as writer:
        writer.add(
            step=2, new_logp=new, entropy=None, old_logp=inputs.get("sampling_per_token_logps"),
            prox_logp=inputs.get("old_per_token_logps"), ref_logp=inputs.get("ref_per_token_logps"),
            loss_mask=mask, advantages=inputs["advantages"], seq_id=inputs["grpo_seq_id"],
            group_id=inputs["grpo_group_id"], lengths=inputs["completion_mask"].sum(1), window="response",
        )
    got = read_columns(tmp_path)
    assert got["lengths"] == [4, 2]
    assert got["loss_mask"] == [[True, False, True, True], [True, True]]
    assert got["advantages"] == [[1.0] * 4, [-1.0] * 2]
    assert got["columns"] == ["advantages", "group_id", "loss_mask", "new_logp", "old_logp", "seq_id", "step"]


def test_openrlhf_left_pad_with_attention_mask(tmp_path):
    # sequences [B, T=5] with a left-padded prompt in row 0; action tensors [B, A=4], index j scores token j+1.
    attention_mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    truth = [[-0.2, -0.3, -0.4], [-0.1, -0.2, -0.3, -0.4]]  # token-aligned values of tokens 2..4 / 1..4
    action_log_probs = torch.tensor([[9.0, -0.2, -0.3, -0.4], [-0.1, -0.2, -0.3, -0.4]])  # 9.0: scores token 1
    action_mask = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 1]])

    def left_pad(x):
        return None if x is None else F.pad(x, (1, 0))

    with RolloutWriter(tmp_path) as writer:
        writer.add(step=0, new_logp=left_pad(action_log_probs), prox_logp=left_pad(action_log_probs - 0.01),
                   old_logp=left_pad(None), ref_logp=left_pad(None), loss_mask=left_pad(action_mask),
                   advantages=left_pad(torch.ones(2, 4)), attention_mask=attention_mask, seq_id=None)
    got = read_columns(tmp_path)
    assert got["lengths"] == [4, 5]  # row 0's pad token is not a token
    # row 0: tokens 1..4 → values [9.0 (prompt token 1), truth...]; row 1: tokens 0..4 → [fill, -0.1, ...]
    assert got["new_logp"] == f32s([[9.0, *truth[0]], [0.0, *truth[1]]])
    # row 0: action_mask [0,1,1,1] scores tokens 1..4 → tokens 1..4 carry [0,1,1,1]; row 1: tokens 0..4 [0,0,1,1,1]
    assert got["loss_mask"] == [[False, True, True, True], [False, False, True, True, True]]


def test_twinkle_rolled_labels_and_response_only_old(tmp_path):
    # [B, T] rows; labels rolled by -1 so position t scores token t+1. Row 0: tokens 0..3, response = tokens 2, 3.
    logps = torch.tensor([[5.0, -0.2, -0.3, 5.0], [-0.7, 5.0, 5.0, 5.0]])  # 5.0: garbage at masked positions
    labels = torch.tensor([[-100, 11, 12, -100], [13, -100, -100, -100]])
    old_logps = [[-0.25, -0.35], [-0.75]]  # response-only, in order
    attention_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    mask = labels != -100
    flat = torch.cat([torch.as_tensor(x, dtype=logps.dtype).flatten() for x in old_logps])
    old = torch.zeros_like(logps).masked_scatter(mask, flat)
    with RolloutWriter(tmp_path) as writer:
        writer.add(step=1, new_logp=logps, old_logp=old, ref_logp=None, entropy=None, loss_mask=mask,
                   advantages=[0.5, -0.5], attention_mask=attention_mask, alignment="next_token")
    got = read_columns(tmp_path)
    assert got["lengths"] == [4, 2]
    assert got["loss_mask"] == [[False, False, True, True], [False, True]]
    new_valid = [[v for v, m in zip(r, k) if m] for r, k in zip(got["new_logp"], got["loss_mask"])]
    old_valid = [[v for v, m in zip(r, k) if m] for r, k in zip(got["old_logp"], got["loss_mask"])]
    assert new_valid == f32s([[-0.2, -0.3], [-0.7]])
    assert old_valid == f32s([[-0.25, -0.35], [-0.75]])
