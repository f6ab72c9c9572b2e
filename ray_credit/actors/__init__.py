"""Rollout services as plain classes: generator, retriever, judge, scorer, learner.

Each module holds classes with no Ray inside; ``ray.remote(cls).options(...)`` wraps them
at wiring time, so resources come from config and never from a decorator. Heavy imports
(torch, transformers, faiss, vLLM) happen inside the modules that need them, never here.
"""

from __future__ import annotations


def actor_lost_errors() -> tuple[type[Exception], ...]:
    """What a call raises when its actor's process dies under it: ``RayActorError``, or
    ``OutOfMemoryError`` when Ray's memory monitor killed the process during the call.
    Ray restarts the actor either way while it has restarts left, so whoever recovers
    from one recovers from both."""
    import ray.exceptions

    return (ray.exceptions.RayActorError, ray.exceptions.OutOfMemoryError)
