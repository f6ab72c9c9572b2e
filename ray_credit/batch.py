"""`TrajectoryBatch`: the one Arrow schema every stage of ray_credit exchanges.

One row per trajectory. Turn-aligned columns are ``list<…>`` with exactly one entry per
turn; token-aligned columns are ``list<…>`` with one entry per token. The schema below is
the single place where a column's type and meaning are written down.

Estimators read turn-level columns through zero-copy flat numpy views
(:meth:`TrajectoryBatch.turn_values`, :attr:`TrajectoryBatch.turn_offsets`) and write
their outputs with :meth:`TrajectoryBatch.with_turn_columns`, which reuses the turn
offsets so nothing else is copied. The learner calls :meth:`TrajectoryBatch.to_torch`.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "COLUMNS",
    "ColumnSpec",
    "BatchValidationError",
    "TrajectoryBatch",
    "TURN_STRUCT",
    "register_columns",
]

TURN_STRUCT = pa.struct(
    [
        pa.field("text", pa.string()),
        pa.field("action", pa.string()),
        pa.field("query", pa.string()),
        pa.field("observation", pa.string()),
        pa.field("policy_version", pa.int64()),
    ]
)
ACTIONS = ("search", "answer", "invalid", "truncated")
# group_id is a string column stored dictionary-encoded: the codes are the group index
# every stage needs, computed once when the batch is built instead of hashed per stage.
GROUP_ID_TYPE = pa.dictionary(pa.int32(), pa.string())


@dataclass(frozen=True)
class ColumnSpec:
    """Type, alignment and meaning of one column."""

    type: pa.DataType
    align: str  # "traj" | "turn" | "token"
    doc: str
    required: bool = False
    producer: str = ""
    """Who writes the column, for the error a missing column raises."""


# The schema. `align` says what a list column is aligned with: "turn" lists have one
# entry per turn, "token" lists one entry per token of `input_ids`.
COLUMNS: dict[str, ColumnSpec] = {
    # --- core: every batch has these -----------------------------------------------------
    "group_id": ColumnSpec(
        GROUP_ID_TYPE,
        "traj",
        "prompt group: the G samples of one question (dictionary-encoded)",
        True,
    ),
    "traj_id": ColumnSpec(pa.string(), "traj", "unique id of the trajectory", True),
    "question": ColumnSpec(pa.string(), "traj", "the question", True),
    "gold_answers": ColumnSpec(
        pa.list_(pa.string()), "traj", "accepted answers (any one matches)", True
    ),
    "turns": ColumnSpec(
        pa.list_(TURN_STRUCT),
        "turn",
        "per turn: text (what the policy wrote), action (search/answer/invalid/truncated), "
        "query, observation (tool response text), policy_version (weights that sampled it)",
        True,
    ),
    "answer": ColumnSpec(pa.string(), "traj", "extracted final answer (null when none)"),
    "outcome_reward": ColumnSpec(pa.float64(), "traj", "outcome score (EM by default)", True),
    "data_source": ColumnSpec(
        pa.string(), "traj", "dataset the question came from (for per-source metrics)"
    ),
    "supporting_doc_ids": ColumnSpec(
        pa.list_(pa.string()),
        "traj",
        "corpus ids of the documents that support the gold answer (null: the dataset has none)",
    ),
    "reference_plan": ColumnSpec(
        pa.list_(pa.string()),
        "traj",
        "Search-P1 reference plan: the search steps that answer the question (made offline)",
        producer="The question's reference_plan field (the reference_plan signal makes them; "
        "the generator copies them into its rollouts).",
    ),
    # --- tokens: the learner's view -------------------------------------------------------
    "input_ids": ColumnSpec(
        pa.list_(pa.int32()), "token", "prompt + turns + observations, exactly as sampled/fed"
    ),
    "loss_mask": ColumnSpec(
        pa.list_(pa.int8()), "token", "1 on tokens the policy generated, 0 on prompt/observation"
    ),
    "token_turn": ColumnSpec(
        pa.list_(pa.int16()), "token", "turn index of each token, -1 for prompt tokens"
    ),
    "behavior_logprobs": ColumnSpec(
        pa.list_(pa.float32()),
        "token",
        "logprob of each generated token under the sampling policy (0 elsewhere)",
    ),
    # --- rollout details (the generator) ---------------------------------------------------
    "turn_doc_ids": ColumnSpec(
        pa.list_(pa.list_(pa.string())),
        "turn",
        "corpus ids the turn's search returned, best first (null: the turn did not search)",
    ),
    # --- signals: turn_contains_gold comes with every rollout; the columns of the judged
    # and scored signals are declared by their modules in ray_credit/signals/ and added to
    # this table by register_columns when the package is imported.
    "turn_contains_gold": ColumnSpec(
        pa.list_(pa.bool_()),
        "turn",
        "the turn's observation contains a gold answer",
        producer="The generator fills it (or ray_credit.qa.turn_contains_gold).",
    ),
    # --- estimator outputs ----------------------------------------------------------------
    "turn_rewards": ColumnSpec(
        pa.list_(pa.float32()), "turn", "per-turn reward an estimator assigned (diagnostic)"
    ),
    "turn_advantages": ColumnSpec(
        pa.list_(pa.float32()),
        "turn",
        "advantage of each turn (estimator output)",
        producer="Run an estimator first (ray_credit.estimators.get_estimator(name)).",
    ),
    "turn_clip_scale": ColumnSpec(
        pa.list_(pa.float32()), "turn", "per-turn clip-range scale (A2TGPO; 1 = unscaled)"
    ),
}
REQUIRED = tuple(name for name, spec in COLUMNS.items() if spec.required)
TOKEN_COLUMNS = tuple(name for name, spec in COLUMNS.items() if spec.align == "token")
ROLLOUT_COLUMNS = (
    *REQUIRED,
    "answer",
    "data_source",
    "supporting_doc_ids",
    "reference_plan",
    *TOKEN_COLUMNS,
    "turn_doc_ids",
    "turn_contains_gold",
)
"""The columns of every batch a generator returns (question fields null when the dataset
lacks them); everything else comes from signals and estimators."""


def register_columns(specs: Mapping[str, ColumnSpec]) -> None:
    """Add columns declared outside this module (a signal's) to :data:`COLUMNS`.

    Registering the same spec twice is a no-op; a name that is already taken by a
    different spec raises, so two signals can never disagree on a column's type."""
    for name, spec in specs.items():
        if spec.align not in ("traj", "turn"):
            raise ValueError(f"column {name!r}: a signal writes 'traj' or 'turn' columns")
        known = COLUMNS.get(name)
        if known is not None and known != spec:
            raise ValueError(
                f"column {name!r} is already declared as {known.type} ({known.doc!r}); "
                "give the new column another name"
            )
        COLUMNS[name] = spec


_METRICS_KEY = b"ray_credit.metrics"


class BatchValidationError(ValueError):
    """A batch violates the schema; the message names the row, the column and the fix."""


def _fail(msg: str) -> NoReturn:
    raise BatchValidationError(msg)


class TrajectoryBatch:
    """An immutable batch of trajectories backed by one ``pyarrow.Table``.

    Build one with :meth:`from_records` or :meth:`from_table` (both validate), read it
    with :meth:`to_records`, the flat views, or :meth:`to_torch`. ``metrics`` is a flat
    ``dict[str, float]`` of counters that stages attach (kept in the schema metadata, so
    it survives IPC and Parquet).
    """

    __slots__ = ("_table", "__dict__")

    def __init__(self, table: pa.Table, *, validate: bool = True):
        if not isinstance(table, pa.Table):
            raise TypeError(f"TrajectoryBatch wants a pyarrow.Table, got {type(table).__name__}")
        if any(column.num_chunks > 1 for column in table.columns):
            table = table.combine_chunks()
        self._table = table
        if validate:
            self.validate()

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_table(cls, table: pa.Table) -> TrajectoryBatch:
        """Wrap and validate an Arrow table (columns are cast to the schema's types).

        A cast that would change data is refused: a struct field the schema lacks (the
        cast would drop it), a number other than 0/1 for a bool, a fraction for an
        integer, a float64 beyond float32's range."""
        if not isinstance(table, pa.Table):
            raise TypeError(
                f"from_table takes a pyarrow.Table, got {type(table).__name__}; build one "
                "with pyarrow.table({name: values}), or pass a list of dicts (one per "
                "trajectory) to TrajectoryBatch.from_records"
            )
        return cls(_cast_known_columns(table))

    @classmethod
    def from_records(cls, records: Sequence[Mapping[str, Any]]) -> TrajectoryBatch:
        """Build a batch from a list of dicts named as in :data:`COLUMNS`.

        A turn may omit struct fields (they become null) but not add any: a field it
        does not know (a typo) raises, as does a string where a list is due (``gold_answers
        = 'Bob'``), as does a fraction for an integer (``policy_version = 1.7``). Unknown
        columns are kept with the type Arrow infers for them, unless the name is a near
        miss of a schema column (``data_sorce``): declare a new column that close to a
        known one with :func:`register_columns`.
        """
        if isinstance(records, Mapping):
            _fail("from_records takes a list of dicts, one per trajectory, and got one dict; "
                  "wrap it in a list: from_records([record])")  # fmt: skip
        if not records:
            _fail("from_records got no records; a TrajectoryBatch holds at least one trajectory")
        names: list[str] = []
        for i, rec in enumerate(records):
            _check_record(i, rec)
            for key in rec:
                if key not in names:
                    names.append(key)
        _check_names(names)
        arrays = {name: _build_column(name, [rec.get(name) for rec in records]) for name in names}
        return cls(pa.table(arrays))

    def to_records(self) -> list[dict[str, Any]]:
        """The batch as a list of plain dicts (one per trajectory)."""
        return self._table.to_pylist()

    # ------------------------------------------------------------------ serialization
    def to_ipc(self) -> pa.Buffer:
        """Serialize to one Arrow IPC stream buffer (schema metadata included)."""
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, self._table.schema) as writer:
            writer.write_table(self._table)
        return sink.getvalue()

    @classmethod
    def from_ipc(cls, data: pa.Buffer | bytes | memoryview) -> TrajectoryBatch:
        with pa.ipc.open_stream(
            pa.py_buffer(data) if not isinstance(data, pa.Buffer) else data
        ) as reader:
            return cls(reader.read_all())

    def write_parquet(self, path: str | Any) -> None:
        pq.write_table(self._table, path)

    @classmethod
    def read_parquet(cls, path: str | Any) -> TrajectoryBatch:
        return cls(pq.read_table(path))

    def __reduce__(self):
        # Ship as one contiguous IPC buffer: the object store copies that far faster
        # than a Table's many small buffers.
        return (_from_ipc_unchecked, (self.to_ipc(),))

    # ------------------------------------------------------------------ basic access
    @property
    def table(self) -> pa.Table:
        return self._table

    @property
    def num_trajectories(self) -> int:
        return self._table.num_rows

    def __len__(self) -> int:
        return self._table.num_rows

    @property
    def column_names(self) -> list[str]:
        return self._table.column_names

    def __contains__(self, name: str) -> bool:
        return name in self._table.column_names

    def column(self, name: str) -> pa.Array:
        self.require((name,))
        chunked = self._table.column(name)
        # The table is combined at construction: one chunk, used as is (no copy).
        return chunked.chunk(0) if chunked.num_chunks == 1 else chunked.combine_chunks()

    @property
    def metrics(self) -> dict[str, float]:
        meta = self._table.schema.metadata or {}
        raw = meta.get(_METRICS_KEY)
        return json.loads(raw) if raw else {}

    def __repr__(self) -> str:
        return (
            f"TrajectoryBatch({self.num_trajectories} trajectories, {self.num_groups} groups, "
            f"{self.num_turns} turns, columns={self.column_names})"
        )

    def require(self, names: Iterable[str], *, by: str | None = None) -> None:
        """Raise if any of ``names`` is missing, saying which stage adds it."""
        missing = [n for n in names if n not in self._table.column_names]
        if missing:
            who = f"{by} needs" if by else "needed"
            _fail(
                f"column(s) {missing} {who} but missing from the batch (has {self.column_names}). "
                f"{_producer_hint(missing)}"
            )

    # ------------------------------------------------------------------ group view
    @cached_property
    def _group_layout(self) -> tuple[np.ndarray, np.ndarray | None, np.ndarray, np.ndarray]:
        codes = self.column("group_id").indices.to_numpy()
        n = len(codes)
        starts = (
            np.flatnonzero(np.concatenate(([True], codes[1:] != codes[:-1])))
            if n
            else np.zeros(0, np.int64)
        )
        if n and np.bincount(codes[starts]).max() == 1:
            # Each group is one contiguous run (a generator emits the G samples of a prompt
            # together): groups are numbered by run.
            sizes = np.diff(np.append(starts, n))
            return np.repeat(np.arange(len(starts), dtype=np.int64), sizes), None, starts, sizes
        # Any other order (e.g. after select): number the codes by first appearance.
        used, first = np.unique(codes, return_index=True)
        rank = np.empty(len(used), dtype=np.int64)
        rank[np.argsort(first)] = np.arange(len(used))
        lookup = np.zeros(int(used[-1]) + 1 if len(used) else 0, dtype=np.int64)
        lookup[used] = rank
        index = lookup[codes]
        sizes = np.bincount(index)
        starts = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64)
        return index, np.argsort(index, kind="stable"), starts, sizes

    @property
    def group_index(self) -> np.ndarray:
        """int64 group code per trajectory, numbered in order of first appearance."""
        return self._group_layout[0]

    @property
    def group_order(self) -> np.ndarray | None:
        """Row order that makes groups contiguous (stable), or None when they already are."""
        return self._group_layout[1]

    @property
    def group_starts(self) -> np.ndarray:
        """First row of each group in ``group_order`` (for ``np.add.reduceat``)."""
        return self._group_layout[2]

    @property
    def group_sizes(self) -> np.ndarray:
        """Number of trajectories in each group."""
        return self._group_layout[3]

    @property
    def num_groups(self) -> int:
        return len(self.group_sizes)

    # ------------------------------------------------------------------ turn view
    @cached_property
    def turn_offsets(self) -> np.ndarray:
        """int64 array of length n+1: turns of trajectory i are flat[o[i]:o[i+1]]."""
        offsets = np.asarray(self.column("turns").offsets, dtype=np.int64)
        return offsets - offsets[0]

    @cached_property
    def turn_counts(self) -> np.ndarray:
        return np.diff(self.turn_offsets)

    @property
    def num_turns(self) -> int:
        return int(self.turn_offsets[-1])

    @cached_property
    def turn_traj_index(self) -> np.ndarray:
        """Owning trajectory (row) of every flat turn."""
        return np.repeat(np.arange(len(self), dtype=np.int64), self.turn_counts)

    @cached_property
    def turn_position(self) -> np.ndarray:
        """0-based index of every flat turn inside its trajectory."""
        return np.arange(self.num_turns, dtype=np.int64) - np.repeat(
            self.turn_offsets[:-1], self.turn_counts
        )

    @cached_property
    def is_last_turn(self) -> np.ndarray:
        last = np.zeros(self.num_turns, dtype=bool)
        last[self.turn_offsets[1:] - 1] = True
        return last

    def turn_values(self, name: str, *, null: float | None = None) -> np.ndarray:
        """Flat numpy view of a turn-aligned column (zero-copy when it has no nulls).

        ``turns`` fields are addressed as ``"turns.action"``. A column with nulls raises
        unless ``null`` gives the value to put in their place (use :meth:`turn_valid`
        to know where they were).
        """
        values = self._flat_turn_array(name)
        if pa.types.is_boolean(values.type) and values.null_count and null is not None:
            return bool_values(values, null=bool(null))
        if values.null_count:
            if null is None:
                _fail(
                    f"{name!r} has {values.null_count} null entries; pass null=<fill value> and "
                    f"use turn_valid({name!r}) to treat them explicitly"
                )
            values = values.fill_null(pa.scalar(null, values.type))
        if pa.types.is_boolean(values.type):
            return bool_values(values)
        if pa.types.is_string(values.type) or pa.types.is_large_string(values.type):
            return np.asarray(values.to_pylist(), dtype=object)
        return values.to_numpy(zero_copy_only=False)

    def turn_valid(self, name: str) -> np.ndarray:
        """Boolean mask over flat turns: True where ``name`` is not null."""
        return valid_mask(self._flat_turn_array(name))

    def turn_view(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """A numeric turn column as a zero-copy flat view and its validity mask.

        Entries under a null are arbitrary: read the view only where the mask is True
        (this skips the ``fill_null`` copy that :meth:`turn_values` makes).
        """
        values, valid = numeric_view(self._flat_turn_array(name))
        if values is None:
            _fail(f"turn_view needs a numeric column; {name!r} is not (use turn_values)")
        return values, valid

    def _flat_turn_array(self, name: str) -> pa.Array:
        if name.startswith("turns."):
            field = name.split(".", 1)[1]
            if field not in TURN_STRUCT.names:
                _fail(f"turns has no field {field!r}; fields are {TURN_STRUCT.names}")
            return self.column("turns").flatten().field(field)
        spec = COLUMNS.get(name)
        if spec is not None and spec.align != "turn":
            _fail(f"{name!r} is a {spec.align}-level column, not turn-aligned")
        return self.column(name).flatten()

    def traj_values(self, name: str, *, null: float | None = None) -> np.ndarray:
        """numpy view of a per-trajectory column (nulls handled as in turn_values)."""
        values = self.column(name)
        if values.null_count:
            if null is None:
                _fail(f"{name!r} has {values.null_count} null entries; pass null=<fill value>")
            values = values.fill_null(pa.scalar(null, values.type))
        return values.to_numpy(zero_copy_only=False)

    def traj_valid(self, name: str) -> np.ndarray:
        values = self.column(name)
        return values.is_valid().to_numpy(zero_copy_only=False)

    # ------------------------------------------------------------------ token view
    @cached_property
    def token_offsets(self) -> np.ndarray:
        offsets = np.asarray(self.column("input_ids").offsets, dtype=np.int64)
        return offsets - offsets[0]

    @cached_property
    def token_traj_index(self) -> np.ndarray:
        return np.repeat(np.arange(len(self), dtype=np.int64), np.diff(self.token_offsets))

    def token_values(self, name: str) -> np.ndarray:
        """Flat zero-copy numpy view of a token-aligned column."""
        spec = COLUMNS.get(name)
        if spec is not None and spec.align != "token":
            _fail(f"{name!r} is a {spec.align}-level column, not token-aligned")
        return self.column(name).flatten().to_numpy(zero_copy_only=False)

    # ------------------------------------------------------------------ derivation
    def with_turn_columns(
        self, columns: Mapping[str, np.ndarray], *, metrics: Mapping[str, float] | None = None
    ) -> TrajectoryBatch:
        """A new batch with flat per-turn arrays added (or replaced) as list columns.

        Each array has one value per flat turn, in the order of :meth:`turn_values`.
        ``metrics`` are merged into the batch's metrics. The input batch is unchanged.
        """
        _check_mapping(columns, "with_turn_columns", "one numpy array per column")
        _check_names(columns)
        turns = self.column("turns")
        offsets = (
            turns.offsets if turns.offset == 0 else pa.array(self.turn_offsets.astype(np.int32))
        )
        table = self._table
        for name, values in columns.items():
            values = np.asarray(values)
            if values.shape != (self.num_turns,):
                _fail(
                    f"{name!r}: expected one value per turn ({self.num_turns}), got shape {values.shape}"
                )
            spec = COLUMNS.get(name)
            value_type = spec.type.value_type if spec else pa.from_numpy_dtype(values.dtype)
            if value_type.to_pandas_dtype() != values.dtype and pa.types.is_floating(value_type):
                values = values.astype(value_type.to_pandas_dtype())
            array = pa.ListArray.from_arrays(offsets, pa.array(values, type=value_type))
            table = _set_column(table, name, array)
        out = self._derived(table, metrics)  # aligned by construction: built on the turn offsets
        out._validate_numbers(columns)  # an estimator's NaN/inf stops here, not in the loss
        return out

    def with_traj_columns(
        self, columns: Mapping[str, Any], *, metrics: Mapping[str, float] | None = None
    ) -> TrajectoryBatch:
        """A new batch with per-trajectory columns added (or replaced)."""
        _check_mapping(columns, "with_traj_columns", "one value per trajectory per column")
        _check_names(columns)
        table = self._table
        for name, values in columns.items():
            spec = COLUMNS.get(name)
            if not isinstance(values, pa.Array):
                as_sequence = isinstance(values, (Sequence, np.ndarray)) or not isinstance(
                    values, Iterable
                )
                array = _build_column(name, values if as_sequence else list(values))
            elif spec is not None and not values.type.equals(spec.type):
                _refuse_lossy_cast(name, values, spec.type)
                array = values.cast(spec.type)
            else:
                array = values
            if len(array) != len(self):
                _fail(
                    f"{name!r}: expected {len(self)} values (one per trajectory), got {len(array)}"
                )
            table = _set_column(table, name, array)
        out = self._derived(table, metrics)
        out._validate_alignment(columns)
        out._validate_numbers(columns)
        if "outcome_reward" in columns:
            out._validate_rewards()
        if any(name in _NULL_FIX for name in columns):
            out._validate_required()
        return out

    def with_metrics(self, metrics: Mapping[str, float]) -> TrajectoryBatch:
        """A new batch with ``metrics`` (name -> number) merged into its metrics."""
        return self._derived(self._table, metrics)

    def _derived(self, table: pa.Table, metrics: Mapping[str, float] | None) -> TrajectoryBatch:
        merged = {**self.metrics, **_metric_values(metrics or {})}
        meta = dict(table.schema.metadata or {})
        meta[_METRICS_KEY] = json.dumps(merged).encode()
        out = TrajectoryBatch(table.replace_schema_metadata(meta), validate=False)
        # Turn/group structure is unchanged by adding columns: share the cached views.
        for key in (
            "_group_layout",
            "turn_offsets",
            "turn_counts",
            "turn_traj_index",
            "turn_position",
            "is_last_turn",
        ):
            if key in self.__dict__:
                out.__dict__[key] = self.__dict__[key]
        return out

    def select(self, rows: np.ndarray | Sequence[int]) -> TrajectoryBatch:
        """A new batch with the given rows (trajectories), in that order."""
        if isinstance(rows, (str, bytes, Mapping)) or not isinstance(rows, (Iterable, np.ndarray)):
            raise TypeError(
                f"select takes a sequence of row numbers, got {type(rows).__name__}; "
                "e.g. batch.select([0, 2]) or batch.select(np.flatnonzero(mask))"
            )
        index = np.asarray(rows if isinstance(rows, (Sequence, np.ndarray)) else list(rows))
        if index.size == 0:
            index = index.astype(np.int64)
        if index.ndim != 1 or index.dtype.kind not in "iu":
            got = f"{index.dtype} values" if index.ndim == 1 else f"shape {index.shape}"
            hint = " (a boolean mask: pass np.flatnonzero(mask))" if index.dtype == bool else ""
            raise TypeError(f"select takes a 1-d sequence of integer row numbers, got {got}{hint}")
        if index.size and (index.min() < 0 or index.max() >= len(self)):
            bad = int(index[(index < 0) | (index >= len(self))][0])
            raise IndexError(
                f"select: row {bad} is out of range for a batch of {len(self)} trajectories; "
                f"rows are 0..{len(self) - 1}"
            )
        return TrajectoryBatch(self._table.take(pa.array(index.astype(np.int64))), validate=False)

    @classmethod
    def concat(cls, batches: Sequence[TrajectoryBatch]) -> TrajectoryBatch:
        if not batches:
            _fail("concat needs at least one batch")
        tables = [b.table.replace_schema_metadata(None) for b in batches]
        return cls(pa.concat_tables(tables, promote_options="default"))

    # ------------------------------------------------------------------ learner view
    def to_torch(
        self, *, pad_token_id: int = 0, device: str | None = None
    ) -> dict[str, torch.Tensor]:
        """Right-padded tensors for the learner, shape (B, L_max).

        Returns ``input_ids`` (long), ``attention_mask`` (1 on real tokens), ``loss_mask``
        (float, the policy's tokens), ``behavior_logprobs`` (float), ``token_turn`` (long,
        -1 on prompt and padding) and, when the batch carries them, ``advantages`` and
        ``clip_scale`` (float): each token gets its turn's ``turn_advantages`` /
        ``turn_clip_scale`` through ``token_turn``; prompt and padding get 0 (1 for the
        clip scale).
        """
        if isinstance(pad_token_id, (bool, np.bool_)) or not isinstance(
            pad_token_id, (int, np.integer)
        ):
            raise TypeError(
                f"to_torch: pad_token_id is a token id, an integer, got {pad_token_id!r} "
                f"({type(pad_token_id).__name__}); pass the tokenizer's pad_token_id"
            )
        if not -(2**63) <= pad_token_id < 2**63:
            raise ValueError(
                f"to_torch: pad_token_id {pad_token_id} does not fit the int64 input_ids "
                "tensor; pass the tokenizer's pad_token_id"
            )
        import torch

        self.require(TOKEN_COLUMNS, by="to_torch")
        lengths = np.diff(self.token_offsets)
        n, width = len(self), int(lengths.max()) if len(self) else 0
        rows = self.token_traj_index
        cols = np.arange(len(rows), dtype=np.int64) - self.token_offsets[rows]

        def dense(flat: np.ndarray, fill: float, dtype: np.dtype) -> np.ndarray:
            out = np.full((n, width), fill, dtype=dtype)
            out[rows, cols] = flat
            return out

        token_turn = self.token_values("token_turn").astype(np.int64)
        out = {
            "input_ids": dense(self.token_values("input_ids"), pad_token_id, np.int64),
            "attention_mask": dense(np.ones(len(rows), np.int64), 0, np.int64),
            "loss_mask": dense(self.token_values("loss_mask"), 0, np.float32),
            "behavior_logprobs": dense(self.token_values("behavior_logprobs"), 0, np.float32),
            "token_turn": dense(token_turn, -1, np.int64),
        }
        in_turn = token_turn >= 0
        flat_turn = np.where(in_turn, self.turn_offsets[rows] + token_turn, 0)
        for column, key, fill in (
            ("turn_advantages", "advantages", 0.0),
            ("turn_clip_scale", "clip_scale", 1.0),
        ):
            if column in self:
                per_turn = self.turn_values(column)
                out[key] = dense(np.where(in_turn, per_turn[flat_turn], fill), fill, np.float32)
        return {
            k: torch.from_numpy(v).to(device) if device else torch.from_numpy(v)
            for k, v in out.items()
        }

    # ------------------------------------------------------------------ validation
    def validate(self) -> TrajectoryBatch:
        """Check the whole batch against the schema; raise BatchValidationError if not."""
        names = self._table.column_names
        if self._table.num_rows == 0:
            _fail("the batch has no rows; a TrajectoryBatch holds at least one trajectory")
        _check_names(names)
        missing = [c for c in REQUIRED if c not in names]
        if missing:
            _fail(
                f"missing required column(s) {missing}; every TrajectoryBatch has {list(REQUIRED)}"
            )
        for name in names:
            spec = COLUMNS.get(name)
            if spec is not None and not self._table.schema.field(name).type.equals(spec.type):
                _fail(
                    f"column {name!r} has type {self._table.schema.field(name).type}, expected {spec.type}; "
                    "build the batch with TrajectoryBatch.from_records/from_table, which cast it"
                )
        self._validate_ids()
        self._validate_required()
        self._validate_turns()
        self._validate_rewards()
        self._validate_golds()
        self._validate_alignment(names)
        self._validate_numbers(names)
        self._validate_tokens(names)
        return self

    def _row(self, i: int) -> str:
        traj = self._table.column("traj_id")[i].as_py()
        return f"row {i} (traj_id={traj!r})"

    def _validate_ids(self) -> None:
        groups = self.column("group_id")
        if len(pc.unique(groups.dictionary)) != len(groups.dictionary):
            _fail(
                "group_id's dictionary repeats a value, so one group would get two codes; "
                "build the batch with TrajectoryBatch.from_table/from_records, which re-encode it"
            )
        for name in ("group_id", "traj_id"):
            col = self.column(name)
            if pa.types.is_dictionary(col.type):
                col = col.cast(pa.string())
            bad = np.flatnonzero(
                ~pc.fill_null(pc.greater(pc.utf8_length(col), 0), False).to_numpy(
                    zero_copy_only=False
                )
            )
            if len(bad):
                _fail(
                    f"{self._row(int(bad[0]))}: {name!r} is null or empty; give every trajectory a non-empty {name}"
                )
        counts = pc.value_counts(self.column("traj_id"))
        dup = pc.filter(counts, pc.greater(counts.field("counts"), 1))
        if len(dup):
            _fail(
                f"traj_id {dup[0]['values'].as_py()!r} appears {dup[0]['counts'].as_py()} times; traj_id must be unique"
            )

    def _validate_turns(self) -> None:
        turns = self.column("turns")
        if turns.null_count:
            _fail(
                f"{self._row(int(np.flatnonzero(~turns.is_valid().to_numpy(zero_copy_only=False))[0]))}: 'turns' is null"
            )
        empty = np.flatnonzero(self.turn_counts == 0)
        if len(empty):
            _fail(
                f"{self._row(int(empty[0]))}: 'turns' is empty; a trajectory has at least one turn "
                "(the final answer turn)"
            )
        actions = turns.flatten().field("action")
        if actions.null_count == len(actions):
            return  # actions not recorded (hand-built batch): nothing to check
        ok = pc.fill_null(pc.is_in(actions, pa.array(ACTIONS)), True).to_numpy(zero_copy_only=False)
        if not ok.all():
            k = int(np.flatnonzero(~ok)[0])
            _fail(
                f"{self._row(int(self.turn_traj_index[k]))}, turn {int(self.turn_position[k])}: "
                f"action {actions[k].as_py()!r} is not one of {ACTIONS}"
            )

    def _validate_rewards(self) -> None:
        reward = self.column("outcome_reward")
        if reward.null_count:
            i = int(np.flatnonzero(~reward.is_valid().to_numpy(zero_copy_only=False))[0])
            _fail(
                f"{self._row(i)}: 'outcome_reward' is null; score every trajectory (EM by default)"
            )
        values = reward.to_numpy()
        bad = np.flatnonzero(~np.isfinite(values))
        if len(bad):
            i = int(bad[0])
            _fail(
                f"{self._row(i)}: 'outcome_reward' is {values[i]}; rewards must be finite numbers"
            )

    def _validate_required(self) -> None:
        """Nulls in the required columns whose own checks do not catch them."""
        for name, fix in _NULL_FIX.items():
            column = self.column(name)
            if column.null_count:
                i = int(np.flatnonzero(~valid_mask(column))[0])
                _fail(f"{self._row(i)}: {name!r} is null; {fix}")

    def _validate_numbers(self, names: Iterable[str]) -> None:
        """Every float in a schema column (trajectory or turn level) is finite; a clip
        scale is >= 0. Numpy over the flat values buffers; token columns are checked in
        :meth:`_validate_tokens`. Turn columns must be aligned first (the flat index is
        the flat turn)."""
        for name in names:
            spec = COLUMNS.get(name)
            if spec is None or spec.align == "token" or name == "outcome_reward":
                continue  # outcome_reward: _validate_rewards
            column = self.column(name)
            flat = column.flatten() if spec.align == "turn" else column
            if not pa.types.is_floating(flat.type):
                continue
            values, valid = numeric_view(flat)
            if values is None:
                continue
            bad = np.flatnonzero(valid & ~np.isfinite(values))
            fix = _NON_FINITE_FIX.get(name, f"{name!r} holds finite numbers")
            if not len(bad) and name == "turn_clip_scale":
                bad = np.flatnonzero(valid & (values < 0))
                fix = "a clip-range scale is >= 0 (1 = unscaled)"
            if len(bad):
                k = int(bad[0])
                if np.isinf(values[k]) and flat.type == pa.float32():
                    fix += f"; {_FLOAT32_RANGE}"
                if spec.align == "turn":
                    where = f"{self._row(int(self.turn_traj_index[k]))}, turn {int(self.turn_position[k])}"
                else:
                    where = self._row(k)
                _fail(f"{where}: {name!r} is {values[k]}; {fix}")

    def _validate_golds(self) -> None:
        from ray_credit.qa import normalize_answer

        golds = self.column("gold_answers")
        counts = np.asarray(pc.fill_null(pc.list_value_length(golds), 0))
        if (counts == 0).any():
            i = int(np.flatnonzero(counts == 0)[0])
            _fail(f"{self._row(i)}: 'gold_answers' is empty; give at least one accepted answer")
        unique = pc.unique(golds.flatten()).to_pylist()
        empty = {g for g in unique if g is None or normalize_answer(g) == ""}
        if empty:
            flat = golds.flatten().to_pylist()
            k = next(j for j, g in enumerate(flat) if g in empty)
            row = int(
                np.searchsorted(
                    np.asarray(golds.offsets)[1:] - golds.offsets[0].as_py(), k, side="right"
                )
            )
            _fail(
                f"{self._row(row)}: gold answer {flat[k]!r} normalizes to the empty string, so it would "
                "match every prediction under substring EM; remove it or replace it with a real answer"
            )

    def _validate_alignment(self, names: Iterable[str]) -> None:
        counts = self.turn_counts
        for name in names:
            spec = COLUMNS.get(name)
            if spec is None or spec.align != "turn" or name == "turns":
                continue
            col = self.column(name)
            lengths = np.asarray(pc.fill_null(pc.list_value_length(col), -1))
            bad = np.flatnonzero(lengths != counts)
            if len(bad):
                i = int(bad[0])
                got = f"has {lengths[i]} entries" if lengths[i] >= 0 else "is null"
                _fail(
                    f"{self._row(i)}: {name!r} {got} but the trajectory has {counts[i]} turns; "
                    "turn-aligned columns hold exactly one value per turn (use null entries for missing values)"
                )

    def _validate_tokens(self, names: list[str]) -> None:
        present = [c for c in TOKEN_COLUMNS if c in names]
        if not present:
            return
        if len(present) != len(TOKEN_COLUMNS):
            _fail(
                f"token columns {present} present without {sorted(set(TOKEN_COLUMNS) - set(present))}; give all four or none"
            )
        reference = np.asarray(pc.fill_null(pc.list_value_length(self.column("input_ids")), -1))
        for name in present[1:]:
            lengths = np.asarray(pc.fill_null(pc.list_value_length(self.column(name)), -1))
            bad = np.flatnonzero(lengths != reference)
            if len(bad):
                i = int(bad[0])
                _fail(
                    f"{self._row(i)}: {name!r} has {lengths[i]} entries but 'input_ids' has {reference[i]}; "
                    "token-aligned columns hold exactly one value per token"
                )
        token_turn = self.token_values("token_turn").astype(np.int64)
        limit = self.turn_counts[self.token_traj_index]
        bad = np.flatnonzero((token_turn < -1) | (token_turn >= limit))
        if len(bad):
            k = int(bad[0])
            _fail(
                f"{self._row(int(self.token_traj_index[k]))}: token_turn {token_turn[k]} at token "
                f"{k - self.token_offsets[self.token_traj_index[k]]} is outside [-1, {limit[k] - 1}]"
            )
        mask = self.token_values("loss_mask")
        bad = np.flatnonzero((mask != 0) & ((mask != 1) | (token_turn < 0)))
        if len(bad):
            k = int(bad[0])
            _fail(
                f"{self._row(int(self.token_traj_index[k]))}: loss_mask is {mask[k]} at a token with token_turn "
                f"{token_turn[k]}; the mask is 0/1 and only turn tokens (token_turn >= 0) can be trained on"
            )
        logprobs, valid = numeric_view(self.column("behavior_logprobs").flatten())
        if logprobs is not None:
            bad = np.flatnonzero(valid & ~np.isfinite(logprobs))
            fix = "log-probs are finite numbers (0 on tokens the policy did not generate)"
            if not len(bad):
                bad = np.flatnonzero(valid & (logprobs > 0) & (mask == 1))
                fix = "a log-probability is <= 0; store the sampler's log-probs, not probabilities"
            if len(bad):
                k = int(bad[0])
                i = int(self.token_traj_index[k])
                _fail(
                    f"{self._row(i)}: behavior_logprobs is {logprobs[k]} at token "
                    f"{k - self.token_offsets[i]} (loss_mask {mask[k]}); {fix}"
                )


# ---------------------------------------------------------------------- helpers
# Arrow -> numpy straight from the buffers, without fill_null or to_numpy round trips.


def numeric_view(array: pa.Array) -> tuple[np.ndarray | None, np.ndarray]:
    """A numeric Arrow array as a zero-copy view of its values buffer, and its validity.

    An entry under a null is arbitrary, so read the view only where the mask is True
    (this skips a ``fill_null`` copy). The view is None for other types (booleans are
    bit-packed).
    """
    valid = valid_mask(array)
    numeric = pa.types.is_integer(array.type) or pa.types.is_floating(array.type)
    if not numeric or len(array) == 0:
        return None, valid
    dtype = np.dtype(array.type.to_pandas_dtype())
    values = np.frombuffer(array.buffers()[1], dtype=dtype, count=array.offset + len(array))
    return values[array.offset :], valid


def valid_mask(array: pa.Array) -> np.ndarray:
    """Boolean numpy mask, True where ``array`` is not null (its validity bitmap)."""
    if array.null_count in (0, len(array)):  # all valid, or all null (maybe no bitmap)
        return np.full(len(array), array.null_count == 0)
    return _unpack_bits(array.buffers()[0], array.offset, len(array))


def bool_values(array: pa.BooleanArray, *, null: bool | None = None) -> np.ndarray:
    """A boolean Arrow array as a numpy mask, straight from its bitmaps.

    Nulls raise unless ``null`` says what they read as; the fill happens on the packed
    bytes (values AND validity, or values OR NOT validity), before unpacking.
    """
    if not array.null_count:
        return _unpack_bits(array.buffers()[1], array.offset, len(array))
    if null is None:
        raise ValueError("the boolean array has nulls; pass null=True/False to fill them")
    end = (array.offset + len(array) + 7) // 8
    values = np.frombuffer(array.buffers()[1], dtype=np.uint8, count=end)
    valid = np.frombuffer(array.buffers()[0], dtype=np.uint8, count=end)
    packed = values | ~valid if null else values & valid
    bits = np.unpackbits(packed, count=array.offset + len(array), bitorder="little")
    return bits[array.offset :].view(bool)


def _unpack_bits(bitmap: pa.Buffer, offset: int, length: int) -> np.ndarray:
    # An Arrow bitmap is LSB-first; unpacking it is far cheaper than to_numpy on bools.
    bits = np.frombuffer(bitmap, dtype=np.uint8)
    return np.unpackbits(bits, count=offset + length, bitorder="little")[offset:].view(bool)


def _from_ipc_unchecked(data: pa.Buffer) -> TrajectoryBatch:
    with pa.ipc.open_stream(data) as reader:
        return TrajectoryBatch(reader.read_all(), validate=False)


def _set_column(table: pa.Table, name: str, array: pa.Array) -> pa.Table:
    if name in table.column_names:
        return table.set_column(table.column_names.index(name), name, array)
    return table.append_column(name, array)


def _cast_known_columns(table: pa.Table) -> pa.Table:
    if "group_id" in table.column_names and pa.types.is_dictionary(
        table.schema.field("group_id").type
    ):
        # Re-encode: a dictionary from elsewhere may repeat values or use other index types.
        table = _set_column(table, "group_id", table.column("group_id").cast(pa.string()))
    _check_names(table.column_names)
    for name in table.column_names:
        spec = COLUMNS.get(name)
        if spec is not None and not table.schema.field(name).type.equals(spec.type):
            for chunk in table.column(name).chunks:
                _refuse_lossy_cast(name, chunk, spec.type)
            try:
                table = _set_column(table, name, table.column(name).cast(spec.type))
            except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as exc:
                raise BatchValidationError(
                    f"column {name!r} of type {table.schema.field(name).type} cannot be cast "
                    f"to {spec.type}: {exc}"
                ) from exc
    return table


_TURN_FIELDS = tuple(field.name for field in TURN_STRUCT)
_NULL_FIX = {
    "question": "give every trajectory its question (the text the policy was prompted with)",
    "gold_answers": "give every trajectory a list of accepted answers",
}
"""Required columns that :meth:`TrajectoryBatch._validate_required` checks for nulls (the
others have checks of their own), and what to do about one."""
_NON_FINITE_FIX = {"turn_info_gain": "store a missing gain as null, not NaN/inf"}
_FLOAT32_RANGE = "the column is float32, whose range ends near 3.4e38: larger values become inf"


def _check_names(names: Iterable[str]) -> None:
    """Refuse a column name that is a near miss of a schema column (``data_sorce``,
    ``turn_advantage``): kept as an unknown column, it would leave the column it was meant
    to be missing or stale. A name further away is a new column and kept as is."""
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"a column name is a str, got {name!r} ({type(name).__name__})")
        if name in COLUMNS:
            continue
        close = _near_miss(name)
        if close is not None:
            _fail(
                f"column {name!r} is not in the schema; did you mean {close!r}? Rename it "
                f"(ray_credit.batch.COLUMNS lists the columns), or declare {name!r} with "
                "ray_credit.batch.register_columns first if it is a new column"
            )


