"""`trainprof pack` and `trainprof.fixes.PackedDataset`: real files, DataLoaders, CLI."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, RandomSampler

from trainprof.fixes import PackedDataset, PackError, pack_dataset, pack_folder
from trainprof.fixes.pack_format import read_manifest

Image = pytest.importorskip("PIL.Image")


def _image_folder(root: Path, n: int, *, sizes: list[tuple[int, int]] | None = None,
                  classes: int = 3) -> list[tuple[Path, int]]:
    """n PNGs in class sub-folders plus a top-level marker; returns ImageFolder's samples."""
    rng = np.random.default_rng(1)
    for i in range(n):
        h, w = (sizes or [(6, 5)])[i % len(sizes or [(6, 5)])]
        folder = root / f"class_{'abc'[i % classes]}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    (root / "done").touch()
    # torchvision's ImageFolder order, written out independently: classes sorted, files sorted
    names = sorted(d.name for d in root.iterdir() if d.is_dir())
    return [(f, label) for label, name in enumerate(names)
            for f in sorted((root / name).iterdir(), key=lambda p: p.name)]


def _pixels(path: Path) -> np.ndarray:
    with Image.open(path) as img:
        return np.array(img.convert("RGB"))


def test_folder_pack_has_imagefolder_samples_in_its_order(tmp_path):
    expected = _image_folder(tmp_path / "src", 40, sizes=[(6, 5), (4, 7)])
    manifest = pack_folder(tmp_path / "src", tmp_path / "pack")
    ds = PackedDataset(tmp_path / "pack")
    assert len(ds) == 40 == manifest["count"]
    assert ds.classes == ["class_a", "class_b", "class_c"]
    assert ds.class_to_idx == {"class_a": 0, "class_b": 1, "class_c": 2}
    assert ds.targets == [label for _, label in expected]
    assert manifest["source"]["skipped_top_level_files"] == 1  # the "done" marker
    raw = PackedDataset(tmp_path / "pack", decode=False)
    for i, (path, label) in enumerate(expected):
        image, got_label = ds[i]
        assert got_label == label
        assert np.array_equal(np.asarray(image), _pixels(path))
        assert raw[i][0] == path.read_bytes()  # the file's bytes, exactly
        assert ds.path_of(i) == str(path.relative_to(tmp_path / "src"))
    # images of two sizes decode to a ragged field; ImageFolder's transform/target_transform
    decoded = pack_folder(tmp_path / "src", tmp_path / "decoded", decode=True)
    assert {f["name"]: f["kind"] for f in decoded["fields"]}["image"] == "ragged"
    dd = PackedDataset(tmp_path / "decoded", transform=lambda a: a.shape,
                       target_transform=lambda y: y + 100)
    assert dd[1] == (_pixels(expected[1][0]).shape, expected[1][1] + 100)


def test_decoded_pack_feeds_a_dataloader_with_workers_the_same_batches(tmp_path):
    expected = _image_folder(tmp_path / "src", 96)
    pack_folder(tmp_path / "src", tmp_path / "pack", decode=True)
    ds = PackedDataset(tmp_path / "pack", transform=torch.from_numpy)
    ds[0]  # handles opened before the fork: the workers must open their own
    reference = [(torch.from_numpy(_pixels(p)), y) for p, y in expected]
    sampler = RandomSampler(range(96), generator=torch.Generator().manual_seed(3))
    order = list(sampler)
    loader = DataLoader(ds, batch_size=16, sampler=order, num_workers=2)
    seen = 0
    for x, y in loader:
        want = order[seen : seen + len(y)]
        assert torch.equal(x, torch.stack([reference[i][0] for i in want]))
        assert y.tolist() == [reference[i][1] for i in want]
        seen += len(y)
    assert seen == 96
    # the DataLoader reads a whole batch with one __getitems__ call (sorted reads)
    calls = []

    class Counted(PackedDataset):
        def __getitems__(self, indices):
            calls.append(list(indices))
            return super().__getitems__(indices)

    batches = list(DataLoader(Counted(tmp_path / "pack"), batch_size=32, sampler=order))
    assert [len(c) for c in calls] == [32, 32, 32] and len(batches) == 3


