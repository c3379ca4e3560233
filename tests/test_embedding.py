"""A large embedding table trained with a dense gradient: the op count's tables, the rule."""

from __future__ import annotations

import pytest

RECOMMENDER = """
import torch
from torch import nn

torch.manual_seed(0)
SPARSE = {sparse}
emb = nn.Embedding(200_000, 16, sparse=SPARSE)
head = nn.Linear(16, 1)
if SPARSE:
    opts = [torch.optim.SparseAdam(emb.parameters()), torch.optim.Adam(head.parameters())]
else:
    opts = [torch.optim.Adam(list(emb.parameters()) + list(head.parameters()))]
for step in range(24):
    idx = torch.randint(0, 200_000, (64, 8))
    loss = head(emb(idx).mean(1)).pow(2).mean()
    for opt in opts:
        opt.zero_grad()
    loss.backward()
    for opt in opts:
        opt.step()
"""


def test_a_dense_table_whose_steps_touch_few_rows_gets_sparse_gradients(tp):
    res = tp(RECOMMENDER.format(sparse=False), "--json", "--no-html")
    assert res.returncode == 0, res.stderr[-2000:]
    doc = res.json()
    (table,) = doc["ops"]["embeddings"]
    assert (table["rows"], table["dim"], table["sparse"]) == (200_000, 16, False)
    assert table["lookups_per_step"] == 1 and table["indices_per_step"] == 64 * 8
    assert 480 <= table["distinct_rows_per_step"] <= 512  # 512 draws of 200,000 rows
    (f,) = [f for f in doc["findings"] if f["cause"] == "dense_embedding_gradient"]
    ev = f["evidence"]
    # the table is all but 17 of the 3,200,017 parameters Adam steps
    assert ev["table_share_of_stepped_params"] == pytest.approx(1.0, abs=1e-4)
    assert ev["untouched_share"] == pytest.approx(
        1 - table["distinct_rows_per_step"] / 200_000, abs=1e-4)
    assert f["estimated_gain"] == pytest.approx(
        ev["backward_optimizer_share"] * ev["table_share_of_stepped_params"]
        * ev["untouched_share"], abs=1e-3)
    assert "sparse=True" in f["fix"]["snippet"] and "SparseAdam" in f["fix"]["snippet"]
    # the table's whole-gradient backward is an embedding lookup's, not a fusable op's
    shares = doc["op_time"]["share_of_model"]
    assert shares["lookup"] > 0.5 and shares.get("fusable", 0) < 0.3, shares
    # the dense update's faster implementation is moot beside it
    assert not [g for g in doc["findings"] if g["cause"] == "for_loop_optimizer"]
    assert ev["supersedes"] == ["host_launch/for_loop_optimizer"]


def test_a_sparse_table_gets_nothing(tp):
    res = tp(RECOMMENDER.format(sparse=True), "--json", "--no-html")
    assert res.returncode == 0, res.stderr[-2000:]
    doc = res.json()
    (table,) = doc["ops"]["embeddings"]
    assert table["sparse"] is True
    assert not [f for f in doc["findings"] if f["cause"] == "dense_embedding_gradient"]