def _near_miss(name: str) -> str | None:
    """The schema column ``name`` is at most 2 edits from (and fewer than a quarter of
    its length), or None."""
    best, best_distance = None, 3
    for known in difflib.get_close_matches(name, list(COLUMNS), n=3, cutoff=0.6):
        distance = _edit_distance(name, known)
        if distance < best_distance and 4 * distance < len(name):
            best, best_distance = known, distance
    return best


def _edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (insertions, deletions, substitutions) of two short names."""
    previous = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        current = [i]
        for j, y in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (x != y)))
        previous = current
    return previous[-1]


def _check_mapping(columns: Any, method: str, what: str) -> None:
    if not isinstance(columns, Mapping):
        raise TypeError(
            f"{method} takes a dict of columns (name -> {what}), got {type(columns).__name__}"
        )


def _metric_values(metrics: Any) -> dict[str, float]:
    """``metrics`` as ``{str: float}``; anything else (a list, a text value, a non-str
    name) raises rather than being dropped or converted in JSON."""
    if not isinstance(metrics, Mapping):
        raise TypeError(
            f"metrics are a dict of name -> number, got {type(metrics).__name__}; e.g. "
            "batch.with_metrics({'gen/answered': 12.0})"
        )
    out = {}
    for key, value in metrics.items():
        if not isinstance(key, str):
            raise TypeError(f"metric names are str, got {key!r} ({type(key).__name__})")
        if isinstance(value, (str, bytes)) or not isinstance(value, (int, float, np.number)):
            raise TypeError(
                f"metric {key!r} is {value!r} ({type(value).__name__}); a metric is a number "
                "(a count, a rate, seconds): store text elsewhere, e.g. as a column"
            )
        out[key] = float(value)
    return out


def _build_column(name: str, values: Any) -> pa.Array:
    """One column from Python values (from_records, with_traj_columns): the schema's type
    for a known column, Arrow's inference for another.

    Arrow truncates a Python float given for an integer (``policy_version = 1.7`` -> 1),
    so a column with integer leaves is first built as Arrow infers it, checked by
    :func:`_refuse_lossy_cast` and then cast; the typed build is the fallback (and says
    what is wrong when the values do not fit)."""
    spec = COLUMNS.get(name)
    try:
        if spec is not None and _has_integer_leaf(spec.type):
            try:
                inferred = pa.array(values)
            except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError):
                inferred = None
            if inferred is not None and _same_kinds(inferred.type, spec.type):
                _refuse_lossy_cast(name, inferred, spec.type, unit="record")
                try:
                    return inferred.cast(spec.type)
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
                    pass  # the typed build below says what does not fit
        return pa.array(values, type=spec.type if spec else None)
    except UnicodeEncodeError as exc:  # a lone surrogate ('\udcff'): no UTF-8 for it
        row, text = _first_surrogate(values)
        _fail(
            f"column {name!r}, record {row}: the text {text!r} holds {exc.object[exc.start]!r}, "
            "a lone surrogate that is not valid Unicode and cannot be stored as UTF-8 "
            "(often bytes decoded with errors='surrogateescape'); fix the source, or decode "
            "it with errors='replace'"
        )
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError) as exc:
        expected = spec.type if spec else "a consistent type"
        bad = _first_bad_record(values, spec.type) if spec else None
        where = f" (first bad row: {bad})" if bad is not None else ""
        _fail(f"column {name!r} cannot be built as {expected}{where}: {exc}")


def _is_list(type_: pa.DataType) -> bool:
    return pa.types.is_list(type_) or pa.types.is_large_list(type_)


def _has_integer_leaf(type_: pa.DataType) -> bool:
    if _is_list(type_):
        return _has_integer_leaf(type_.value_type)
    if pa.types.is_struct(type_):
        return any(_has_integer_leaf(field.type) for field in type_)
    return pa.types.is_integer(type_)


def _same_kinds(source: pa.DataType, target: pa.DataType) -> bool:
    """``source`` (inferred from Python values) has ``target``'s shape and kinds of leaves,
    numbers given where integers are due, so a cast changes nothing but the widths."""
    if pa.types.is_null(source):
        return True
    if _is_list(source) and _is_list(target):
        return _same_kinds(source.value_type, target.value_type)
    if pa.types.is_struct(source) and pa.types.is_struct(target):
        names = target.names
        return all(
            f.name in names and _same_kinds(f.type, target.field(f.name).type) for f in source
        )
    if pa.types.is_integer(target):
        return pa.types.is_integer(source) or pa.types.is_floating(source)
    return source.equals(target)


def _refuse_lossy_cast(
    name: str, array: pa.Array, target: pa.DataType, *, unit: str = "row"
) -> None:
    """Raise where casting ``array`` to ``target`` would change the data without a word:
    a struct field ``target`` lacks (the cast drops it), a number other than 0/1 for a
    bool (2 -> True), a fraction, NaN or inf for an integer (1.7 -> 1), a float64 beyond
    float32's range (1e40 -> inf). Arrow's cast refuses the rest itself (an integer out of
    range, text that is no number). Numpy over the flat values buffers."""
    _walk_cast(name, array, target, [], [], unit)


def _walk_cast(
    name: str,
    array: pa.Array,
    target: pa.DataType,
    fields: list[str],
    offsets: list[np.ndarray],
    unit: str,
) -> None:
    source = array.type
    if source.equals(target) or pa.types.is_null(source):
        return
    if pa.types.is_dictionary(source):
        array = array.dictionary_decode()
        source = array.type
    where = f"column {name!r}" + (f", field {'.'.join(fields)!r}," if fields else "")
    if _is_list(source) and _is_list(target):
        bounds = np.asarray(array.offsets, dtype=np.int64)
        values = array.values.slice(int(bounds[0]), int(bounds[-1] - bounds[0]))
        _walk_cast(name, values, target.value_type, fields, [*offsets, bounds - bounds[0]], unit)
        return
    if pa.types.is_struct(source) and pa.types.is_struct(target):
        known = target.names
        for field, child in zip(source, array.flatten(), strict=True):
            if field.name not in known:
                close = difflib.get_close_matches(field.name, known, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                _fail(
                    f"{where} has the struct field {field.name!r}{hint}, which the schema's "
                    f"{name!r} does not have, so casting would drop it; its fields are "
                    f"{known}: rename the field"
                )
            _walk_cast(
                name, child, target.field(field.name).type, [*fields, field.name], offsets, unit
            )
        return
    values, valid = numeric_view(array)
    if values is None:
        return
    with np.errstate(invalid="ignore", over="ignore"):
        if pa.types.is_boolean(target):
            bad = valid & (values != 0) & (values != 1)
            what = "which a cast to bool would read as True; store True/False (or 0/1)"
        elif pa.types.is_integer(target) and pa.types.is_floating(source):
            bad = valid & ~(np.isfinite(values) & (values == np.round(values)))
            what = f"which a cast to {target} would not keep; give whole numbers"
        elif target == pa.float32() and source == pa.float64():
            bad = valid & np.isfinite(values) & (np.abs(values) > np.finfo(np.float32).max)
            what = "beyond float32's range (about 3.4e38): the cast would make it inf"
        else:
            return
    hits = np.flatnonzero(bad)
    if len(hits):
        k = int(hits[0])
        value = values[k].item()
        for bounds in reversed(offsets):  # the flat index -> the row that holds it
            k = int(np.searchsorted(bounds[1:], k, side="right"))
        _fail(
            f"{unit} {k}: {where} is {target} in the schema, but holds {value!r} ({source}), {what}"
        )


def _check_record(i: int, rec: Any) -> None:
    """What Arrow would take silently but wrongly: a record that is not a dict, a string
    given for a list (Arrow reads 'Bob' as ['B', 'o', 'b']), a turn field it does not know
    (Arrow drops it: the field the user meant is null)."""
    if not isinstance(rec, Mapping):
        _fail(
            f"record {i} is a {type(rec).__name__}, not a dict; from_records takes one dict "
            f"per trajectory, keyed by column name (ray_credit.batch.COLUMNS lists them)"
        )
    for name, value in rec.items():
        spec = COLUMNS.get(name)
        if spec is None or value is None or not pa.types.is_list(spec.type):
            continue
        if isinstance(value, (str, bytes)):
            _fail(
                f"record {i}: column {name!r} is a list ({spec.type}), got the string "
                f"{value!r}; wrap it in a list: [{value!r}]"
            )
        if isinstance(value, Mapping):
            _fail(
                f"record {i}: column {name!r} is a list ({spec.type}), got a dict; "
                + ("give one dict per turn, in a list" if name == "turns" else "give a list")
            )
        if pa.types.is_list(spec.type.value_type):  # one list per turn: 'd1' is no list
            for t, item in enumerate(value):
                if isinstance(item, (str, bytes)):
                    _fail(
                        f"record {i}: column {name!r} holds one list per turn "
                        f"({spec.type}); turn {t} has the string {item!r}: wrap it in a "
                        f"list: [{item!r}]"
                    )
        if name != "turns":
            continue
        for t, turn in enumerate(value):
            if not isinstance(turn, Mapping):
                _fail(
                    f"record {i}: turn {t} is a {type(turn).__name__}, not a dict with the "
                    f"fields {list(_TURN_FIELDS)}"
                )
            unknown = [key for key in turn if key not in _TURN_FIELDS]
            if unknown:
                close = difflib.get_close_matches(str(unknown[0]), _TURN_FIELDS, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                _fail(
                    f"record {i}: turn {t} has the field {unknown[0]!r}{hint}, which a turn "
                    f"does not have; a turn's fields are {list(_TURN_FIELDS)}"
                )


def _first_surrogate(values: list[Any]) -> tuple[int, str]:
    """The first record holding a string that UTF-8 cannot encode, and a short excerpt of
    that string around the bad character."""

    def bad_text(value: Any) -> str | None:
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as err:
                return value[max(0, err.start - 30) : err.start + 30]
            return None
        if isinstance(value, Mapping):
            value = list(value.values())
        if isinstance(value, (list, tuple)):
            return next((t for t in map(bad_text, value) if t is not None), None)
        return None

    return next((i, t) for i, v in enumerate(values) if (t := bad_text(v)) is not None)


def _first_bad_record(values: list[Any], type_: pa.DataType) -> int | None:
    for i, value in enumerate(values):
        try:
            pa.array([value], type=type_)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError):
            return i
    return None


def _producer_hint(missing: list[str]) -> str:
    hints = [COLUMNS[m].producer for m in missing if m in COLUMNS and COLUMNS[m].producer]
    return " ".join(dict.fromkeys(hints))
