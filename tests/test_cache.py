"""`trainprof.fixes.CachedDataset` and `DevicePrefetcher` (CPU path): real loaders, real kills."""

from __future__ import annotations

import multiprocessing
import pickle
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from trainprof.fixes import CachedDataset, DevicePrefetcher, PackError


class Counted(torch.utils.data.Dataset):
    """Deterministic items that count, across processes, how often each is computed."""

    def __init__(self, n: int = 48, counts=None):
        self.n = n
        self.counts = counts if counts is not None else multiprocessing.Array("i", n)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        with self.counts.get_lock():
            self.counts[i] += 1
        image = np.full((4, 5, 3), i % 256, dtype=np.uint8)
        return image, i % 7


class Squares:
    def __len__(self):
        return 6

    def __getitem__(self, i):
        return i * i


def test_each_item_is_computed_once_by_whichever_worker_and_read_after(tmp_path):
    source = Counted()
    seen = []
    ds = CachedDataset(source, tmp_path / "cache", transform=lambda a: torch.from_numpy(a))
    for _ in range(2):  # epoch 1 computes (in 2 fork workers), epoch 2 reads
        loader = DataLoader(ds, batch_size=8, shuffle=True, num_workers=2)
        seen.append({int(y0): x0 for x, y in loader for x0, y0 in zip(x, y, strict=True)})
    assert list(source.counts) == [2] + [1] * 47  # item 0 once more: it gives the layout
    assert ds.cached_fraction == 1.0
    for i in range(48):
        x, y = ds[i]
        assert y == i % 7 and type(y) is int
        assert torch.equal(x, torch.full((4, 5, 3), i, dtype=torch.uint8))
    # the next run (a new instance, the same dataset) reads everything, computes nothing
    again = Counted(counts=multiprocessing.Array("i", 48))
    ds2 = CachedDataset(again, tmp_path / "cache")
    assert [int(ds2[i][1]) for i in range(48)] == [i % 7 for i in range(48)]
    assert list(again.counts) == [1] + [0] * 47
    # a batch read mixes cached rows and fresh ones, in the order asked
    assert [y for _, y in ds2.__getitems__([5, -1, 5, 0])] == [5, 47 % 7, 5, 0]
    with pytest.raises(IndexError, match="index 48 is out of range"):
        ds2[48]


def test_the_transform_runs_on_every_read_after_the_cache(tmp_path):
    calls = []
    ds = CachedDataset(Counted(8), tmp_path / "c",
                       transform=lambda a: calls.append(1) or a.sum(),
                       target_transform=lambda y: y * 10)
    assert ds[3] == (3 * 60, 30) and ds[3] == (3 * 60, 30)
    assert len(calls) == 2


def test_values_keep_their_types(tmp_path):
    from PIL import Image

    class Items:
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return {"t": torch.arange(3, dtype=torch.float16) + i, "f": i / 2, "b": i % 2 == 1,
                    "img": Image.fromarray(np.full((2, 3), i * 10, dtype=np.uint8), mode="L")}

    ds = CachedDataset(Items(), tmp_path / "c")
    for i in (2, 2, 3):
        got = ds[i]
        assert torch.equal(got["t"], torch.arange(3, dtype=torch.float16) + i)
        assert got["f"] == i / 2 and type(got["f"]) is float
        assert got["b"] is (i % 2 == 1)
        assert got["img"].mode == "L" and np.asarray(got["img"]).tolist() == [[i * 10] * 3] * 2
    plain = CachedDataset(Squares(), tmp_path / "p")
    assert plain[3] == 9 and len(pickle.dumps(plain)) < 2048  # the maps stay behind
    assert pickle.loads(pickle.dumps(plain))[4] == 16