def test_pack_dataset_round_trips_every_kind_of_value(tmp_path):
    class Items:
        def __len__(self):
            return 12

        def __getitem__(self, i):
            return {
                "tokens": torch.arange(i + 1, dtype=torch.int32),  # ragged tensor
                "weight": i * 0.25,  # float column
                "label": i % 4,  # int column
                "flag": i % 2 == 0,  # bool column
                "emb": np.full((2, 3), i, dtype=np.float16),  # fixed-shape array
                "text": "é" * i,  # utf8
                "blob": bytes([i]) * 3,  # raw
                "meta": {"i": i, "tags": ["x"] * i},  # pickled
                "half": torch.full((2,), float(i), dtype=torch.bfloat16),  # no numpy dtype
            }

    pack_dataset(Items(), tmp_path / "pack")
    kinds = {f["name"]: f["kind"] for f in read_manifest(tmp_path / "pack")["fields"]}
    assert kinds == {"tokens": "ragged", "weight": "array", "label": "array", "flag": "array",
                     "emb": "array", "text": "blob", "blob": "blob", "meta": "blob",
                     "half": "blob"}
    ds = PackedDataset(tmp_path / "pack")
    items = Items()
    for i in [11, 0, 5, 5, -1]:
        got, want = ds[i], items[i % 12]
        assert list(got) == list(want)
        assert torch.equal(got["tokens"], want["tokens"]) and got["tokens"].dtype == torch.int32
        assert type(got["weight"]) is float and got["weight"] == want["weight"]
        assert type(got["label"]) is int and got["label"] == want["label"]
        assert type(got["flag"]) is bool and got["flag"] == want["flag"]
        assert got["emb"].dtype == np.float16 and np.array_equal(got["emb"], want["emb"])
        assert got["text"] == want["text"] and got["blob"] == want["blob"]
        assert got["meta"] == want["meta"]
        assert torch.equal(got["half"], want["half"])
    # tuples come back as tuples, a plain value as itself; fields= picks a subset
    pack_dataset([(np.int64(i), f"s{i}") for i in range(5)], tmp_path / "tuples")
    assert PackedDataset(tmp_path / "tuples")[3] == (3, "s3")
    assert PackedDataset(tmp_path / "tuples", fields=["1"])[4] == "s4"
    pack_dataset([float(i) for i in range(5)], tmp_path / "single")
    assert PackedDataset(tmp_path / "single")[2] == 2.0
    with pytest.raises(IndexError, match="index 5 is out of range"):
        PackedDataset(tmp_path / "single")[5]


def test_rows_spread_over_shards_read_back_exactly(tmp_path):
    rows = [(bytes(range(i % 200)) * 7, f"name-{i}") for i in range(300)]
    manifest = pack_dataset(rows, tmp_path / "pack", shard_bytes=20_000)
    counts = [s["count"] for s in manifest["shards"]]
    assert len(counts) >= 8 and sum(counts) == 300  # 174 kB of rows in 20 kB shards
    ds = PackedDataset(tmp_path / "pack")
    shuffled = np.random.default_rng(0).permutation(300).tolist()
    assert ds.__getitems__(shuffled) == [rows[i] for i in shuffled]


def test_pickled_dataset_carries_the_path_not_the_data(tmp_path):
    pack_dataset([np.zeros(4096, dtype=np.float64) + i for i in range(64)], tmp_path / "pack")
    ds = PackedDataset(tmp_path / "pack")
    assert float(ds[7][0]) == 7.0  # opened: 2 MB mapped
    blob = pickle.dumps(ds)
    assert len(blob) < 4096
    assert float(pickle.loads(blob)[9][0]) == 9.0


