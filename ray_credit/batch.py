"""`TrajectoryBatch`: the one Arrow schema every stage of ray_credit exchanges.

One row per trajectory. Turn-aligned columns are ``list<…>`` with exactly one entry per
turn; token-aligned columns are ``list<…>`` with one entry per token. The schema below is
the single place where a column's type and meaning are written down (DESIGN.md section 3).

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
        """Wrap and validate an Arrow table (columns are cast to the schema's types)."""
        return cls(_cast_known_columns(table))

    @classmethod
    def from_records(cls, records: Sequence[Mapping[str, Any]]) -> TrajectoryBatch:
        """Build a batch from a list of dicts named as in :data:`COLUMNS`.

        A turn may omit struct fields (they become null) but not add any: a field it
        does not know (a typo) raises, as does a string where a list is due (``gold_answers
        = 'Bob'``). Unknown columns are kept with the type Arrow infers for them.
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
        arrays = {}
        for name in names:
            values = [rec.get(name) for rec in records]
            spec = COLUMNS.get(name)
            try:
                arrays[name] = pa.array(values, type=spec.type if spec else None)
            except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError) as exc:
                expected = spec.type if spec else "a consistent type"
                bad = _first_bad_record(values, spec.type) if spec else None
                where = f" (first bad row: {bad})" if bad is not None else ""
                _fail(f"column {name!r} cannot be built as {expected}{where}: {exc}")
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
        # than a Table's many small buffers (see DESIGN.md section 8, transport).
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
        return self._derived(table, metrics)  # aligned by construction: built on the turn offsets

    def with_traj_columns(
        self, columns: Mapping[str, Any], *, metrics: Mapping[str, float] | None = None
    ) -> TrajectoryBatch:
        """A new batch with per-trajectory columns added (or replaced)."""
        table = self._table
        for name, values in columns.items():
            spec = COLUMNS.get(name)
            array = (
                values
                if isinstance(values, pa.Array)
                else pa.array(values, type=spec.type if spec else None)
            )
            if len(array) != len(self):
                _fail(
                    f"{name!r}: expected {len(self)} values (one per trajectory), got {len(array)}"
                )
            table = _set_column(table, name, array)
        out = self._derived(table, metrics)
        out._validate_alignment(columns)
        return out

    def with_metrics(self, metrics: Mapping[str, float]) -> TrajectoryBatch:
        return self._derived(self._table, metrics)

    def _derived(self, table: pa.Table, metrics: Mapping[str, float] | None) -> TrajectoryBatch:
        merged = {**self.metrics, **{k: float(v) for k, v in (metrics or {}).items()}}
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
        return TrajectoryBatch(
            self._table.take(pa.array(np.asarray(rows, dtype=np.int64))), validate=False
        )

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
        self._validate_turns()
        self._validate_rewards()
        self._validate_golds()
        self._validate_alignment(names)
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
        if "turn_info_gain" in self:
            ig = self.turn_values("turn_info_gain", null=0.0)
            bad = np.flatnonzero(~np.isfinite(ig))
            if len(bad):
                k = int(bad[0])
                _fail(
                    f"{self._row(int(self.turn_traj_index[k]))}, turn {int(self.turn_position[k])}: "
                    f"'turn_info_gain' is {ig[k]}; store a missing gain as null, not NaN/inf"
                )

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
    for name in table.column_names:
        spec = COLUMNS.get(name)
        if spec is not None and not table.schema.field(name).type.equals(spec.type):
            try:
                table = _set_column(table, name, table.column(name).cast(spec.type))
            except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as exc:
                raise BatchValidationError(
                    f"column {name!r} of type {table.schema.field(name).type} cannot be cast "
                    f"to {spec.type}: {exc}"
                ) from exc
    return table


_TURN_FIELDS = tuple(field.name for field in TURN_STRUCT)


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
