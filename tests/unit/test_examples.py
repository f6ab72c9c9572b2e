"""The examples run as users run them."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Every example's flags and their defaults, as --help shows them: a pipeline's setting
# under the pipeline's name (--pipeline.steps, --generator.group_size), underscores.
EXAMPLE_FLAGS = {
    "compose_stages.py": {"--model": "smollm2-135m", "--pipeline.steps": "3"},
    "custom_estimator.py": {"--model": "smollm2-135m", "--pipeline.steps": "0"},
    "custom_signal.py": {"--pipeline.steps": "0", "--judge.backend": "evidence"},
    "external_retriever.py": {
        "--model": "smollm2-135m",
        "--output_dir": "None",
        "--retriever.url": "None",
        "--generator.backend": "vllm",
        "--pipeline.steps": "2",
    },
    "rollout_services.py": {
        "--model": "smollm2-135m",
        "--questions": "2",
        "--generator.group_size": "4",
        "--generator.max_new_tokens": "48",
    },
}


def run_example(name: str, *args: str, cwd: Path = ROOT, env=None):
    return subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=300,
    )


def help_defaults(text: str) -> dict[str, str | None]:
    """{flag: its default, None when it shows none} of an unwrapped ``--help`` text."""
    lines = text.split("\noptions:\n", 1)[1].splitlines()
    flags = {}
    for i, line in enumerate(lines):
        option = re.match(r"  (?:-\w, )?(--[\w.-]+)(?: \S+)?(?: {2,}(.*))?$", line)
        if option:
            doc = option.group(2) or lines[i + 1].strip()
            default = re.search(r"\(default: (.*)\)$", doc)
            flags[option.group(1)] = default and default.group(1)
    return flags


def test_every_example_is_listed():
    assert sorted(EXAMPLE_FLAGS) == sorted(p.name for p in (ROOT / "examples").glob("*.py"))


@pytest.mark.parametrize("name", sorted(EXAMPLE_FLAGS))
def test_example_help_shows_the_pipelines_flags_and_creates_nothing(name, tmp_path):
    """--help lists the example's flags as pipelines name them, with the defaults, and
    exits before anything is made: no temp folder, no Ray session (Ray's files go under
    TMPDIR), nothing in the working directory."""
    scratch, cwd = tmp_path / "tmp", tmp_path / "cwd"
    scratch.mkdir()
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_TMPDIR")}
    env.update(TMPDIR=str(scratch), COLUMNS="400")  # COLUMNS: one line per flag's help
    out = run_example(name, "--help", cwd=cwd, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    expected = {"--help": None, "--config": None, **EXAMPLE_FLAGS[name]}
    assert help_defaults(out.stdout) == expected
    assert list(scratch.iterdir()) == [] and list(cwd.iterdir()) == []


@pytest.mark.parametrize(
    ("name", "old_flag"),
    [
        ("rollout_services.py", "--group-size"),
        ("custom_estimator.py", "--train"),
        ("external_retriever.py", "--output-dir"),
    ],
)
def test_example_refuses_its_old_flag(name, old_flag):
    out = run_example(name, old_flag, "2")
    assert out.returncode == 2
    assert f"unrecognized arguments: {old_flag} 2" in out.stderr


def test_example_checks_a_setting_as_the_pipelines_do():
    out = run_example("external_retriever.py", "--retriever.url", "localhost:8000")
    assert out.returncode == 2
    assert "--retriever.url: retriever.url='localhost:8000' must be an http://" in out.stderr


def test_custom_estimator_example_runs_without_touching_the_library():
    out = run_example("custom_estimator.py")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "turn advantages" in out.stdout
    # two right, two wrong: GRPO's credit, discounted towards the early turns
    assert "t0 reward=1 turn advantages: [0.217, 0.433, 0.866]" in out.stdout
    assert "t3 reward=0 turn advantages: [-0.108, -0.217, -0.433, -0.866]" in out.stdout
    assert "discounted_grpo/mean_discount" in out.stdout
