"""Padding: read from real batches, summarised, diagnosed, trimmed by a knob and a fix."""

from __future__ import annotations

import collections
import json

import pytest
import torch
from conftest import trainprof
from test_diagnosis import EXAMPLES, MS, loader, make_steps, make_summary
from torch.utils.data import DataLoader, Dataset, default_collate

from trainprof.capture import padding as padding_mod
from trainprof.capture.knobs import ENV_VAR, Knobs
from trainprof.capture.padding import PaddingProbe, find_padding
from trainprof.diagnosis import diagnose
from trainprof.experiments import tune as tune_mod
from trainprof.fixes import LengthGroupedBatchSampler, TrimPadding, trim_padding
from trainprof.store import load_run


def _padded(lengths: list[int], length: int = 64, left: bool = False, seed: int = 0):
    """Token ids 1..999, each row padded with 0 to ``length`` on the right (or left)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lengths), length, dtype=torch.long)
    for i, n in enumerate(lengths):
        tokens = torch.randint(1, 1000, (n,), generator=g)
        if left:
            ids[i, length - n:] = tokens
        else:
            ids[i, :n] = tokens
    return ids


LENGTHS = [10, 25, 3, 40, 17, 8]


@pytest.mark.parametrize("left", [False, True])
def test_ids_and_masks_padded_on_either_side_are_read_exactly(left):
    ids = _padded(LENGTHS, left=left)
    for batch, path in (((ids, torch.zeros(6)), "batch[0]"),
                        ({"input_ids": ids, "attention_mask": ids != 0}, "batch['attention_mask']"),
                        ({"input_ids": ids, "attention_mask": (ids != 0).long()},
                         "batch['attention_mask']")):
        p = find_padding(batch)
        assert p is not None and p.path == path
        assert (p.side, p.pad_value, p.rows, p.length) == ("left" if left else "right", 0, 6, 64)
        assert p.real == sum(LENGTHS) and p.longest == 40 and p.trimmable == 24
        assert p.positions == 6 * 64


def test_a_pad_id_that_is_not_zero_is_found_as_the_value_rows_end_with():
    ids = _padded([10, 25, 3, 30, 17, 8], length=32)
    ids[ids == 0] = 50256  # GPT-2's end-of-text token used as its pad token
    p = find_padding({"input_ids": ids, "labels": ids})
    assert (p.path, p.pad_value, p.real, p.longest) == ("batch['input_ids']", 50256, 93, 30)


def test_rows_that_all_end_with_one_same_token_are_not_padded():
    ids = torch.randint(1, 1000, (8, 32), generator=torch.Generator().manual_seed(2))
    ids[:, -1] = 2  # every row ends with its end-of-sequence token: nothing to cut
    p = find_padding(ids)
    assert p.trimmable == 0 and p.real == p.positions
    assert trim_padding([ids])[0].shape == (8, 32)


def test_what_is_not_padded_sequences_gives_nothing_or_no_padding():
    g = torch.Generator().manual_seed(1)
    multi_hot = (torch.rand(16, 200, generator=g) < 0.05).long()  # zeros everywhere inside
    assert find_padding(multi_hot) is None
    assert find_padding(torch.randn(8, 64)) is None  # floats: features, not tokens
    assert find_padding(torch.zeros(8, 10, dtype=torch.long)) is None  # too short a row
    assert find_padding(torch.zeros(4, 3, 32, 32, dtype=torch.uint8)) is None  # images
    assert find_padding({"x": "text", "n": 3}) is None
    full = find_padding(torch.arange(1, 33 * 4 + 1).reshape(4, 33))
    assert full is not None and full.trimmable == 0 and full.real == full.positions


def test_trimming_cuts_the_all_padding_columns_from_every_tensor_of_that_shape():
    ids = _padded(LENGTHS)
    Batch = collections.namedtuple("Batch", "ids mask labels pair y")
    batch = Batch(ids, (ids != 0).long(), ids.masked_fill(ids == 0, -100),
                  torch.ones(6, 64, 64, dtype=torch.bool), torch.arange(6))
    out = trim_padding(batch)
    assert type(out) is Batch
    assert out.ids.shape == (6, 40) and torch.equal(out.ids, ids[:, :40])
    assert out.mask.shape == out.labels.shape == (6, 40)
    assert out.pair.shape == (6, 40, 40) and torch.equal(out.y, batch.y)
    left = _padded(LENGTHS, left=True)
    cut = trim_padding({"input_ids": left, "attention_mask": left != 0})
    assert torch.equal(cut["input_ids"], left[:, 24:]) and cut["attention_mask"].shape == (6, 40)
    # nothing to cut: the very same batch back; min_length keeps columns
    full = [torch.arange(1, 65).repeat(2, 1)]
    assert trim_padding(full) is full
    assert trim_padding([ids], min_length=50)[0].shape == (6, 50)
    assert trim_padding([ids], multiple_of=16)[0].shape == (6, 48)  # 40 rounded up
    assert trim_padding([ids], multiple_of=48)[0].shape == (6, 48)
    assert trim_padding([ids], multiple_of=100)[0] is ids  # never past the padded length
    with pytest.raises(ValueError, match="multiple_of"):
        TrimPadding(multiple_of=0)
    # pad value and side given: the first candidate tensor is read with them
    assert trim_padding([ids + 5], pad_value=5)[0].shape == (6, 40)
    with pytest.raises(ValueError, match="side"):
        TrimPadding(side="up")


class Sentences(Dataset):
    def __len__(self):
        return len(LENGTHS) * 4

    def __getitem__(self, i):
        n = LENGTHS[i % len(LENGTHS)]
        ids = torch.zeros(64, dtype=torch.long)
        ids[:n] = torch.arange(1, n + 1)
        return {"input_ids": ids, "attention_mask": (ids != 0).long(), "label": i}


def test_trim_padding_as_collate_fn_in_workers_gives_the_trimmed_batches():
    plain = DataLoader(Sentences(), batch_size=6, num_workers=0)
    trimmed = DataLoader(Sentences(), batch_size=6, num_workers=2, collate_fn=TrimPadding(),
                         multiprocessing_context="fork")
    for a, b in zip(plain, trimmed, strict=True):
        assert b["input_ids"].shape == (6, 40)
        assert torch.equal(a["input_ids"][:, :40], b["input_ids"])
        assert torch.equal(a["attention_mask"][:, :40], b["attention_mask"])
        assert torch.equal(a["label"], b["label"])
        assert not a["input_ids"][:, 40:].any()  # only padding was cut


def test_the_probe_reads_each_loaders_first_batches_then_removes_itself(monkeypatch):
    from torch.utils.data.dataloader import _SingleProcessDataLoaderIter

    monkeypatch.setattr(padding_mod, "BATCHES_PER_LOADER", 3)
    monkeypatch.setattr(padding_mod, "BATCHES_SEEN", 10)
    original = _SingleProcessDataLoaderIter.__dict__["_next_data"]
    restore = []

    def patch(owner, name, make):
        restore.append((owner, name, owner.__dict__[name]))
        setattr(owner, name, make(owner.__dict__[name]))

    loaders = [DataLoader(Sentences(), batch_size=6), DataLoader(Sentences(), batch_size=4)]
    iterators: dict[int, int] = {}
    probe = PaddingProbe(lambda it: iterators.get(id(it)))
    probe.install(patch)
    try:
        for _ in range(2):
            for index, dl in enumerate(loaders):
                it = iter(dl)
                iterators[id(it)] = index
                for _ in it:
                    pass
        # 3 epochs' worth of batches went by: the probe stopped after 10
        assert _SingleProcessDataLoaderIter.__dict__["_next_data"] is original
    finally:
        for owner, name, own in restore:
            if owner.__dict__.get(name) is not own:
                setattr(owner, name, own)
    rec = probe.record()
    first, second = rec["loaders"]
    assert first["batches"] == second["batches"] == 3
    # loader 0: batches of all six lengths; loader 1: rows 0-3, 4-5+0-1, 2-5
    assert first["positions"] == 3 * 6 * 64 and first["real"] == 3 * sum(LENGTHS)
    assert first["dynamic"] == 3 * 6 * 40
    assert second["real"] == sum(LENGTHS[:4]) + sum(LENGTHS[4:] + LENGTHS[:2]) + sum(LENGTHS[2:])
    assert second["dynamic"] == 4 * (40 + 25 + 40)
    assert (first["tensor"], first["side"], first["length_min"]) == (
        "batch['attention_mask']", "right", 64)
    # the first batch's tensors, described (what the input fixes know of the samples)
    assert second["batch_tensors"][0] == {"path": "batch['input_ids']", "dtype": "int64",
                                          "shape": [4, 64]}


def test_length_grouped_batches_cover_every_index_once_and_group_lengths():
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(1, 200, (1000,), generator=g).tolist()
    sampler = LengthGroupedBatchSampler(lengths, batch_size=16, pool_batches=10, seed=7)
    first, second = list(sampler), list(sampler)
    assert len(first) == len(sampler) == 63
    for epoch in (first, second):
        assert sorted(i for b in epoch for i in b) == list(range(1000))
    assert first != second  # a new shuffle each epoch
    again = LengthGroupedBatchSampler(lengths, batch_size=16, pool_batches=10, seed=7)
    assert list(again) == first  # reproducible with a seed

    def padded(batches):  # positions if each batch is padded to its longest row
        return sum(len(b) * max(lengths[i] for i in b) for b in batches)

    shuffled = torch.randperm(1000, generator=g).split(16)
    assert padded(first) < 0.7 * padded([b.tolist() for b in shuffled])
    dropped = list(LengthGroupedBatchSampler(lengths, 16, drop_last=True, seed=1))
    assert len(dropped) == 62 and all(len(b) == 16 for b in dropped)


TEXT = """
import sys
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