def test_another_dataset_or_key_rebuilds_the_cache(tmp_path):
    CachedDataset(Counted(8), tmp_path / "c", key="size=32")[5]
    with pytest.warns(UserWarning, match="made for another dataset or work.*differs in key"):
        ds = CachedDataset(Counted(8), tmp_path / "c", key="size=64")
    assert ds.cached_fraction == 0.0

    class Other(Counted):
        pass

    with pytest.warns(UserWarning, match="differs in class"):
        CachedDataset(Other(8), tmp_path / "c", key="size=64")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(PackError, match="holds other files"):
        CachedDataset(Counted(8), tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"


def test_a_folder_of_other_files_is_refused_and_left_as_it_was(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "x.png").write_bytes(b"image")
    with pytest.raises(PackError, match="holds other files: give an empty or new folder"):
        CachedDataset([np.zeros(2)], tmp_path / "data")
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["x.png"]  # no .lock


def test_items_that_change_shape_or_are_not_arrays_are_refused(tmp_path):
    class Growing:
        def __len__(self):
            return 3

        def __getitem__(self, i):
            return np.zeros(i + 1, dtype=np.float32)

    ds = CachedDataset(Growing(), tmp_path / "a")
    with pytest.raises(PackError, match=r"item 2, field 'value': float32 \(3,\), where item 0 "
                                        r"had float32 \(1,\).*pack_dataset"):
        ds[2]
    with pytest.raises(PackError, match="field '1' is a str.*pack_dataset"):
        CachedDataset([(np.zeros(2), "text")], tmp_path / "b")


def test_a_process_killed_while_filling_leaves_only_whole_items(tmp_path):
    script = tmp_path / "fill.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        import numpy as np
        from trainprof.fixes import CachedDataset

        class Slow:
            def __len__(self):
                return 400

            def __getitem__(self, i):
                time.sleep(0.002)
                return np.arange(50_000, dtype=np.int64) + i

        ds = CachedDataset(Slow(), {str(tmp_path / "cache")!r})
        print("ready", flush=True)
        for i in range(400):
            ds[i]
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    time.sleep(0.3)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    filled = np.load(tmp_path / "cache" / "filled.npy")
    column = np.load(tmp_path / "cache" / "value.npy", mmap_mode="r")
    done = np.flatnonzero(filled)
    assert 5 < len(done) < 400, len(done)  # killed part-way
    for i in done:  # every item flagged is complete
        assert np.array_equal(column[i], np.arange(50_000) + i)


# -- DevicePrefetcher, CPU path -------------------------------------------------------------

MEAN, STD = [0.5, 0.4, 0.3], [0.2, 0.25, 0.3]


def _reference(x: torch.Tensor) -> torch.Tensor:
    mean = torch.tensor(MEAN).view(1, 3, 1, 1)
    std = torch.tensor(STD).view(1, 3, 1, 1)
    return (x.float() / 255 - mean) / std


def test_prefetcher_converts_and_normalises_the_image_field_only():
    images = torch.randint(0, 256, (10, 3, 4, 4), dtype=torch.uint8)
    labels = torch.arange(10)
    loader = DataLoader(list(zip(images, labels, strict=True)), batch_size=4)
    batches = list(DevicePrefetcher(loader, "cpu", mean=MEAN, std=STD))
    assert len(DevicePrefetcher(loader, "cpu")) == 3 == len(batches)
    x = torch.cat([b[0] for b in batches])
    assert x.dtype == torch.float32
    torch.testing.assert_close(x, _reference(images))
    assert torch.equal(torch.cat([b[1] for b in batches]), labels)
    # the batch transform runs on [0, 1] floats, before Normalize
    flipped = list(DevicePrefetcher(loader, "cpu", mean=MEAN, std=STD,
                                    batch_transform=lambda t: 1 - t))
    torch.testing.assert_close(
        torch.cat([b[0] for b in flipped]),
        (1 - images.float() / 255 - torch.tensor(MEAN).view(1, 3, 1, 1))
        / torch.tensor(STD).view(1, 3, 1, 1))
    # dict batches name the field; channels_last on request; plain tensor batches
    dicts = DataLoader([{"image": im, "id": i} for i, im in enumerate(images)], batch_size=5)
    out = next(iter(DevicePrefetcher(dicts, "cpu", image_field="image", channels_last=True)))
    assert out["image"].is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(out["image"], images[:5].float() / 255)
    assert out["id"].tolist() == [0, 1, 2, 3, 4]
    plain = next(iter(DevicePrefetcher(DataLoader(images, batch_size=10), "cpu")))
    torch.testing.assert_close(plain, images.float() / 255)
    with pytest.raises(ValueError, match="both mean and std"):
        DevicePrefetcher(loader, "cpu", mean=MEAN)
