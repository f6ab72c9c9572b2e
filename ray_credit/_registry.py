"""Plugin discovery shared by the estimator and signal registries."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Iterable
from typing import Any


def discover(package: str, path: Iterable[str], attribute: str, register: Callable) -> None:
    """Import every module of ``package`` whose name does not start with ``_`` (sorted) and
    ``register`` each item of its module-level ``attribute`` tuple."""
    for info in sorted(pkgutil.iter_modules(path), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module: Any = importlib.import_module(f"{package}.{info.name}")
        for item in getattr(module, attribute, ()):
            register(item)