def test_an_interrupted_pack_leaves_nothing_and_keeps_the_old_one(tmp_path):
    class Failing:
        def __len__(self):
            return 100

        def __getitem__(self, i):
            if i == 60:
                raise KeyboardInterrupt  # Ctrl-C while packing
            return np.arange(3) + i

    with pytest.raises(KeyboardInterrupt):
        pack_dataset(Failing(), tmp_path / "pack")
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no pack, no partial folder
    pack_dataset([np.arange(3)] * 5, tmp_path / "pack")
    with pytest.raises(KeyboardInterrupt):
        pack_dataset(Failing(), tmp_path / "pack", overwrite=True)
    assert len(PackedDataset(tmp_path / "pack")) == 5  # the earlier pack, untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pack"]
    # a pack without its manifest (written by hand, or copied half) is refused clearly
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "shard-00000.bin").write_bytes(b"x")
    with pytest.raises(PackError, match="not a finished pack.*interrupted"):
        PackedDataset(tmp_path / "half")
    # a truncated shard is found before any read returns wrong data
    shard = tmp_path / "pack" / "shard-00000.bin"
    pack_dataset([b"abc", b"defg"], tmp_path / "bytes")
    shard = tmp_path / "bytes" / "shard-00000.bin"
    shard.write_bytes(shard.read_bytes()[:-1])
    with pytest.raises(PackError, match="wrong size"):
        PackedDataset(tmp_path / "bytes")


def test_rows_that_change_layout_are_refused(tmp_path):
    with pytest.raises(PackError, match="row 1, field 'value': dtype int64 differs"):
        pack_dataset([np.zeros(2, dtype=np.float32), np.zeros(2, dtype=np.int64)],
                     tmp_path / "a")
    with pytest.raises(PackError, match=r"row 1: expected a dict with keys \['x'\]"):
        pack_dataset([{"x": 1}, {"y": 2}], tmp_path / "b")
    assert not any(tmp_path.iterdir())


