"""TouchedRows: GEO's rows kept on the trainer between syncs, trained there, pushed as changes."""

import numpy as np
import pytest
import torch

from trainer.embedding import TouchedRows


def rows(*values):
    return torch.tensor([[v, -v] for v in values], dtype=torch.float64)


def test_rows_join_sorted_keep_their_first_value_as_base_and_train_in_place():
    t = TouchedRows()
    t.add("emb", np.array([5, 9]), rows(5.0, 9.0))
    t.add("emb", np.array([1, 5, 7]), rows(1.0, 555.0, 7.0))  # 5 is held: its row stays the first one
    hit, at = t.find("emb", np.array([1, 2, 5, 7, 9, 10]))
    assert hit.tolist() == [True, False, True, True, True, False]
    assert torch.equal(t.rows("emb", at[hit]), rows(1.0, 5.0, 7.0, 9.0))
    t.train("emb", np.array([5, 9]), rows(1.0, 2.0), lr=0.5)
    assert torch.equal(t.rows("emb", t.find("emb", np.array([5, 9]))[1]), rows(4.5, 8.0))
    assert len(t) == 4
    ids, delta = t.take_deltas()["emb"]  # only the rows that moved
    assert ids.tolist() == [5, 9] and torch.equal(delta, rows(-0.5, -1.0))
    assert len(t) == 0 and not t.find("emb", np.array([5]))[0].any()


@pytest.mark.parametrize(
    "case, held, asked, hit",
    [
        ("nothing held", [], [3, 4], [False, False]),
        ("every id held", [3, 4], [3, 4], [True, True]),
        ("an id past the last held", [3], [3, 8], [True, False]),
        ("an id before the first held", [3], [-2, 3], [False, True]),
        ("no ids asked", [3], [], []),
    ],
)
def test_find(case, held, asked, hit):
    t = TouchedRows()
    if held:
        t.add("emb", np.array(held), rows(*map(float, held)))
    assert t.find("emb", np.array(asked, dtype=np.int64))[0].tolist() == hit, case


def test_padding_row_is_not_kept_and_a_gradient_for_a_row_never_looked_up_is_refused():
    t = TouchedRows()
    t.add("emb", np.array([0, 2]), rows(0.0, 2.0), padding_idx=0)
    assert t.find("emb", np.array([0, 2]))[0].tolist() == [False, True]
    with pytest.raises(RuntimeError, match="1 rows that were not looked up"):
        t.train("emb", np.array([2, 3]), rows(1.0, 1.0), lr=0.1)
