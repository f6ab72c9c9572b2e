"""Data: the embedded synthetic world and loaders for real corpora and question sets.

Importing this package needs numpy and pyarrow only (no Ray, no torch):
:func:`prompt_stream` imports Ray when called.
"""

from ray_credit.data.loaders import (
    QA_KEYS,
    DataFormatError,
    iter_corpus,
    load_corpus,
    load_qa,
    prompt_stream,
)
from ray_credit.data.synthetic import World, WorldConfig, make_world

__all__ = [
    "QA_KEYS",
    "DataFormatError",
    "World",
    "WorldConfig",
    "iter_corpus",
    "load_corpus",
    "load_qa",
    "make_world",
    "prompt_stream",
]
