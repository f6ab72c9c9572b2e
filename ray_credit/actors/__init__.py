"""Rollout services as plain classes: generator, retriever, judge, scorer, learner.

Each module holds classes with no Ray inside; ``ray.remote(cls).options(...)`` wraps them
at wiring time, so resources come from config and never from a decorator. Heavy imports
(torch, transformers, faiss, vLLM) happen inside the modules that need them, never here.
"""

from __future__ import annotations
