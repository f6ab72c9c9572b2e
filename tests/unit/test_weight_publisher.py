"""WeightPublisher's version rule, without Ray: versions only move forward, whether sent or
taken as held already (adopt: the targets served an earlier run on the same learner)."""

from __future__ import annotations

import pytest

from ray_credit.pipeline.weights import WeightPublisher


class Target:
    """Stands for an actor; adopt never calls it."""


def test_adopt_takes_a_version_as_published_without_sending():
    publisher = WeightPublisher([Target(), Target()], names=["generator0", "generator1"])
    assert publisher.version is None
    publisher.adopt(4, None)
    assert publisher.version == 4
    assert publisher.metrics["sync/publications"] == 0  # nothing was sent
    assert publisher.pending_refs() == []
    with pytest.raises(ValueError, match="version 4 is not newer than the last published 4"):
        publisher.adopt(4, None)
    with pytest.raises(ValueError, match="version 3 is not newer"):
        publisher.publish(3, {})
