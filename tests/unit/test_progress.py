"""Progress bars: drawn only where someone watches, and counting what they say."""

from __future__ import annotations

import pytest

from ray_credit import progress
from ray_credit.log import PROGRESS_ENV, setup_logging


class Recorder:
    def __init__(self, total, desc, unit):
        self.total, self.desc, self.unit, self.count, self.closed = total, desc, unit, 0, False

    def update(self, n=1):
        self.count += n

    def close(self):
        self.closed = True


def test_bars_are_drawn_only_on_a_terminal_at_info(monkeypatch):
    monkeypatch.delenv(PROGRESS_ENV, raising=False)
    monkeypatch.setattr("sys.stderr.isatty", lambda: False)
    assert isinstance(progress.progress_bar(10, "x"), progress.NoBar)  # a log file, a pipe
    monkeypatch.setattr("sys.stderr.isatty", lambda: True)
    setup_logging("warning")
    assert isinstance(progress.progress_bar(10, "x"), progress.NoBar)  # asked for quiet
    setup_logging("info")
    bar = progress.progress_bar(10, "x")
    assert not isinstance(bar, progress.NoBar)
    bar.close()
    monkeypatch.setenv(PROGRESS_ENV, "0")  # a worker of a run whose driver is not watched
    assert isinstance(progress.progress_bar(10, "x"), progress.NoBar)


def test_a_generators_bar_counts_every_rollout_once(monkeypatch):
    pytest.importorskip("torch")
    from ray_credit.actors import generator as generator_module
    from ray_credit.actors.generator import Generator, GeneratorConfig
    from ray_credit.models import load_model
    from tests.unit.test_generator import QUESTIONS, WordRetriever

    bars = []
    monkeypatch.setattr(
        generator_module,
        "progress_bar",
        lambda total, desc, unit: bars.append(Recorder(total, desc, unit)) or bars[-1],
    )
    config = GeneratorConfig(group_size=3, max_turns=3, max_new_tokens=8, seed=2)
    gen = Generator(load_model("tiny-random"), WordRetriever(), config)
    batch = gen.generate(QUESTIONS, progress="held-out rollouts")
    (bar,) = bars
    assert bar.total == bar.count == len(batch) == 3 * len(QUESTIONS) and bar.closed
    assert bar.desc == "held-out rollouts"
    gen.generate(QUESTIONS)  # no title, no bar
    assert len(bars) == 1
    batch, summary = gen.generate_chunk(QUESTIONS, progress="step 2/6: groups [4, 6)")
    assert bars[-1].desc == "step 2/6: groups [4, 6)" and bars[-1].closed
    assert (
        bars[-1].count == bars[-1].total == len(batch) == sum(summary["oldest_versions"].values())
    )


def test_an_index_build_counts_every_passage_embedded_and_added(monkeypatch, tmp_path):
    pytest.importorskip("faiss")
    from ray_credit.actors import index_build

    bars = []
    monkeypatch.setattr(
        index_build,
        "progress_bar",
        lambda total, desc, unit: bars.append(Recorder(total, desc, unit)) or bars[-1],
    )
    docs = [{"id": str(i), "contents": f"title {i}\ndoc {'x' * i}"} for i in range(10)]
    index_build.ensure_index(docs, tmp_path / "idx", shard_docs=4)
    assert [(b.desc, b.count, b.total, b.closed) for b in bars] == [
        ("embedding the corpus", 10, 10, True),
        ("writing the flat index", 10, 10, True),
    ]
