"""What a run prints: the ray_credit logger at the run's level, its workers' quiet
environment, and a failure summarized in one line."""

from __future__ import annotations

import logging

import pytest

from ray_credit.log import log, setup_logging, worker_env
from ray_credit.pipeline.cli import failure_summary


@pytest.fixture(autouse=True)
def _restore_level():
    yield
    setup_logging("info")


def test_lines_at_the_runs_level_go_to_stdout_once(capsys):
    setup_logging("info")
    setup_logging("info")  # twice: still one handler, one line per record
    log.info("step 1/2")
    log.debug("details")
    assert capsys.readouterr().out == "step 1/2\n"
    setup_logging("warning")
    log.info("step 2/2")
    log.warning("warning: short of CPUs")
    assert capsys.readouterr().out == "warning: short of CPUs\n"
    assert not log.propagate  # the root logger's handlers would print it again
    with pytest.raises(ValueError, match="log_level must be one of"):
        setup_logging("verbose")


def test_workers_are_quiet_unless_debugging():
    info = worker_env("info")
    assert info["VLLM_LOGGING_LEVEL"] == "WARNING"
    assert info["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"
    assert info["TORCH_CPP_LOG_LEVEL"] == "ERROR"
    assert "ignore::FutureWarning" in info["PYTHONWARNINGS"]
    assert info["RAY_CREDIT_LOG_LEVEL"] == "info"
    debug = worker_env("debug")
    assert debug["VLLM_LOGGING_LEVEL"] == "INFO"
    assert "HF_HUB_DISABLE_PROGRESS_BARS" not in debug and "PYTHONWARNINGS" not in debug
    assert worker_env("error")["VLLM_LOGGING_LEVEL"] == "ERROR"


def test_a_failed_actor_call_is_one_line_naming_the_cause():
    ray_exceptions = pytest.importorskip("ray.exceptions")
    cause = ValueError("topk=0 must be >= 1\nmore detail on the next line")
    remote = ray_exceptions.RayTaskError(
        "Generator.generate_chunk", "Traceback ...\n  many lines", cause, None, 4242, "10.0.0.7"
    )
    try:
        try:
            raise remote
        except ray_exceptions.RayTaskError as err:
            raise RuntimeError("learner rank 1 died during 'train'") from err
    except RuntimeError as outer:
        line = failure_summary(outer)
    assert line == (
        "ValueError in Generator.generate_chunk (pid 4242, node 10.0.0.7): topk=0 must be >= 1"
    )
    assert failure_summary(KeyError("chunk 7")) == "KeyError: 'chunk 7'"
    died = ray_exceptions.ActorDiedError()
    try:
        try:
            raise died
        except ray_exceptions.ActorDiedError as err:
            raise TimeoutError("no step in 600 s") from err
    except TimeoutError as outer:
        line = failure_summary(outer)
    assert line.startswith("TimeoutError: no step in 600 s; cause: ")
    assert "\n" not in line
    assert logging.getLogger("ray_credit") is log