LENGTHS = [10, 25, 3, 40, 17, 8]

class Sentences(Dataset):  # every sequence padded to 64 positions
    def __len__(self):
        return 6 * 20

    def __getitem__(self, i):
        n = LENGTHS[i % 6]
        ids = torch.zeros(64, dtype=torch.long)
        ids[:n] = torch.arange(1, n + 1)
        return {"input_ids": ids, "attention_mask": (ids != 0).long(), "label": i % 2}

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.mlp = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 32))
        self.head = nn.Linear(32, 2)

    def forward(self, ids, mask):
        x = self.mlp(self.embed(ids)) * mask.unsqueeze(-1)
        return self.head(x.sum(1) / mask.sum(1, keepdim=True))

model = Model()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
widths = set()
for epoch in range(2):
    for b in DataLoader(Sentences(), batch_size=6):
        widths.add(b["input_ids"].shape[1])
        loss = nn.functional.cross_entropy(model(b["input_ids"], b["attention_mask"]), b["label"])
        opt.zero_grad(); loss.backward(); opt.step()
print("WIDTHS", sorted(widths))
"""


def test_a_run_of_padded_sequences_measures_the_padding_and_names_it(tp):
    res = tp(TEXT, "--json")
    assert res.returncode == 0, res.stderr
    assert "WIDTHS [64]" in res.stdout + res.stderr  # (--json: the script prints to stderr)
    rec = load_run(res.run_dir).meta["padding"]["loaders"][0]
    # 40 batches of the 6 lengths; the first 16 read
    assert (rec["batches"], rec["positions"], rec["real"], rec["dynamic"]) == (
        16, 16 * 6 * 64, 16 * sum(LENGTHS), 16 * 6 * 40)
    doc = res.json()
    entry = doc["padding"][0]
    assert entry["pad_share"] == pytest.approx(1 - 103 / 384)
    assert entry["trim_share"] == pytest.approx(1 - 40 / 64)
    found = [f for f in doc["findings"] if f["cause"] == "padding"]
    assert len(found) == 1, doc["findings"]
    f = found[0]
    assert f["category"] == "compute"
    assert f["evidence"]["pad_share"] == pytest.approx(0.732, abs=1e-3)
    model = f["evidence"]["model_share"]
    assert f["estimated_gain"] == pytest.approx(model * (1 - 103 / 384), abs=1e-4)
    assert "TrimPadding()" in f["fix"]["snippet"]
    assert "--knob trim_padding=false,true" in f["verify"]
    shown = trainprof("report", str(res.run_dir), cwd=res.run_dir.parent).stdout
    assert "batch['attention_mask']: 73% of 64 positions a row are padding" in shown


def test_the_trim_padding_knob_gives_the_model_trimmed_batches(tp):
    res = tp(TEXT, env={ENV_VAR: json.dumps({"trim_padding": True})})
    assert res.returncode == 0, res.stderr
    assert "WIDTHS [40]" in res.stdout  # every batch cut to its longest row
    meta = load_run(res.run_dir).meta
    knob = meta["knobs"]["process"]["trim_padding"]
    assert knob == {"batches": 40, "trimmed": 40, "positions_before": 40 * 384,
                    "positions_after": 40 * 240}
    assert meta["padding"]["loaders"][0]["positions"] == 16 * 240  # the probe read them cut
    assert tune_mod._actual("trim_padding", meta) == (
        "true (40 batches cut to ×0.62 of the positions)")


def test_compare_shows_the_padding_of_each_run(tp):
    """The padding finding's verify line sends the user to `trainprof compare`, which had no
    padding row."""
    import io

    from trainprof.analysis.compare import compare_runs
    from trainprof.report.compare_terminal import render_compare

    plain = tp(TEXT)
    cut = tp(TEXT, env={ENV_VAR: json.dumps({"trim_padding": True})})
    assert plain.returncode == 0 and cut.returncode == 0, plain.stderr + cut.stderr
    r = compare_runs(load_run(plain.run_dir), load_run(cut.run_dir))
    pad_a, pad_b = r["a"]["padding"]["0"], r["b"]["padding"]["0"]
    assert pad_a == pytest.approx(1 - 100 / 384, abs=0.05)  # TEXT: rows of ~100 real tokens
    # the same real tokens, in batches cut from 384 positions to 240
    assert (1 - pad_b) * 240 == pytest.approx((1 - pad_a) * 384, rel=0.01)
    out = io.StringIO()
    render_compare(r, file=out)
    row = next(ln for ln in out.getvalue().splitlines() if ln.lstrip().startswith("padding"))
    assert f"{pad_a * 100:.0f}% of positions" in row and f"{pad_b * 100:.0f}% of" in row


#: TEXT with an LSTM given packed sequences in place of the MLP
PACKED = TEXT.replace(TEXT[TEXT.index("class Model"):TEXT.index("model = Model()")], """
from torch.nn.utils.rnn import pack_padded_sequence

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.rnn = nn.LSTM(32, 64, batch_first=True)
        self.head = nn.Linear(64, 2)

    def forward(self, ids, mask):
        packed = pack_padded_sequence(self.embed(ids), mask.sum(1), batch_first=True,
                                      enforce_sorted=False)
        return self.head(self.rnn(packed)[1][0][-1])

