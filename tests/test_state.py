from __future__ import annotations

import torch

from grpo_cli.core.state import MetricState, count, maximum, minimum, select_top_rows, top_rows, total


def _state():
    return MetricState({"n": count(), "s": total(), "lo": minimum(), "hi": maximum(), "top": top_rows(2, 2)})


def test_merge_is_commutative_and_associative():
    parts = []
    for i, (n, s, v) in enumerate([(3, 0.5, -1.0), (2, 1.25, 4.0), (7, -0.75, 2.0)]):
        st = _state()
        st.update(n=torch.tensor(n), s=torch.tensor(s), lo=torch.tensor(v), hi=torch.tensor(v),
                  top=torch.tensor([[v, float(i)]]))
        parts.append(st)
    a = parts[0].merge(parts[1]).merge(parts[2])
    b = parts[2].merge(parts[0].merge(parts[1]))
    for st in (a, b):
        assert int(st["n"]) == 12 and st["n"].dtype == torch.int64
        assert float(st["s"]) == 1.0 and st["s"].dtype == torch.float64
        assert float(st["lo"]) == -1.0 and float(st["hi"]) == 4.0
        assert st["top"].tolist() == [[4.0, 1.0], [2.0, 2.0]]


def test_select_top_rows_breaks_ties_by_later_columns():
    rows = torch.tensor([[1.0, 5.0], [1.0, 2.0], [0.5, 0.0]], dtype=torch.float64)
    assert select_top_rows(rows, 2).tolist() == [[1.0, 2.0], [1.0, 5.0]]
    padded = select_top_rows(rows[:1], 3)
    assert padded[0].tolist() == [1.0, 5.0] and padded[1, 0] == -torch.inf


def test_empty_extremes_are_infinite():
    st = _state()
    assert float(st["lo"]) == float("inf") and float(st["hi"]) == float("-inf")
