"""The pipeline scripts' command lines: --help everywhere, bad flags named."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_help_and_bad_flags():
    env = None
    for script in (
        "grpo.py",
        "tspo.py",
        "cw_grpo.py",
        "search_p1.py",
        "igpo.py",
        "a2tgpo.py",
        "gigpo.py",
        "eval.py",
    ):
        out = subprocess.run(
            [sys.executable, str(ROOT / "pipelines" / script), "--help"],
            capture_output=True, text=True, cwd=ROOT, env=env, timeout=120,
        )  # fmt: skip
        assert out.returncode == 0 and "--data.questions" in out.stdout, script
    bad = subprocess.run(
        [sys.executable, str(ROOT / "pipelines" / "tspo.py"), "--pipeline.steps", "zero"],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=120,
    )  # fmt: skip
    assert bad.returncode == 2 and "--pipeline.steps" in bad.stderr


class _FakeRay:
    def __init__(self, resources):
        self.resources = resources

    def cluster_resources(self):
        return self.resources


def test_custom_resources_and_shortfall_warning(capsys):
    from ray_credit.pipeline.recipe import ResourcesConfig, RunConfig, _warn_if_short

    res = ResourcesConfig(
        num_generators=2,
        generator_gpus=1.0,
        learner_workers=2,
        use_gpu=True,
        generator_resource="generator",
        learner_resource="learner",
        service_resource="service",
    )
    assert res.custom("generator") == {"generator": 1.0}
    assert ResourcesConfig().custom("learner") == {}
    cfg = RunConfig(resources=res)
    # 2 generators + the evaluation generator, 2 learner replicas, the retriever
    enough = {"CPU": 12.25, "GPU": 5.0, "generator": 3.0, "learner": 2.0, "service": 1.0}
    _warn_if_short(_FakeRay(enough), cfg)
    assert capsys.readouterr().out == ""
    _warn_if_short(_FakeRay({**enough, "GPU": 4.0, "service": 0.0}), cfg)
    out = capsys.readouterr().out
    assert "5 GPU (cluster has 4)" in out and "1 service (cluster has 0)" in out
    assert "CPU" not in out.split(";")[0]
