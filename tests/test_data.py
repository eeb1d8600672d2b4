"""Prepared token datasets as a run reads them: windows across shards, mixture weights, elastic global batches,
separators, and damaged shards."""

import json
import shutil

import numpy as np
import pytest
import torch

from memfit.config import load_prepare_config
from memfit.data.prepare import prepare
from memfit.data.sources import default_corpus_path, source_tree
from memfit.data.tokens import (
    TRAIN,
    VAL,
    TokenDataset,
    document_ids,
    hash_key,
    permute,
    read_manifest,
    token_dtype,
)
from memfit.errors import DataError

from .conftest import ASSETS


def test_shakespeare_ships_inside_the_package():
    path = default_corpus_path()
    assert path.stat().st_size == 1_115_394
    assert path.read_text(encoding="utf-8").startswith("First Citizen:")


def test_token_dtype_follows_vocabulary_size():
    assert token_dtype(65_536) == np.uint16
    assert token_dtype(65_537) == np.uint32
    assert token_dtype(128_256) == np.uint32


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    out = tmp_path_factory.mktemp("tokens") / "mix"
    cfg = load_prepare_config(
        ["val_fraction=0.2", "shard_tokens=3000", "vocab_size=400"], out=str(out), workers=1
    )
    prepare(cfg, source_tree(ASSETS / "mixed_corpus"), progress_bar=False)
    return out


def _stream(directory, manifest, source, split):
    return np.concatenate(
        [
            np.fromfile(directory / source / s["file"], dtype=np.uint16)
            for s in manifest["sources"][source]["shards"]
            if s["split"] == split
        ]
    ).astype(np.int64)


def test_a_window_reads_across_shard_boundaries(dataset):
    manifest = read_manifest(dataset)
    ds = TokenDataset(dataset, "train", 64, None, manifest)
    github = ds.names.index("github")
    stream = ds.streams[github]
    assert len(stream.paths) > 3  # several shards
    whole = _stream(dataset, manifest, "github", "train")
    for boundary in stream.starts[1:-1]:
        start = int(boundary) - 10
        assert np.array_equal(stream.read(start, 65), whole[start : start + 65])


def test_batches_are_a_pure_function_of_the_sequence_numbers_on_any_number_of_ranks(dataset):
    ds = TokenDataset(dataset, "train", 32, None)
    one, _, sources = ds.batch(1337, TRAIN, range(56, 64))  # global batch 7 of 8 sequences
    rank0, _, _ = ds.batch(1337, TRAIN, range(56, 60))
    rank1, _, _ = ds.batch(1337, TRAIN, range(60, 64))
    assert torch.equal(one, torch.cat([rank0, rank1]))  # 2 ranks x 4 = 1 process x 8, row for row
    again, targets, _ = ds.batch(1337, TRAIN, range(56, 64))
    assert torch.equal(one, again)
    assert torch.equal(one[:, 1:], targets[:, :-1])  # targets are the inputs shifted by one
    other, _, _ = ds.batch(1337, TRAIN, range(64, 72))
    assert not torch.equal(one, other)
    assert len(sources) == 8


def test_one_source_is_read_once_per_epoch_in_a_random_order(dataset):
    ds = TokenDataset(dataset, "train", 32, {"github": 1.0})
    github = ds.names.index("github")
    windows = (ds.streams[github].num_tokens - 32) // 32
    whole = _stream(dataset, read_manifest(dataset), "github", "train").tolist()
    orders = []
    for epoch in (0, 1):
        key = hash_key(5, TRAIN, github, epoch)
        starts = [key % 32 + permute(k, windows, key) * 32 for k in range(windows)]
        assert sorted(starts) == [key % 32 + 32 * k for k in range(windows)]  # every window once, one shift
        inputs, _, sources = ds.batch(5, TRAIN, range(epoch * windows, (epoch + 1) * windows))
        assert set(sources) == {github}
        assert all(row.tolist() == whole[s : s + 32] for row, s in zip(inputs, starts, strict=True))
        orders.append(starts)
    assert orders[0] != orders[1]  # another order (and shift) the next epoch


def test_the_permutation_is_a_bijection():
    for size in (1, 2, 3, 5, 64, 1000, 4097):
        for key in (0, hash_key(1, 2, 3)):
            assert sorted(permute(i, size, key) for i in range(size)) == list(range(size))
    assert [permute(i, 1000, 1) for i in range(10)] != [permute(i, 1000, 2) for i in range(10)]


def test_default_mixture_follows_the_tokens_and_weights_are_kept_within_sampling_error(dataset):
    manifest = read_manifest(dataset)
    tokens = {n: s["train"]["tokens"] for n, s in manifest["sources"].items()}
    draws = 6000
    for weights in (
        None,
        {"book": 1.0, "docs": 1.0, "github": 2.0},
        {"book": 0.0, "docs": 3.0, "github": 1.0},
    ):
        ds = TokenDataset(dataset, "train", 32, weights, manifest)
        want = tokens if weights is None else weights
        total = sum(want.values())
        _, _, sources = ds.batch(0, TRAIN, range(draws))
        for i, name in enumerate(ds.names):
            p = want[name] / total
            seen = sources.count(i) / draws
            assert abs(seen - p) <= 4 * (p * (1 - p) / draws) ** 0.5 + 1e-12, (weights, name, seen, p)


def test_validation_windows_stay_in_their_source(dataset):
    manifest = read_manifest(dataset)
    ds = TokenDataset(dataset, "val", 32, None, manifest)
    book = ds.names.index("book")
    inputs, _, sources = ds.batch(1337, VAL, range(6), source=book)
    assert set(sources) == {book}
    whole = _stream(dataset, manifest, "book", "val").tolist()
    row = inputs[0].tolist()
    assert any(whole[i : i + 32] == row for i in range(len(whole) - 31))


def test_document_ids_start_at_each_bos():
    bos, eos = 1, 2
    inputs = torch.tensor([[5, 6, 2, 1, 7, 8, 2, 1, 9]])
    assert document_ids(inputs, bos, eos).tolist() == [[0, 0, 0, 1, 1, 1, 1, 2, 2]]
    assert document_ids(inputs, None, eos).tolist() == [[0, 0, 0, 1, 1, 1, 1, 2, 2]]  # after each EOS


def test_a_source_shorter_than_a_window_and_damaged_shards_are_named(dataset, tmp_path):
    with pytest.raises(DataError, match="source 'book' has .* fewer than one window"):
        TokenDataset(dataset, "val", 10**6, None)
    TokenDataset(
        dataset, "val", 10**6, {"book": 0.0, "docs": 0.0, "github": 0.0} | {"github": 0.0}
    )  # all out
    copy = tmp_path / "copy"
    shutil.copytree(dataset, copy)
    manifest = read_manifest(copy)
    shard = copy / "docs" / manifest["sources"]["docs"]["shards"][0]["file"]
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(DataError, match=f"shard '{shard}' holds .* truncated"):
        TokenDataset(copy, "train", 32, None, manifest)
    shard.unlink()
    with pytest.raises(DataError, match=f"shard '{shard}' is missing"):
        TokenDataset(copy, "train", 32, None, manifest)
    (copy / "manifest.json").write_text("{not json")
    with pytest.raises(DataError, match="not valid JSON"):
        read_manifest(copy)
    (copy / "manifest.json").write_text(json.dumps({"format": "memfit-tokens", "version": 99}))
    with pytest.raises(DataError, match="version 99"):
        read_manifest(copy)