""")


def test_an_rnn_given_packed_sequences_gets_no_padding_finding(tp):
    """The LSTM skips the padding already: the op count's window sees the packing."""
    assert "pack_padded_sequence(self.embed" in PACKED
    res = tp(PACKED, "--json")
    assert res.returncode == 0, res.stderr
    doc = res.json()
    assert doc["padding"][0]["pad_share"] == pytest.approx(1 - 103 / 384)
    assert doc["ops"]["packed_sequences_per_step"] == 1.0
    assert not [f for f in doc["findings"] if f["cause"] == "padding"]
    # the Padding row says why no finding follows its 73%
    report = trainprof("report", str(res.run_dir), cwd=res.run_dir.parent)
    row = " ".join(report.stdout.split("Padding #0", 1)[1].split("Optimizer", 1)[0].split())
    assert row.startswith("batch['attention_mask']: 73% of 64 positions a row are padding")
    assert row.endswith("the model packs its sequences (pack_padded_sequence): the padding "
                        "costs no compute"), row


def test_the_knob_is_undone_and_its_off_value_reports_the_padding_read():
    from torch.utils.data.dataloader import (
        _MultiProcessingDataLoaderIter,
        _SingleProcessDataLoaderIter,
    )

    before = [c.__dict__["_next_data"] for c in (_SingleProcessDataLoaderIter,
                                                 _MultiProcessingDataLoaderIter)]
    knobs = Knobs({"trim_padding": True}).install()
    try:
        batch = next(iter(DataLoader(Sentences(), batch_size=6)))
        assert batch["input_ids"].shape == (6, 40)
    finally:
        record = knobs.uninstall()
    assert [c.__dict__["_next_data"] for c in (_SingleProcessDataLoaderIter,
                                               _MultiProcessingDataLoaderIter)] == before
    assert record["process"]["trim_padding"]["trimmed"] == 1
    meta = {"knobs": {"process": {"trim_padding": False}},
            "padding": {"loaders": [{"positions": 400, "real": 100}]}}
    assert tune_mod._actual("trim_padding", meta) == "false (75% padding)"


