"""The broadcast weight group on CPU (gloo), members as threads of one process."""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")

from ray_credit.actors.collective import WeightGroup, _buckets, manifest_of  # noqa: E402


def test_buckets_split_by_dtype_and_size():
    manifest = [
        ("a", (256,), "float32"),  # 1 KiB
        ("b", (256,), "float32"),
        ("c", (4,), "int64"),
        ("d", (1024,), "float32"),  # 4 KiB: over the limit alone, a bucket of its own
        ("e", (8,), "float32"),
    ]
    names = [[n for n, _, _ in b] for b in _buckets(manifest, 2048)]
    assert names == [["a", "b"], ["c"], ["d"], ["e"]]


def test_broadcast_reaches_every_member_exactly():
    state = {
        "w": torch.randn(300, 7),
        "b": torch.arange(5, dtype=torch.int64),
        "h": torch.randn(3, dtype=torch.float64),
        "v": torch.randn(1000),
    }
    manifest = manifest_of(state)
    assert [n for n, _, _ in manifest] == sorted(state)
    sender = WeightGroup("gloo", 3, timeout_s=30)
    address = sender.open("127.0.0.1")
    received: dict[int, dict] = {}

    def member(rank: int) -> None:
        group = WeightGroup("gloo", 3, timeout_s=30)
        group.join(address, rank, manifest)
        received[rank] = group.broadcast(None, bucket_mb=0.002)  # ~2 KiB: several buckets

    threads = [threading.Thread(target=member, args=(r,)) for r in (1, 2)]
    for t in threads:
        t.start()
    sender.join(address, 0, manifest)
    assert sender.broadcast(state, bucket_mb=0.002) == {}
    for t in threads:
        t.join(timeout=30)
    for rank in (1, 2):
        got = received[rank]
        assert set(got) == set(state)
        for name, value in state.items():
            assert got[name].dtype == value.dtype and torch.equal(got[name], value), name


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="backend must be 'gloo' or 'nccl'"):
        WeightGroup("mpi", 2)
    with pytest.raises(ValueError, match="needs the learner and >= 1 generator"):
        WeightGroup("gloo", 1)
    with pytest.raises(RuntimeError, match="join the weight group before broadcasting"):
        WeightGroup("gloo", 2).broadcast({})
