"""Each chunk's place in its run's sequence of generate calls (its sampling seed's offset)
follows from its position alone: with one generator it is the call's number."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ray_credit.pipeline.runner import Pipeline, PipelineConfig


def _call_of(groups_per_step: int, chunk: int, start: int) -> int:
    return Pipeline._call_of(
        SimpleNamespace(config=PipelineConfig(groups_per_step=groups_per_step), chunk=chunk),
        start,
    )


@pytest.mark.parametrize(("groups_per_step", "chunk"), [(4, 2), (4, 4), (5, 2), (12, 5), (3, 1)])
def test_the_chunks_of_a_run_are_numbered_in_stream_order(groups_per_step, chunk):
    # the dispatcher's layout: each step cut into chunks of `chunk` groups, the last short
    starts = [step * groups_per_step + offset
              for step in range(4) for offset in range(0, groups_per_step, chunk)]  # fmt: skip
    assert [_call_of(groups_per_step, chunk, s) for s in starts] == list(range(len(starts)))


def test_a_chunk_off_the_layout_takes_a_place_no_chunk_on_it_has():
    # next to a chunk restored from a checkpoint written with other chunks: [0, 3) there,
    # so the resumed run's chunk starts at 3, off its own layout of two-group chunks
    on_layout = {_call_of(4, 2, s) for s in range(0, 4000, 2)}
    off = {_call_of(4, 2, s) for s in (3, 5, 4001)}
    assert len(off) == 3 and not off & on_layout