def test_example_padded_text_and_its_two_fixes(tmp_path):
    """examples/padded_text.py: sentences of 8-40 tokens padded to 128. As it is, the
    padding finding leads; --trim leaves the sentences of a batch padded to its longest
    (grouping proposed, no trimming); --trim --group leaves next to no padding."""
    def run(*args):
        res = trainprof("run", "--json", "--out", str(tmp_path / "-".join(args or ["plain"])),
                        str(EXAMPLES / "padded_text.py"), "--epochs", "1", *args, cwd=tmp_path)
        assert res.returncode == 0, res.stderr[-3000:]
        return res.json()

    plain = run()
    top = plain["findings"][0]
    assert (top["category"], top["cause"]) == ("compute", "padding"), plain["findings"]
    # uniform lengths 8-40 in 128 positions: 24 real a row, 81% padding (16 batches read)
    assert top["evidence"]["pad_share"] == pytest.approx(1 - 24 / 128, abs=0.03)
    assert "TrimPadding()" in top["fix"]["snippet"]
    trimmed = run("--trim")
    entry = trimmed["padding"][0]
    assert not entry["fixed_length"] and entry["length_max"] <= 40
    (f,) = [f for f in trimmed["findings"] if f["cause"] == "padding"]
    assert "TrimPadding" not in f["fix"]["snippet"]
    assert "LengthGroupedBatchSampler" in f["fix"]["snippet"]
    grouped = run("--trim", "--group")
    assert grouped["padding"][0]["pad_share"] < 0.05
    assert not [f for f in grouped["findings"] if f["cause"] == "padding"]