def _trainprof(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trainprof", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def test_cli_packs_checks_and_proves_the_reads(tmp_path):
    _image_folder(tmp_path / "src", 120)
    done = _trainprof("pack", "--decode", "--json", "src", "out", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    reads = doc["reads"]
    assert reads["identical"] is True and reads["decoded"] is True and reads["samples"] == 120
    # a decoded column against a PNG decode per file: many times faster on any machine
    assert reads["pack_per_s"] > 3 * reads["files_per_s"]
    assert doc["manifest"]["classes"] == ["class_a", "class_b", "class_c"]
    assert "packing: 120 / 120 (100%)" in done.stderr
    text = _trainprof("pack", "src", "raw", cwd=tmp_path)
    assert text.returncode == 0, text.stderr
    assert "120 samples (3 classes, 1 top-level file skipped" in text.stdout
    assert "content identical" in text.stdout and 'PackedDataset("raw"' in text.stdout


@pytest.mark.parametrize(("args", "message"), [
    (["missing", "out"], "error: no such folder: missing"),
    (["src", "existing"], "error: existing already exists (replace it with --force)"),
    (["src", "notes.txt"], "error: notes.txt is a file: give a folder for the pack"),
    (["--decode", "--ext", "txt", "src", "out"], "error: --decode needs image or .npy files"),
    (["--ext", "jpg", "src", "out"], "error: no files to pack under src with extensions .jpg"),
    (["--shard-size", "0", "src", "out"], "error: argument --shard-size: expected a positive"),
    (["--shard-size", "1", "src", "out"], "error: argument --shard-size: expected at least 1M "
                                          "(a shard is a file of its own), got '1' (see "
                                          "'trainprof pack --help')"),
    (["--shard-size", "-5M", "src", "out"], "error: argument --shard-size: expected a positive "
                                            "size, got '-5M' (see 'trainprof pack --help')"),
    (["src", "src/inner.pack"], "error: cannot pack src into src/inner.pack, a folder inside it"),
])
def test_cli_bad_input_is_one_error_line(tmp_path, args, message):
    _image_folder(tmp_path / "src", 6)
    (tmp_path / "src" / "class_a" / "note.txt").write_text("x")
    pack_dataset([1, 2], tmp_path / "existing")
    (tmp_path / "notes.txt").write_text("mine")
    done = _trainprof("pack", *args, cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith(message)
    assert "Traceback" not in done.stderr
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert not (tmp_path / "out").exists()
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]


def test_progress_lines_in_a_log_give_the_share_done() -> None:
    import io

    from trainprof.report.pack_progress import progress_reporter

    log = io.StringIO()
    with progress_reporter("packing", log) as progress:
        for done in (0, 100, 768, 1024, 2047, 2048):
            progress(done, 2048)
    assert log.getvalue().splitlines() == [  # a line a tenth, each with its own percent
        "  packing: 0 / 2,048 (0%)", "  packing: 768 / 2,048 (37%)",
        "  packing: 1,024 / 2,048 (50%)", "  packing: 2,047 / 2,048 (99%)",
        "  packing: 2,048 / 2,048 (100%)"]


def test_a_stray_file_among_the_images_is_skipped_as_imagefolder_does(tmp_path):
    """One notes.txt in a class folder made every row raw bytes, and training crashed."""
    expected = _image_folder(tmp_path / "src", 12)
    (tmp_path / "src" / "class_b" / "notes.txt").write_text("x")
    manifest = pack_folder(tmp_path / "src", tmp_path / "pack")
    assert manifest["codec"] == "image" and manifest["count"] == 12
    assert manifest["source"]["skipped_non_image_files"] == 1
    ds = PackedDataset(tmp_path / "pack")
    assert ds.targets == [label for path, label in expected if path.suffix == ".png"]
    assert np.array_equal(np.asarray(ds[5][0]), _pixels(expected[5][0]))
    done = _trainprof("pack", "src", "pack2", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "1 file that is not an image skipped, as ImageFolder does" in " ".join(
        done.stdout.split())


def test_a_sample_that_does_not_decode_names_its_file(tmp_path):
    _image_folder(tmp_path / "src", 6)
    (tmp_path / "src" / "class_b" / "1.png").write_bytes(b"not a png")
    pack_folder(tmp_path / "src", tmp_path / "pack")
    ds = PackedDataset(tmp_path / "pack")
    with pytest.raises(Image.UnidentifiedImageError,
                       match=r"\(sample 2, from class_b/1\.png of .*pack\)"):
        ds[2]


def test_flat_folder_of_npy_files_packs_to_arrays_in_path_order(tmp_path):
    rng = np.random.default_rng(2)
    arrays = {f"{name}.npy": rng.standard_normal((2, 3)).astype(np.float32)
              for name in ("b", "a", "c/d")}
    (tmp_path / "src" / "c").mkdir(parents=True)
    for name, array in arrays.items():
        np.save(tmp_path / "src" / name, array)
    manifest = pack_folder(tmp_path / "src", tmp_path / "pack", decode=True)
    assert "classes" not in manifest  # files at the top: no class folders
    ds = PackedDataset(tmp_path / "pack")
    assert len(ds) == 3
    for i, name in enumerate(["a.npy", "b.npy", "c/d.npy"]):
        assert isinstance(ds[i], np.ndarray) and np.array_equal(ds[i], arrays[name])
        assert ds.path_of(i) == name
    with pytest.raises(AttributeError, match="no label field"):
        _ = ds.targets


def test_ctrl_c_while_packing_leaves_no_partial_pack(tmp_path):
    src = tmp_path / "src"
    for c in range(4):
        (src / f"c{c}").mkdir(parents=True)
        for i in range(5000):
            (src / f"c{c}" / f"{i}.bin").write_bytes(os.urandom(256))
    proc = subprocess.Popen([sys.executable, "-m", "trainprof", "pack", "src", "out"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    assert proc.stderr is not None
    for line in proc.stderr:
        if "packing: " in line:  # the first progress line: rows are being written
            break
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "trainprof: interrupted" in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no out, no partial folder


def test_pack_dataset_packs_one_pass_of_a_stream(tmp_path):
    """The cpu_transforms fix of an IterableDataset (CachedDataset needs len() and [i]):
    one pass of the stream in this process, read back map-style in the stream's order."""
    from torch.utils.data import DataLoader, IterableDataset

    class Tokens(IterableDataset):
        def __iter__(self):
            for i in range(10):
                t = torch.arange(i, i + 9)
                yield t[:-1], t[1:]

    pack_dataset(Tokens(), tmp_path / "cache" / "train.pack")
    ds = PackedDataset(tmp_path / "cache" / "train.pack")
    assert len(ds) == 10
    for (x, y), (wx, wy) in zip(DataLoader(ds, batch_size=4),
                                DataLoader(Tokens(), batch_size=4), strict=True):
        assert torch.equal(x, wx) and torch.equal(y, wy)
    with pytest.raises(PackError, match="map-style dataset .* or an IterableDataset"):
        pack_dataset(object(), tmp_path / "nothing")
