"""A large embedding table trained with a dense gradient: the op count's tables, the rule."""

from __future__ import annotations

import ast
import json

import pytest
from conftest import trainprof

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
    # the bound: the lookups' op time and the optimizer's update of the table, for the rows
    # a step does not touch (not all of backward: the rest of it is the model's)
    # (where other processes' load disturbed the op-time window, backward's whole share)
    if doc["op_time"]["disturbed"]:
        assert ev["lookup_share"] is None
        lookup = doc["breakdown"]["backward"]
    else:
        lookup = doc["op_time"]["share_of_step"]["lookup"]
        assert ev["lookup_share"] == pytest.approx(lookup, abs=1e-3)
        assert lookup < doc["breakdown"]["backward"] + doc["breakdown"]["forward"]
    assert f["estimated_gain"] == pytest.approx(
        (lookup * ev["dense_tables_share_of_tables"]
         + ev["optimizer_share"] * ev["table_share_of_stepped_params"])
        * ev["untouched_share"], abs=1e-3)
    # the script's Adam stays for the rest (AdamW's default weight decay differs), and each
    # line of the snippet is Python
    snippet = f["fix"]["snippet"]
    assert "sparse=True" in snippet and "torch.optim.SparseAdam(sparse" in snippet
    assert "torch.optim.Adam(dense" in snippet and "AdamW" not in snippet
    assert "for o in opts: o.step()" in snippet
    ast.parse(snippet)
    # the table's whole-gradient backward is an embedding lookup's, not a fusable op's
    shares = doc["op_time"]["share_of_model"]
    # (the dense gradient's zero-fill and its accumulation run as other ops: one CI run
    # split 27% lookup / 64% the rest, runs here over half lookup)
    assert shares["lookup"] > 0.15, shares
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


TIED = """
import torch
from torch import nn

torch.manual_seed(0)
emb = nn.Embedding(50_000, 16)
head = nn.Linear(16, 50_000, bias=False)
head.weight = emb.weight  # weight tying: the output layer's product makes the gradient dense
opt = torch.optim.Adam(emb.parameters())
for step in range(24):
    idx = torch.randint(0, 50_000, (64,))
    loss = nn.functional.cross_entropy(head(emb(idx)), torch.randint(0, 50_000, (64,)))
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def test_a_table_tied_to_the_output_layer_gets_no_sparse_advice(tp):
    res = tp(TIED, "--json", "--no-html")
    assert res.returncode == 0, res.stderr[-2000:]
    doc = res.json()
    (table,) = doc["ops"]["embeddings"]
    # its weight also went through the head's linear: sparse=True would still give it a dense
    # gradient, and SparseAdam fails on it ("SparseAdam does not support dense gradients")
    assert (table["rows"], table["dense_use"], table["stepped"]) == (50_000, "linear", True)
    assert not [f for f in doc["findings"] if f["cause"] == "dense_embedding_gradient"]


FROZEN = """
import torch
from torch import nn

torch.manual_seed(0)
emb = nn.Embedding(200_000, 16)  # pretrained, meant frozen: only left out of the optimizer
head = nn.Linear(16, 1)
opt = torch.optim.Adam(head.parameters())
for step in range(24):
    idx = torch.randint(0, 200_000, (64, 8))
    loss = head(emb(idx).mean(1)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def test_a_table_no_optimizer_steps_gets_its_gradient_turned_off(tp):
    res = tp(FROZEN, "--json", "--no-html")
    assert res.returncode == 0, res.stderr[-2000:]
    doc = res.json()
    (table,) = doc["ops"]["embeddings"]
    assert table["stepped"] is False
    # sparse gradients plus SparseAdam would start training a frozen table
    assert not [f for f in doc["findings"] if f["cause"] == "dense_embedding_gradient"]
    (f,) = [f for f in doc["findings"] if f["cause"] == "gradient_of_untrained_table"]
    assert "requires_grad_(False)" in f["fix"]["snippet"]
    # backward's share (the only table): the lookups' op time missed the dense
    # gradient's allocation, and fell short of the measured gain
    assert f["estimated_gain"] == pytest.approx(doc["breakdown"]["backward"], abs=1e-3)
    # its dense backward is most of this step (the head is 17 parameters)
    assert f["estimated_gain"] > 0.3, f["evidence"]


SGD = """
import sys
import torch
from torch import nn

torch.manual_seed(0)
SPARSE = sys.argv[1] == "sparse"
emb = nn.Embedding(200_000, 16, sparse=SPARSE)
head = nn.Sequential(*[nn.Linear(16, 16) for _ in range(12)], nn.Linear(16, 1))
opt = torch.optim.SGD(list(emb.parameters()) + list(head.parameters()), lr=0.1, momentum=0.9)
for step in range(24):
    idx = torch.randint(0, 200_000, (64, 8))
    loss = head(emb(idx).mean(1)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    if not SPARSE:
        torch.nn.utils.clip_grad_norm_(list(emb.parameters()) + list(head.parameters()), 1.0)
    opt.step()
"""


def test_sgd_needs_only_sparse_true_and_its_clipping_is_named(tp):
    res = tp(SGD, "--json", "--no-html", args=("dense",))
    assert res.returncode == 0, res.stderr[-2000:]
    doc = res.json()
    assert doc["ops"]["clips_grads"] is True
    (f,) = [f for f in doc["findings"] if f["cause"] == "dense_embedding_gradient"]
    snippet = f["fix"]["snippet"]
    # SGD (momentum too) takes sparse gradients: no second optimizer
    assert "sparse=True" in snippet and "SparseAdam" not in snippet
    assert "clip_grad_norm_(dense" in snippet and "clip_grad_norm_" in f["fix"]["text"]
    # every line is Python once uncommented (max_norm: the script's value)
    ast.parse("max_norm = 1.0\n" + "\n".join(
        line.removeprefix("# ") for line in snippet.splitlines()
        if not line.startswith("# torch.optim")))


def test_an_optimizer_with_sparse_gradients_is_not_told_to_use_fused(tp):
    res = tp(SGD, "--json", "--no-html", args=("sparse",))
    assert res.returncode == 0, res.stderr[-2000:]
    doc = res.json()
    (opt,) = doc["optimizers"]
    # torch's fused SGD rejects them ("`_fused_sgd` does not support sparse gradients")
    assert opt["sparse_grad_tensors"] == 1 and "sparse" in opt["fused_unavailable"]
    for f in doc["findings"]:
        assert "fused=True" not in (f["fix"] or {}).get("snippet", ""), f


def test_compare_names_a_table_turned_sparse(tp, tmp_path):
    runs = []
    for sparse in (False, True):
        out = tmp_path / f"run-{sparse}"
        res = tp(RECOMMENDER.format(sparse=sparse), "--json", "--no-html", "--out", str(out))
        assert res.returncode == 0, res.stderr[-2000:]
        runs.append(out)
    res = trainprof("compare", *map(str, runs), "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    text = json.dumps(json.loads(res.stdout))
    assert "model.embedding[200000x16]" in text and "sparse gradient" in text
