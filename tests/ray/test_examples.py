"""The Ray examples run as users run them, against the shared cluster (RAY_ADDRESS): whole
runs, so they are in the second test command (`pytest -m e2e`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_example(ray_cluster, name: str, *args: str) -> str:
    env = {**os.environ, "RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address}
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.mark.e2e  # a whole run of an example: the second test command
def test_rollout_services_example(ray_cluster):
    stdout = run_example(ray_cluster, "rollout_services.py", "--model", "tiny-random")
    assert "8 trajectories" in stdout
    assert "gen/searches" in stdout and "judge/requests" in stdout
    for name in ("grpo", "tspo", "cw_grpo", "search_p1", "igpo", "a2tgpo", "gigpo"):
        assert f"\n{name} " in stdout, name
    # a random policy answers nothing right, but information gain still credits its turns
    igpo = stdout.split("\nigpo ")[1].split("\n")[0]
    assert int(igpo.split()[-3]) > 0, igpo


@pytest.mark.e2e  # a whole run of an example: the second test command
def test_compose_stages_example(ray_cluster):
    stdout = run_example(
        ray_cluster, "compose_stages.py", "--pipeline.steps", "2", "--model", "tiny-random"
    )
    assert "step 2: reward" in stdout
    # IGPO's information gain credits turns even where every answer is wrong (a random
    # policy's gains are tiny, but not 0); the user's stage counted them
    credited = int(stdout.split("step 2: ")[1].split("turns with credit ")[1].split()[0])
    assert credited > 0
    assert "trained groups 0..7, policy version 2" in stdout


@pytest.mark.e2e  # SmolLM2 trained against an HTTP server, end to end: the second test command
def test_external_retriever_example(ray_cluster):
    # the transformers sampler: three vLLM engines (training, evaluation before and after)
    # would take minutes here, and tests/e2e/test_cluster.py covers the engine in a run
    stdout = run_example(
        ray_cluster, "external_retriever.py", "--pipeline.steps", "1",
        "--generator.backend", "transformers",
    )  # fmt: skip
    assert "/retrieve: top hit" in stdout
    assert "trained 1 steps against the external retriever" in stdout
    served = int(stdout.split("the stand-in server answered ")[1].split()[0])
    assert served > 2  # the generators' searches, beyond the two connection checks


@pytest.mark.e2e  # a whole run of an example: the second test command
def test_custom_estimator_example_trains_with_it(ray_cluster):
    stdout = run_example(
        ray_cluster, "custom_estimator.py", "--pipeline.steps", "2", "--model", "tiny-random"
    )
    assert "trained 2 steps with discounted_grpo: mean discount" in stdout


@pytest.mark.e2e  # a whole run of an example: the second test command
def test_custom_signal_example_trains_with_it(ray_cluster):
    """A user's judged signal and estimator, registered at run time: the pipeline built
    from the estimator's declaration fills the signal on every chunk."""
    stdout = run_example(ray_cluster, "custom_signal.py", "--pipeline.steps", "2")
    assert "answer_grounded: [1, 0]" in stdout
    line = stdout.split("trained 2 steps with grounded_grpo (evidence judge): ")[1]
    judged = int(line.split()[0])
    assert judged == 8  # 2 groups x G=4 trajectories, each judged or counted
    # (--judge.backend hf puts a model judge on an actor instead: that backend trains in
    # test_pipelines.py's Search-P1 run)