# -- the rule, on summaries -----------------------------------------------------------


def _summary(pad: float, trim: float, fixed: bool = True, forward_ms: float = 3.0):
    steps = make_steps(60, data=0.2 * MS, forward=forward_ms * MS, backward=6 * MS,
                       optimizer=0.5 * MS)
    summary = make_summary(steps, dataloaders=[loader(dataset="__main__.Text")])
    summary["padding"] = [{
        "loader_index": 0, "tensor": "batch['input_ids']", "side": "right", "pad_value": 0,
        "batches": 64, "length_min": 128 if fixed else 40, "length_max": 128,
        "fixed_length": fixed, "pad_share": pad, "trim_share": trim,
        "mean_real": 128 * (1 - pad), "mean_longest": 128 * (1 - trim),
    }]
    return summary, steps


def _padding_findings(summary, steps):
    return [f for f in diagnose(summary, steps) if f["cause"] == "padding"]


def test_fixed_length_padding_gets_trimming_first_and_grouping_for_the_rest():
    (f,) = _padding_findings(*_summary(0.8, 0.6))
    model = f["evidence"]["model_share"]
    assert 0.85 < model < 0.95
    assert f["estimated_gain"] == pytest.approx(0.8 * model, abs=1e-4) and f["severity"] == "high"
    assert "TrimPadding()" in f["fix"]["snippet"]
    assert "LengthGroupedBatchSampler(lengths, batch_size=32)" in f["fix"]["snippet"]
    assert "collate_fn=TrimPadding()" in f["fix"]["snippet"].split("LengthGrouped")[-1]
    assert f"up to {model * 0.6 * 100:.0f}%" in f["verify"]


def test_a_loader_of_whole_batches_gets_the_cut_in_the_loop():
    """batch_size=None: collate_fn sees each of the dataset's batches as one sample, so
    TrimPadding there would wrap them in another batch dimension."""
    summary, steps = _summary(0.8, 0.6)
    summary["dataloaders"] = [loader(dataset="__main__.Batches", batch_size=None,
                                     batch_sampler=None)]
    (f,) = _padding_findings(summary, steps)
    assert "batch = trim_padding(batch)" in f["fix"]["snippet"]
    assert "TrimPadding" not in f["fix"]["snippet"]


def test_padding_left_after_per_batch_padding_gets_grouping_only():
    (f,) = _padding_findings(*_summary(0.45, 0.02, fixed=False))
    assert "TrimPadding" not in f["fix"]["snippet"]
    assert "already padded to its longest" in f["fix"]["text"]
    assert "trainprof compare" in f["verify"]
    assert f["evidence"]["padded_length"] == [40, 128]


