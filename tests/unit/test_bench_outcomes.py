"""bench/outcomes.py: sampled outcomes by data source and searches, on a tiny model."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_outcomes_table_counts_every_trajectory_once(tmp_path, capsys):
    sys.path.insert(0, str(ROOT / "bench"))
    import outcomes

    config = tmp_path / "small.yaml"
    config.write_text(
        "data:\n  eval_questions: 12\n  world:\n    num_entities: 20\n"
        "generator:\n  backend: transformers\n  max_turns: 3\n  max_new_tokens: 8\n"
        "  response_prefix: '<search>'\n"
    )
    out = tmp_path / "outcomes.json"
    argv = ["--model", "tiny-random", "--questions", "2", "--group-size", "3",
            "--config", str(config), "--out", str(out)]  # fmt: skip
    assert outcomes.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    sources = {r["source"] for r in rows}
    assert sources <= {"synthetic_1hop", "synthetic_2hop"} and sources
    for source in sources:  # 2 questions x G=3 of each, split by searches
        mine = [r for r in rows if r["source"] == source]
        assert sum(r["trajectories"] for r in mine) == 6
        assert abs(sum(r["share"] for r in mine) - 1) < 1e-9
        assert all(r["searches"] >= 0 and 0 <= r["em"] <= 1 for r in mine)
    assert "| source | searches |" in capsys.readouterr().out