def test_little_padding_or_a_step_not_spent_in_the_model_gets_no_finding():
    assert not _padding_findings(*_summary(0.08, 0.05))
    summary, steps = _summary(0.5, 0.4)
    steps = make_steps(60, data=40 * MS, forward=0.2 * MS, backward=0.2 * MS, optimizer=0.1 * MS)
    summary = {**make_summary(steps, dataloaders=[loader()]), "padding": summary["padding"]}
    assert not _padding_findings(summary, steps)  # 1% of the step in the model: < 2%


def test_no_padding_read_or_packed_sequences_leave_the_rule_silent():
    summary, steps = _summary(0.8, 0.6)
    summary["padding"] = None
    assert not _padding_findings(summary, steps)
    summary, steps = _summary(0.8, 0.6)
    summary["ops"] = {"packed_sequences_per_step": 1.0}
    assert not _padding_findings(summary, steps)
    summary["ops"] = {"packed_sequences_per_step": 0.0}
    assert _padding_findings(summary, steps)


def test_trim_padding_default_collate_is_the_inner_default():
    assert TrimPadding().collate_fn is default_collate


def test_the_first_batchs_tensors_are_described_and_tell_images_from_other_data():
    """The cpu_transforms fix gives its image recipe (uint8 crops, Normalize per batch)
    only where a loader's batches hold images: 1-D signal features got it."""
    from trainprof.analysis.padding import holds_images
    from trainprof.capture.padding import describe_tensors

    images = (torch.zeros(8, 3, 32, 32, dtype=torch.uint8), torch.zeros(8, dtype=torch.long))
    described = describe_tensors(images)
    assert described == [{"path": "batch[0]", "dtype": "uint8", "shape": [8, 3, 32, 32]},
                         {"path": "batch[1]", "dtype": "int64", "shape": [8]}]
    assert holds_images(loader(), described) is True
    assert holds_images(loader(), describe_tensors({"x": torch.zeros(4, 28, 28, 1)})) is True
    signals = describe_tensors((torch.zeros(64, 36), torch.zeros(64, dtype=torch.long)))
    assert holds_images(loader(), signals) is False
    tokens = describe_tensors((torch.zeros(16, 64, dtype=torch.long),) * 2)
    assert holds_images(loader(), tokens) is False
    assert holds_images(loader(), None) is None  # nothing known: no image recipe either
    # torchvision's datasets, or workers sampled decoding with PIL
    assert holds_images(loader(dataset="torchvision.datasets.folder.ImageFolder"), None)
    assert holds_images(loader(), signals, ["decode (PIL/ImageFile.py:300) 40%"])


def test_the_padding_text_names_attention_only_where_the_model_has_it():
    """An LSTM's padding was said to cost "attention" (and a quadratic saving): the op
    count's window records attention ops when there are any."""
    summary, steps = _summary(0.8, 0.6)
    (f,) = _padding_findings(summary, steps)  # no attention op seen (an RNN)
    assert "attention" not in f["fix"]["text"]
    assert "(embedding, projections, the loss" in f["fix"]["text"]
    summary["op_time"] = {"s_per_step": {"fused_attention": 0.02, "product": 0.09}}
    (f,) = _padding_findings(summary, steps)
    assert "(embedding, attention, projections" in f["fix"]["text"]
    assert "the attention, quadratic, saves more" in f["fix"]["text"]
    summary["op_time"] = None
    summary["ops"] = {"eager_attention": [{"shape": [8, 4, 128, 128]}]}
    (f,) = _padding_findings(summary, steps)
    assert "the attention, quadratic, saves more" in f["fix"]["text"]


def test_the_padding_row_says_how_many_of_the_batches_read_held_padding():
    from trainprof.report.terminal import _padding_line

    entry = {"tensor": "batch[0]", "pad_share": 0.5, "length_min": 64, "length_max": 64,
             "mean_real": 32, "mean_longest": 64, "batches": 12, "batches_read": 40}
    assert _padding_line(entry).endswith("· 12 of 40 batches read held padded sequences")
    assert _padding_line({**entry, "batches_read": 12}).endswith("· 12 batches read")
    # records before the field: the padded batches, as before
    assert _padding_line({**entry, "batches_read": None}).endswith("· 12 batches read")
