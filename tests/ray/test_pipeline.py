"""The asynchronous loop on the shared cluster, with tiny-random: staleness bound, every
group trained once in stream order, weights reaching the generators, stages streaming per
chunk with the driver holding refs only, resume."""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import replace

import pytest

pytest.importorskip("torch")

from ray_credit.actors.generator import GeneratorConfig, make_generator_actor  # noqa: E402
from ray_credit.actors.learner import LearnerConfig  # noqa: E402
from ray_credit.actors.learner_group import LearnerGroup  # noqa: E402
from ray_credit.actors.retriever import make_retriever_actor  # noqa: E402
from ray_credit.actors.sampling import VLLMConfig  # noqa: E402
from ray_credit.data import WorldConfig, make_world  # noqa: E402
from ray_credit.pipeline import (  # noqa: E402
    Pipeline,
    PipelineConfig,
    checkpoints,
    estimator_stage,
    resolve_checkpoint,
)

GEN = GeneratorConfig(group_size=2, max_turns=2, max_new_tokens=6, response_prefix="<search>")


class Faults:
    """An ``on_step`` that kills what ``kills`` says after the step it names, and times the
    recovery for docs/reliability.md (``pytest -s`` prints it): the seconds from each
    kill to the end of the next step, beside the median step."""

    def __init__(self, kills):
        self.kills, self.killed_at, self.recovery_s = kills, None, []

    def __call__(self, metrics):
        if self.killed_at is not None:
            self.recovery_s.append(time.monotonic() - self.killed_at)
            self.killed_at = None
        kill = self.kills.get(metrics["pipeline/step"])
        if kill is not None:
            kill()
            self.killed_at = time.monotonic()

    def report(self, fault, history):
        steps = sorted(h["time/step_s"] for h in history)
        last = history[-1]
        print(
            f"\nRECOVERY {fault}: the next step ended "
            f"{', '.join(f'{s:.1f}' for s in self.recovery_s)} s after the kill (median step "
            f"{steps[len(steps) // 2]:.1f} s); chunks redone "
            f"{last.get('pipeline/chunks_redone', 0):.0f}, stages redone "
            f"{last.get('pipeline/stages_redone', 0):.0f}"
        )


@pytest.fixture(scope="module")
def world():
    return make_world(WorldConfig(seed=3, num_entities=20))


@pytest.fixture(scope="module")
def retriever(ray_cluster, world):
    return make_retriever_actor(world.corpus, num_cpus=0.25)


# tiny-random's rewards are all 0, so GRPO's advantages are too: an entropy term keeps the
# learner's passes (and the time they overlap with stages) instead of its zero-gradient
# shortcut
LEARNING = LearnerConfig(lr=1e-3, entropy_coef=1e-3)


@pytest.fixture(scope="module")
def live(ray_cluster, retriever):
    """Two generators and a learner that every run here without a fault of its own goes on
    with, one after the other (starting actors is most of a test's time): each test reads
    the policy version it starts from."""
    # half a CPU: the tests' own actors fit beside them on the cluster's 4
    generators, learner = _parts(
        retriever, learner_config=LEARNING, resources_per_worker={"CPU": 0.5}
    )
    yield generators, learner
    learner.shutdown()
    for generator in generators:
        ray_cluster.kill(generator)


def _versions(ray_cluster, generators):
    return ray_cluster.get([g.get_policy_version.remote() for g in generators])


def _parts(retriever, n_generators=2, resume_from=None, learner_config=None, **learner_kwargs):
    generators = [
        make_generator_actor("tiny-random", retriever, GEN, num_cpus=0.25)
        for _ in range(n_generators)
    ]
    learner = LearnerGroup(
        "tiny-random",
        learner_config or LearnerConfig(lr=1e-3),
        resume_from=None if resume_from is None else f"{resolve_checkpoint(resume_from)}/learner",
        **learner_kwargs,
    )
    return generators, learner


@pytest.mark.parametrize("max_staleness", [0, 1])
def test_staleness_bound_and_every_group_once(ray_cluster, world, live, max_staleness):
    generators, learner = live
    start = learner.policy_version
    config = PipelineConfig(steps=4, groups_per_step=4, chunk_groups=2, max_staleness=max_staleness)
    pipe = Pipeline(generators, learner, world.questions[:10], [estimator_stage("grpo")], config)
    history = pipe.run()
    assert len(history) == 4
    assert pipe.trained_groups == list(range(16))  # stream order, none twice, none skipped
    for m in history:
        assert m["staleness/max"] <= max_staleness
        assert m["learner/trajectories"] == 8  # 4 groups x G=2
        assert "time/stage_estimator_grpo_s" in m and "train/reward_mean" in m
        assert m["time/stages_s"] >= m["time/stage_estimator_grpo_s"] > 0
        assert 0 <= m["time/wait_publication_s"] <= m["time/step_s"]
    if max_staleness == 0:
        assert all(m["staleness/max"] == 0 for m in history)
    if max_staleness >= 1:  # the generators ran ahead: some trained turns were stale
        assert sum(m["staleness/1"] for m in history) > 0
        assert max(m["pipeline/groups_ahead"] for m in history) > 0
    assert _versions(ray_cluster, generators) == [start + 4] * 2 == [learner.policy_version] * 2


def test_a_run_goes_on_with_the_actors_of_an_earlier_one(ray_cluster, world, live):
    """A second run on the same generators and learner starts from their version without
    sending weights; one found back on older weights (Ray restarted it since) is sent the
    learner's; generators ahead of a learner (they trained with another) are refused."""
    generators, learner = live
    config = PipelineConfig(steps=1, groups_per_step=4, chunk_groups=2)
    Pipeline(generators, learner, world.questions[:10], [estimator_stage("grpo")], config).run()
    start = learner.policy_version
    assert start >= 1 and _versions(ray_cluster, generators) == [start] * 2

    class FreshLearner:  # refused before any call but its version
        policy_version = 0

    with pytest.raises(ValueError, match=rf"generator0 \(version {start}\), generator1 .* ahead"):
        Pipeline(generators, FreshLearner(), world.questions[:10], [], config)

    def back_on_the_base_weights(self):  # what a restarted generator holds
        from ray_credit.models import load_model

        self.sampler.load_weights(load_model("tiny-random")[0].state_dict())
        self.policy_version = 0

    ray_cluster.get(generators[1].__ray_call__.remote(back_on_the_base_weights))
    pipe = Pipeline(generators, learner, world.questions[:10], [estimator_stage("grpo")], config)
    assert pipe.publisher.metrics["sync/resyncs"] == 1  # generator1 only
    assert _versions(ray_cluster, generators) == [start] * 2
    expected = ray_cluster.get(learner.weights())
    got = ray_cluster.get(generators[1].__ray_call__.remote(_model_weights))
    assert all(torch_equal(got[k], expected[k]) for k in expected)
    history = pipe.run()
    assert history[-1]["sync/publications"] == 1  # step 1's; none at the start
    assert _versions(ray_cluster, generators) == [start + 1] * 2 == [learner.policy_version] * 2


def test_a_bf16_generator_is_published_bf16_weights(ray_cluster, world, retriever, live):
    """Where every generator holds bf16 weights, the learner's are cast before they go in
    the object store (half the bytes); the generator holds what it would have rounded."""
    import torch

    from ray_credit.pipeline.weights import publication_dtype

    generators, learner = live
    assert publication_dtype(generators) is None  # float32 generators: the learner's own
    half = make_generator_actor(
        "tiny-random", retriever, replace(GEN, dtype="bfloat16"), num_cpus=0.25
    )
    try:
        assert publication_dtype([half, generators[0]]) is None  # they disagree
        config = PipelineConfig(steps=1, groups_per_step=2, chunk_groups=2)
        pipe = Pipeline([half], learner, world.questions[:4], [estimator_stage("grpo")], config)
        assert pipe._publication_dtype() == "bfloat16"  # asked as it was brought current
        assert ray_cluster.get(half.get_policy_version.remote()) == learner.policy_version
        expected = ray_cluster.get(learner.weights())
        got = ray_cluster.get(half.__ray_call__.remote(_model_weights))
        assert all(torch.equal(got[k], expected[k].to(torch.bfloat16)) for k in expected)
    finally:
        ray_cluster.kill(half)


def _model_weights(self):
    return {k: v.clone() for k, v in self.sampler.model.state_dict().items()}


def _chdir(actor, folder):
    if folder is not None:
        os.chdir(folder)
    return os.getcwd()


def test_resume_trains_every_group_once(ray_cluster, world, retriever, live, tmp_path, monkeypatch):
    """A run checkpoints into a checkpoint_dir named relative to the driver's working
    directory: the learner ranks (moved to another one) and the chunk-writing tasks write
    their parts there by absolute path. A run "killed" after step 2 and resumed with new
    actors from that relative name trains every group once, with its running totals. The
    driver never reads a batch (they refuse to unpickle here): the buffered chunks go to
    disk and back into the object store by tasks."""
    import ray_credit.batch as batch_module

    monkeypatch.setattr(batch_module, "_from_ipc_unchecked", _refuse_in_driver)
    driver, elsewhere = tmp_path / "driver", tmp_path / "worker"
    driver.mkdir()
    elsewhere.mkdir()
    monkeypatch.chdir(driver)
    config = PipelineConfig(
        steps=2, groups_per_step=4, chunk_groups=2, max_staleness=1, checkpoint_dir="ckpt"
    )
    generators, learner = live  # the run that is "killed" goes on from the earlier tests'
    version = learner.policy_version
    workdirs = ray_cluster.get([w.__ray_call__.remote(_chdir, None) for w in learner._workers])
    moved = [w.__ray_call__.remote(_chdir, str(elsewhere)) for w in learner._workers]
    assert ray_cluster.get(moved) == [str(elsewhere)]
    try:
        first = Pipeline(
            generators, learner, world.questions[:10], [estimator_stage("grpo")], config
        )
        first.run()
    finally:
        back = zip(learner._workers, workdirs, strict=True)
        ray_cluster.get([w.__ray_call__.remote(_chdir, d) for w, d in back])
    assert [step for step, _ in checkpoints(driver / "ckpt")] == [2]  # saved at the end
    assert not (elsewhere / "ckpt").exists()
    saved = driver / "ckpt" / "step_000002"
    assert (saved / "learner" / "learner_state.pt").is_file()
    assert (saved / "learner" / "model" / "config.json").is_file()
    state = json.loads((saved / "pipeline.json").read_text())
    assert state["step"] == 2 and state["policy_version"] == version + 2
    buffered = sorted(start for start, _ in state["buffered"])
    assert all(start >= 8 for start in buffered)  # only groups not trained yet are kept
    for start, size in state["buffered"]:  # generated ahead before the save
        assert (saved / "buffer" / f"{start:09d}_{size}.arrow").is_file()
    assert state["counters"]["sync/publications"] == 2  # running totals travel with it

    # "Killed" after step 2: a new run with new actors resumes from the checkpoint.
    generators, learner = _parts(
        retriever, n_generators=1, resume_from="ckpt", learner_config=LEARNING
    )
    resumed_config = PipelineConfig(**{**config.__dict__, "steps": 4, "checkpoint_every": 1})
    second = Pipeline(
        generators,
        learner,
        world.questions[:10],
        [estimator_stage("grpo")],
        resumed_config,
        resume_from="ckpt",
    )
    assert second.step == 2 and sorted(second._chunks) == buffered
    assert all(c.summary is not None for c in second._chunks.values())
    history = second.run()
    assert len(history) == 2 and second.step == 4
    assert second.trained_groups == list(range(16))
    assert learner.policy_version == version + 4
    # the totals go on from the first run's: its 2 publications (it went on with actors
    # at the learner's version: none at its start), the resumed learner's weights sent to
    # the new generator at the start, then steps 3 and 4
    assert history[-1]["sync/publications"] == 5
    assert ray_cluster.get(generators[0].get_policy_version.remote()) == version + 4
    # saved after steps 3 and 4: the newest two kept (keep_checkpoints=2), step 2's gone
    assert [step for step, _ in checkpoints(driver / "ckpt")] == [3, 4]
    assert not list((driver / "ckpt").glob("*.tmp")) and not list((driver / "ckpt").glob("*.old"))

    with pytest.raises(ValueError, match="groups_per_step=4, this run has groups_per_step=2"):
        Pipeline(
            generators,
            learner,
            world.questions[:10],
            [],
            PipelineConfig(groups_per_step=2),
            resume_from="ckpt",
        )
    learner.shutdown()


@pytest.mark.e2e  # an actor killed mid-run: the second test command
@pytest.mark.parametrize("backend", ["transformers", pytest.param("vllm", marks=pytest.mark.vllm)])
def test_generators_dying_mid_run_lose_no_group(ray_cluster, world, retriever, backend):
    """One generator is killed and restarted by Ray, the other killed for good: the run
    finishes, every group trained once, the restarted one back on the current weights
    (with vLLM: a new engine, loaded in place with the re-sent weights)."""
    gen = replace(GEN, backend=backend, vllm=VLLMConfig(kv_cache_gb=1))
    generators = [
        make_generator_actor("tiny-random", retriever, gen, num_cpus=0.25, max_restarts=1),
        make_generator_actor("tiny-random", retriever, gen, num_cpus=0.25),
    ]
    learner = LearnerGroup("tiny-random", LearnerConfig(lr=1e-3))

    faults = Faults({
        1: lambda: ray_cluster.kill(generators[0], no_restart=False),  # Ray restarts it
        2: lambda: ray_cluster.kill(generators[1]),  # gone
    })  # fmt: skip
    config = PipelineConfig(steps=4, groups_per_step=4, chunk_groups=2, max_staleness=1)
    pipeline = Pipeline(
        generators, learner, world.questions, [estimator_stage("grpo")], config, on_step=faults
    )
    history = pipeline.run()
    assert pipeline.step == 4 and pipeline.trained_groups == list(range(16))
    faults.report(f"generators ({backend}): one restarted, one gone", history)
    last = history[-1]
    assert last["pipeline/generators_lost"] == 1
    assert last["pipeline/generator_failures"] == 2
    assert last["pipeline/generator_restarts"] == 1  # the one Ray restarted came back
    assert last["sync/resyncs"] == 1  # the restarted generator got the current weights
    assert ray_cluster.get(generators[0].get_policy_version.remote()) == 4
    learner.shutdown()


class SeedsOfChunks:
    """A generator (a :class:`~ray_credit.actors.generator.Generator`) that writes, for
    each chunk, its groups and the seed its first turn sampled with, to ``log``."""

    def __init__(self, log, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.log, self.groups, sample = log, None, self.sampler.sample

        def recorded(contexts, params, *, seed):
            if self.groups is not None:  # the chunk's first turn: seed is call seed * 1009
                with open(self.log, "a") as log:
                    log.write(json.dumps([self.groups, seed // 1009]) + "\n")
                self.groups = None
            return sample(contexts, params, seed=seed)

        self.sampler.sample = recorded

    def generate_chunk(self, questions, **kwargs):
        self.groups = re.search(r"groups (\[\d+, \d+\))", kwargs["progress"]).group(1)
        return super().generate_chunk(questions, **kwargs)


def test_a_chunk_samples_as_its_place_in_the_run_says_whoever_rolls_it_out(
    ray_cluster, world, retriever, tmp_path
):
    """A chunk samples with the generators' seed plus its place in the run's calls, from
    its position: one generator samples as its own count of calls did, and a run resumed
    with two new generators (whose own counts start again) samples each chunk as the run
    made whole by one."""
    from ray_credit.actors.generator import Generator

    recording = ray_cluster.remote(type("Recording", (SeedsOfChunks, Generator), {}))

    def generators(log, count):
        return [
            recording.options(num_cpus=0.25).remote(
                str(tmp_path / log), "tiny-random", retriever, replace(GEN, seed=7)
            )
            for _ in range(count)
        ]

    def run(actors, steps, checkpoint_dir=None, resume_from=None):
        config = PipelineConfig(steps=steps, groups_per_step=4, chunk_groups=2,
                                max_staleness=0, checkpoint_dir=checkpoint_dir)  # fmt: skip
        pipe = Pipeline(actors, learner, world.questions[:10], [estimator_stage("grpo")], config,
                        resume_from=resume_from)  # fmt: skip
        pipe.run()

    def seeds(log):
        return dict(json.loads(line) for line in (tmp_path / log).read_text().splitlines())

    # the seeds do not depend on the weights: one learner serves every run, the resumed
    # one too (it is at the checkpoint's version, with its weights)
    learner = LearnerGroup("tiny-random", LearnerConfig(lr=1e-3))
    one = generators("whole.jsonl", 1)
    run(one, steps=2)
    whole = seeds("whole.jsonl")
    starts = sorted(whole, key=lambda groups: int(groups[1:].split(",")[0]))
    assert [whole[g] for g in starts] == [7, 8, 9, 10]  # seed + 0, ..., seed + 3
    run(one, steps=1, checkpoint_dir=str(tmp_path / "ckpt"))  # cut off after step 1:
    # nothing generated ahead (max_staleness 0)
    run(generators("resumed.jsonl", 2), steps=2, resume_from=tmp_path / "ckpt")
    learner.shutdown()
    assert seeds("resumed.jsonl") == {g: whole[g] for g in starts[2:]}  # its step 2


class HeldAhead:
    """A generator that holds each chunk past the first step's until the file ``go``
    exists, so that the next step's chunks are still being sampled when a checkpoint is
    written."""

    def __init__(self, go, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.go = go

    def generate_chunk(self, questions, **kwargs):
        deadline = time.monotonic() + 120
        while not re.search(r"groups \[[0-3],", kwargs["progress"]) and not os.path.exists(self.go):
            assert time.monotonic() < deadline, f"{self.go} never came"
            time.sleep(0.05)
        return super().generate_chunk(questions, **kwargs)


def _staged_groups(log):
    """A stage that writes the groups of each batch it stages to ``log``."""

    def staged(batch):
        with open(log, "a") as out:
            out.write(json.dumps(sorted(set(batch.column("group_id").to_pylist()))) + "\n")
        return batch

    return staged


def test_a_checkpoint_keeps_the_chunks_sampled_with_older_weights_staged(
    ray_cluster, world, retriever, live, tmp_path
):
    """A checkpoint written while the next step's chunks, sampled with the weights before
    the step's update, are still generating waits for them and keeps them staged: a run
    resumed from it, which has only the newer weights, trains on them as they were sampled
    and scored, without staging them again."""
    from ray_credit.actors.generator import Generator

    held = ray_cluster.remote(type("Held", (HeldAhead, Generator), {}))
    log, go = tmp_path / "staged.jsonl", tmp_path / "go"
    config = PipelineConfig(
        steps=2, groups_per_step=4, chunk_groups=2, max_staleness=1, checkpoint_every=1,
        checkpoint_dir=str(tmp_path / "ckpt"),
    )  # fmt: skip

    def run(learner, resume_from=None):
        generators = [held.options(num_cpus=0.25).remote(str(go), "tiny-random", retriever, GEN)]
        stages = [_staged_groups(str(log)), estimator_stage("grpo")]
        pipe = Pipeline(generators, learner, world.questions[:10], stages, config,
                        resume_from=resume_from)  # fmt: skip
        restored = {s: c.report is not None for s, c in pipe._chunks.items()}
        pipe.run()
        ray_cluster.kill(generators[0])
        return pipe, restored

    learner = live[1]  # goes on from the earlier tests' version
    save = learner.save

    def save_then_go(folder):  # step 2's chunks are sampled once a checkpoint is begun
        save(folder)
        go.touch()

    learner.save = save_then_go
    try:
        run(learner)
    finally:
        del learner.save
    saved = tmp_path / "ckpt" / "step_000001"
    state = json.loads((saved / "pipeline.json").read_text())
    assert sorted(state["buffered"]) == [[4, 2], [6, 2]] and state["format"] == 3
    for start, size in state["buffered"]:  # sampled before step 1's update, staged by then
        kept = json.loads((saved / "buffer" / f"{start:09d}_{size}.json").read_text())
        assert [v for v, _ in kept["oldest_versions"]] == [state["policy_version"] - 1]
        assert kept["staged_report"]["trajectories"] == size * GEN.group_size
    log.write_text("")
    resumed_learner = LearnerGroup("tiny-random", LEARNING, resume_from=f"{saved}/learner")
    resumed, restored = run(resumed_learner, resume_from=saved)
    resumed_learner.shutdown()
    assert restored == {4: True, 6: True}
    assert log.read_text() == ""  # nothing staged again: step 2 was all kept
    assert resumed.step == 2 and resumed.trained_groups == list(range(8))


class Recorded:
    """An info-gain scorer that keeps, for each batch it scores, the weights versions that
    sampled it and the version it scores with."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.scored = []

    def score(self, batch):
        turns = batch.column("turns").to_pylist()
        sampled = sorted({turn["policy_version"] for row in turns for turn in row})
        self.scored.append((sampled, self.policy_version))
        return super().score(batch)

    def scored_versions(self):
        return self.scored


def test_each_chunk_is_scored_with_the_weights_that_sampled_it(
    ray_cluster, world, retriever, live, tmp_path
):
    """IGPO's information gain is the acting policy's change of belief. The next step's
    chunks, sampled with the weights before an update, finish generating once the newer
    weights are published (held until then), and are scored with the weights that sampled
    them all the same: the scorer loads the newer ones once they are staged."""
    from ray_credit.actors.generator import Generator
    from ray_credit.actors.scorer import InfoGainScorer
    from ray_credit.pipeline import actor_stage

    held = ray_cluster.remote(type("Held", (HeldAhead, Generator), {}))
    go = tmp_path / "published"
    generators = [held.options(num_cpus=0.25).remote(str(go), "tiny-random", retriever, GEN)]
    recorded = ray_cluster.remote(type("RecordedScorer", (Recorded, InfoGainScorer), {}))
    scorer = recorded.options(num_cpus=0.25).remote("tiny-random")
    learner = live[1]  # goes on from the earlier tests' version
    start = learner.policy_version
    stages = [actor_stage(scorer.score, name="info_gain"), estimator_stage("igpo")]
    config = PipelineConfig(steps=3, groups_per_step=4, chunk_groups=2, max_staleness=1)
    pipe = Pipeline(generators, learner, world.questions[:10], stages, config,
                    weight_targets=[scorer], on_step=lambda _: go.touch())  # fmt: skip
    history = pipe.run()
    scored = ray_cluster.get(scorer.scored_versions.remote())
    assert len(scored) == 6  # each chunk once
    assert all(sampled == [held] for sampled, held in scored), scored
    assert {held for _, held in scored} == {start, start + 1}  # steps 1 and 2 sampled ahead
    assert sum(h["scorer/turns_on_newer_weights"] for h in history) == 0
    # the scorer loaded each version a chunk was sampled with, then the last one
    assert history[-1]["sync/target_loads"] == 3 + (start > 0)  # (first, the learner's)
    assert ray_cluster.get(scorer.get_policy_version.remote()) == start + 3
    for actor in [*generators, scorer]:
        ray_cluster.kill(actor)


@pytest.mark.e2e  # an actor killed mid-run: the second test command
def test_a_hung_generator_is_killed_restarted_and_its_chunk_redone(
    ray_cluster, world, retriever, tmp_path
):
    """A generate call that never returns (the third: by then weights are being
    published, and the hung generator's update waits behind it): within
    generation_timeout_s the generator is taken for hung and killed, Ray restarts it, its
    chunks are redone, and the run ends with every group trained once, the event counted."""
    from ray_credit.actors.generator import Generator

    class HangsOnce(Generator):
        def __init__(self, marker, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.marker = marker

        def generate_chunk(self, questions, **kwargs):
            import os
            import time

            with open(self.marker + ".titles", "a") as titles:  # the driver's bar titles
                titles.write(kwargs["progress"] + "\n")
            self.calls = getattr(self, "calls", 0) + 1
            if self.calls == 3 and not os.path.exists(self.marker):
                open(self.marker, "w").close()
                time.sleep(3600)  # hung: never returns (its process is killed instead)
            return super().generate_chunk(questions, **kwargs)

    hangs = ray_cluster.remote(HangsOnce).options(num_cpus=0.25, max_restarts=1)
    generators = [
        hangs.remote(str(tmp_path / "hung"), "tiny-random", retriever, GEN),
        make_generator_actor("tiny-random", retriever, GEN, num_cpus=0.25),
    ]
    learner = LearnerGroup("tiny-random", LearnerConfig(lr=1e-3))
    config = PipelineConfig(
        steps=4, groups_per_step=4, chunk_groups=2, max_staleness=1, generation_timeout_s=15
    )
    pipeline = Pipeline(generators, learner, world.questions, [estimator_stage("grpo")], config)
    started = time.monotonic()
    history = pipeline.run()
    assert pipeline.step == 4 and pipeline.trained_groups == list(range(16))
    last = history[-1]
    assert last["pipeline/generators_hung"] == 1 and last["pipeline/generator_failures"] == 1
    assert last["pipeline/chunks_redone"] >= 1 and last["pipeline/generators_lost"] == 0
    assert (tmp_path / "hung").exists() and time.monotonic() - started < 300
    titles = (tmp_path / "hung.titles").read_text().splitlines()
    assert len(titles) >= 3  # one per call, each naming its step and groups
    for title in titles:
        found = re.fullmatch(r"step (\d)/4: groups \[(\d+), (\d+)\) on generator0", title)
        assert found, title
        step, first, end = map(int, found.groups())
        assert first // 4 + 1 == step and end - first == 2
    steps = [round(h["time/step_s"], 1) for h in history]
    print(f"\nRECOVERY a hung generator (timeout 15 s): step times {steps} s")
    assert ray_cluster.get(generators[0].get_policy_version.remote()) == 4  # back, current
    learner.shutdown()


@pytest.mark.e2e  # an actor killed mid-run: the second test command
def test_a_scorer_killed_mid_run_comes_back_on_current_weights(ray_cluster, world, retriever):
    """IGPO's info-gain scorer is killed after step 1: Ray restarts it (on the base
    weights), the loop re-sends the current ones and redoes the stages that failed on it;
    every group is trained once with info gains from the current policy."""
    from ray_credit.actors.scorer import make_scorer_actor
    from ray_credit.pipeline import actor_stage

    generators, learner = _parts(retriever)
    scorer = make_scorer_actor("tiny-random", num_cpus=0.25, max_restarts=1)

    faults = Faults({1: lambda: ray_cluster.kill(scorer, no_restart=False)})
    stages = [actor_stage(scorer.score, name="info_gain"), estimator_stage("igpo")]
    config = PipelineConfig(steps=3, groups_per_step=4, chunk_groups=2, max_staleness=1)
    pipeline = Pipeline(
        generators, learner, world.questions, stages, config, on_step=faults,
        weight_targets=[scorer],
    )  # fmt: skip
    history = pipeline.run()
    assert pipeline.step == 3 and pipeline.trained_groups == list(range(12))
    faults.report("the info-gain scorer, restarted", history)
    # the restart shows in the metrics whichever way the current weights reached it (a
    # failed call and a resync, or the publication queued while it restarted); a chunk is
    # never scored with older weights than it was sampled with (WeightsBehind otherwise)
    assert sum(h.get("scorer/restarts", 0) for h in history) == 1  # once, not every step
    assert ray_cluster.get(scorer.get_policy_version.remote()) == 3  # current again
    learner.shutdown()


@pytest.mark.e2e  # a run cut off and resumed: the second test command
def test_a_resumed_run_scores_its_buffered_chunks_on_the_resumed_weights(
    ray_cluster, world, retriever, tmp_path
):
    """IGPO resumed with a fresh scorer: the chunks its checkpoint kept unstaged (here made
    so: kept staged, they would not be scored again) are scored at once, so the resumed
    weights reach every actor before the first chunk; no stage fails on a scorer still on
    the base weights."""
    from ray_credit.actors.scorer import make_scorer_actor
    from ray_credit.pipeline import actor_stage

    config = PipelineConfig(
        steps=3, groups_per_step=4, chunk_groups=2, max_staleness=1, checkpoint_every=1,
        checkpoint_dir=str(tmp_path / "ckpt"),
    )  # fmt: skip

    def run(steps, resume_from=None):
        generators, learner = _parts(retriever, n_generators=1, resume_from=resume_from)
        scorer = make_scorer_actor("tiny-random", num_cpus=0.25)
        stages = [actor_stage(scorer.score, name="info_gain"), estimator_stage("igpo")]
        pipeline = Pipeline(
            generators, learner, world.questions, stages, replace(config, steps=steps),
            weight_targets=[scorer], resume_from=resume_from,
        )  # fmt: skip
        if resume_from is not None:  # the publication is in place, not in flight
            assert pipeline.publisher.pending_refs() == []
        history = pipeline.run()
        for actor in [*generators, scorer]:
            ray_cluster.kill(actor)
        learner.shutdown()
        return pipeline, history

    run(3)  # cut off after step 2, as far as the resume knows: it starts from that save
    cut = tmp_path / "ckpt" / "step_000002"
    state = json.loads((cut / "pipeline.json").read_text())
    assert state["step"] == 2 and state["buffered"]  # chunks sampled ahead, to score
    for start, size in state["buffered"]:  # as a checkpoint keeps a chunk not staged yet
        kept = cut / "buffer" / f"{start:09d}_{size}.json"
        summary = json.loads(kept.read_text())
        assert summary.pop("staged_report")["trajectories"] == size * GEN.group_size
        kept.write_text(json.dumps(summary))
    second, history = run(3, resume_from=cut)
    assert second.step == 3 and second.trained_groups == list(range(12))
    assert history[-1]["pipeline/weight_target_failures"] == 0
    assert history[-1]["pipeline/stages_redone"] == 0


@pytest.mark.e2e  # an actor killed mid-run: the second test command
def test_a_generator_killed_by_the_memory_monitor_mid_call_is_recovered(
    ray_cluster, world, retriever, monkeypatch
):
    """Ray's memory monitor kills a generator's process during its call: the driver gets
    OutOfMemoryError (not RayActorError) for the chunk. The chunk is redone and the
    generator, restarted by Ray on the base weights, brought back to the current ones, as
    after any death; every group is trained once."""
    generators = [
        make_generator_actor("tiny-random", retriever, GEN, num_cpus=0.25, max_restarts=1)
        for _ in range(2)
    ]
    learner = LearnerGroup("tiny-random", LearnerConfig(lr=1e-3))
    config = PipelineConfig(steps=4, groups_per_step=4, chunk_groups=2, max_staleness=1)
    pipeline = Pipeline(generators, learner, world.questions, [estimator_stage("grpo")], config)
    real_get, killed = ray_cluster.get, []

    def get(refs, *args, **kwargs):  # what the driver sees when the monitor kills the call
        chunks = [] if killed else list(pipeline._chunks.values())
        chunk = next((c for c in chunks if pipeline.step >= 1 and c.summary_ref == refs), None)
        if chunk is not None:
            killed.append(chunk.generator)
            ray_cluster.kill(generators[chunk.generator], no_restart=False)
            raise ray_cluster.exceptions.OutOfMemoryError(
                "Task was killed due to the node running low on memory."
            )
        return real_get(refs, *args, **kwargs)

    monkeypatch.setattr(ray_cluster, "get", get)
    history = pipeline.run()
    monkeypatch.undo()
    assert len(killed) == 1
    assert pipeline.step == 4 and pipeline.trained_groups == list(range(16))
    last = history[-1]
    # one death, counted once (the publication that went to the killed process is not
    # news of another); its chunk, and any call queued behind it, redone
    assert last["pipeline/generator_failures"] == 1 and last["pipeline/chunks_redone"] >= 1
    assert last["pipeline/generators_lost"] == 0 and last["pipeline/generator_restarts"] == 1
    assert ray_cluster.get(generators[killed[0]].get_policy_version.remote()) == 4
    learner.shutdown()


def test_a_stage_call_killed_by_the_memory_monitor_names_its_actor(ray_cluster, monkeypatch):
    """OutOfMemoryError names no actor; the stage does, so that the driver brings that
    actor (the scorer) back on the current weights and redoes the stage."""
    from ray_credit.pipeline import StageError, actor_stage

    class Scorer:
        def score(self, batch):
            return batch

    scorer = ray_cluster.remote(Scorer).options(num_cpus=0).remote()
    stage = actor_stage(scorer.score, name="info_gain")
    assert ray_cluster.get(scorer.score.remote("batch")) == "batch"
    real_get = ray_cluster.get

    def get(refs, *args, **kwargs):
        real_get(refs, *args, **kwargs)
        raise ray_cluster.exceptions.OutOfMemoryError("Task was killed due to low memory.")

    monkeypatch.setattr(ray_cluster, "get", get)
    with pytest.raises(StageError, match="killed by Ray's memory monitor") as err:
        stage("batch")
    assert err.value.actor_id == scorer._actor_id.hex()
    monkeypatch.undo()
    ray_cluster.kill(scorer)


@pytest.mark.e2e  # an actor killed mid-run: the second test command
def test_a_judge_actor_killed_mid_run_has_its_calls_redone(ray_cluster, world, retriever):
    """CW-GRPO with a pool of two judge actors: one is killed for good after step 1. The
    choice (docs/reliability.md): its calls are redone on the other actor, never left
    null; every turn is judged, every group trained once, and the failures are counted
    in the steps' metrics."""
    from ray_credit.actors.judge import JudgePool
    from ray_credit.signals.cw_grpo_judgement import CWGRPOJudgement
    from tests.ray.test_judge_pool import LengthGrades

    generators, learner = _parts(retriever)
    pool = JudgePool(LengthGrades(), num_actors=2, batch_size=2, num_cpus=0, max_retries=3)
    signal = CWGRPOJudgement(skip_failed=False)  # tiny-random answers nothing right

    faults = Faults({1: lambda: ray_cluster.kill(pool._actors[0], no_restart=True)})
    config = PipelineConfig(steps=3, groups_per_step=4, chunk_groups=2, max_staleness=1)
    pipeline = Pipeline(
        generators, learner, world.questions, [pool.stage(signal), estimator_stage("cw_grpo")],
        config, on_step=faults,
    )  # fmt: skip
    history = pipeline.run()
    assert pipeline.step == 3 and pipeline.trained_groups == list(range(12))
    faults.report("one of two judge actors, gone", history)
    # every turn of every step was judged: as many judgements as requests, none failed
    for step in history:
        assert step["judge/requests"] > 0 and step.get("judge/failed", 0) == 0, step
    # the dead actor was found on a later step's calls, and they went to the other
    assert sum(step.get("judge/actor_failures", 0) for step in history[1:]) >= 1
    assert sum(step.get("judge/retries", 0) for step in history[1:]) >= 1
    learner.shutdown()


@pytest.mark.e2e  # an actor killed mid-run: the second test command
def test_the_retriever_killed_mid_run_is_retried_by_the_generators(ray_cluster, world):
    """The real retriever actor is killed after step 1: Ray restarts it (it rebuilds its
    index), searches sent meanwhile wait for it (one in flight at the kill is retried and
    counted in gen/retrieval_retries: the next test), and the run ends with every group
    trained once."""
    from ray._private.state import actors

    retriever = make_retriever_actor(world.corpus, num_cpus=0.25)  # this test's own
    generators, learner = _parts(retriever)

    faults = Faults({1: lambda: ray_cluster.kill(retriever, no_restart=False)})
    config = PipelineConfig(steps=3, groups_per_step=4, chunk_groups=2, max_staleness=1)
    pipeline = Pipeline(
        generators, learner, world.questions, [estimator_stage("grpo")], config, on_step=faults
    )
    history = pipeline.run()
    assert pipeline.step == 3 and pipeline.trained_groups == list(range(12))
    faults.report("the retriever, restarted", history)
    assert actors()[retriever._actor_id.hex()]["NumRestarts"] == 1  # it did die
    assert history[-1]["pipeline/generator_failures"] == 0  # nothing else had to give
    learner.shutdown()


@pytest.mark.e2e  # an actor killed mid-run: the second test command
def test_a_learner_worker_killed_mid_run_stops_it_by_name_and_resume_completes(
    ray_cluster, world, retriever, tmp_path
):
    """One rank of a two-worker learner is killed after step 3 of 4 (checkpoints every 2
    steps): step 4's update fails naming the rank, and a run resumed from the step-2
    checkpoint ends at step 4 with each group trained once in the final weights' lineage."""
    from ray_credit.actors.learner_group import LearnerWorkerError

    two = {"num_workers": 2, "resources_per_worker": {"CPU": 0.5}}
    config = PipelineConfig(
        steps=4, groups_per_step=4, chunk_groups=2, max_staleness=1, checkpoint_every=2,
        checkpoint_dir=str(tmp_path / "ckpt"),
    )  # fmt: skip
    generators, learner = _parts(retriever, **two)

    def kill(metrics):
        if metrics["pipeline/step"] == 3:
            ray_cluster.kill(learner._workers[1])

    first = Pipeline(
        generators, learner, world.questions, [estimator_stage("grpo")], config, on_step=kill
    )
    with pytest.raises(LearnerWorkerError, match=r"learner rank 1 died during 'train'"):
        first.run()
    learner.shutdown()
    for g in generators:
        ray_cluster.kill(g)
    assert [step for step, _ in checkpoints(tmp_path / "ckpt")] == [2]  # step 3: never saved
    state = json.loads((resolve_checkpoint(tmp_path / "ckpt") / "pipeline.json").read_text())
    assert state["step"] == 2

    resumed_at = time.monotonic()
    generators, learner = _parts(retriever, resume_from=tmp_path / "ckpt", **two)
    second = Pipeline(
        generators, learner, world.questions, [estimator_stage("grpo")], config,
        resume_from=tmp_path / "ckpt",
    )  # fmt: skip
    history = second.run()
    assert second.step == 4 and second.trained_groups == list(range(16))
    assert [h["pipeline/step"] for h in history] == [3, 4]
    print(
        f"\nRECOVERY a learner rank, killed after step 3: resumed from step 2, steps 3-4 "
        f"trained again in {time.monotonic() - resumed_at:.1f} s (start-up included)"
    )
    learner.shutdown()


def test_generator_retries_a_retriever_that_died(ray_cluster, tmp_path):
    from ray_credit.actors.generator import _Search

    @ray_cluster.remote(max_restarts=1, num_cpus=0)
    class DiesOnce:
        def __init__(self, marker: str):
            self.marker = marker

        def search(self, queries, topk):
            import os

            if not os.path.exists(self.marker):
                open(self.marker, "w").close()
                os._exit(1)  # the process dies mid-call; Ray restarts it
            return [
                [{"id": q, "contents": q, "title": q, "text": q, "score": 1.0}] for q in queries
            ]

    actor = DiesOnce.remote(str(tmp_path / "died"))
    search = _Search(actor, timeout_s=60, restart_s=60, backoff_s=0.1)
    try:
        assert search(["a", "b"], 1)[1][0]["id"] == "b"
        # the call that died is retried; a retry sent while Ray is still restarting the
        # actor is refused (ActorUnavailableError) and counted as one more
        retried = search.retries
        assert retried >= 1
        assert search(["c"], 1)[0][0]["id"] == "c"
        assert search.retries == retried  # a call that went through is not a retry
    finally:
        ray_cluster.kill(actor)


# the second test command's: one learner rank, and two (each sends its shard)
@pytest.mark.e2e
@pytest.mark.parametrize("workers", [1, 2])
def test_broadcast_weight_sync_over_gloo(ray_cluster, world, retriever, workers):
    """weight_sync='gloo' (the NCCL path's code on CPUs): the learner broadcasts in a
    process group of its own with the generators, which end on exactly its weights."""
    generators = [
        make_generator_actor("tiny-random", retriever, GEN, num_cpus=0.25) for _ in range(2)
    ]
    learner = LearnerGroup(
        "tiny-random",
        LearnerConfig(lr=1e-3),
        num_workers=workers,
        strategy="fsdp",
        resources_per_worker={"CPU": 0.5},
    )
    config = PipelineConfig(steps=2, groups_per_step=4, chunk_groups=2, weight_sync="gloo")
    pipeline = Pipeline(generators, learner, world.questions, [estimator_stage("grpo")], config)
    assert type(pipeline.publisher).__name__ == "CollectivePublisher"
    history = pipeline.run()
    assert pipeline.trained_groups == list(range(8))
    assert history[-1]["sync/publications"] == 2
    assert ray_cluster.get([g.get_policy_version.remote() for g in generators]) == [2, 2]
    expected = ray_cluster.get(learner.weights())
    for generator in generators:
        got = ray_cluster.get(generator.__ray_call__.remote(_model_weights))
        assert all(torch_equal(got[k], expected[k]) for k in expected)
    learner.shutdown()


def torch_equal(a, b) -> bool:
    import torch

    return bool(torch.equal(a, b))


class SlowStage:
    """A stage actor with a made-up cost (the shape of a judge or a scorer)."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def run(self, batch):
        import time

        time.sleep(self.seconds)
        return batch.with_metrics({"slow/calls": 1.0})


def _refuse_in_driver(*args):
    raise AssertionError("the driver unpickled a TrajectoryBatch")


def test_driver_holds_refs_only_and_stages_stream(ray_cluster, live, world, monkeypatch):
    """Batches refuse to unpickle in this (the driver's) process; the run still trains,
    because every batch stays in the object store and is read by generators, stage tasks
    and the learner (test_resume_trains_every_group_once checkpoints and resumes under the
    same refusal). A slow stage actor runs per chunk, while the learner trains the
    previous step."""
    import ray_credit.batch as batch_module
    from ray_credit.pipeline import actor_stage

    generators, learner = live
    slow = ray_cluster.remote(SlowStage).options(num_cpus=0, max_concurrency=4).remote(0.3)
    stages = [actor_stage(slow.run, name="slow"), estimator_stage("grpo")]
    config = PipelineConfig(
        steps=3,
        groups_per_step=2,
        chunk_groups=1,
        max_staleness=1,
    )
    monkeypatch.setattr(batch_module, "_from_ipc_unchecked", _refuse_in_driver)
    pipe = Pipeline(generators, learner, world.questions[:10], stages, config)
    history = pipe.run()
    assert pipe.trained_groups == list(range(6))
    for m in history:
        assert m["slow/calls"] == 2  # once per chunk, 2 chunks of 1 group per step
        assert m["time/stage_slow_s"] >= 2 * 0.3
        assert 0 <= m["time/stages_hidden_s"] <= m["time/stages_s"]
    # after the first step, some of the stage time overlapped training
    assert sum(m["time/stages_hidden_s"] for m in history[1:]) > 0


def test_step_stages_for_an_estimator_across_groups(ray_cluster, world, live):
    """An estimator that is not group-local runs once per step, on the step's chunks
    together; the pipeline refuses it as a per-chunk stage."""
    import dataclasses

    import numpy as np

    from ray_credit.estimators import get_estimator

    def batch_normalized(batch, config):
        reward = batch.traj_values("outcome_reward")
        centered = (reward - reward.mean())[batch.turn_traj_index].astype(np.float32)
        return batch.with_turn_columns(
            {"turn_advantages": centered}, metrics={"bn/trajectories": float(len(batch))}
        )

    est = dataclasses.replace(
        get_estimator("grpo"), name="batch_norm", fn=batch_normalized, group_local=False
    )
    generators, learner = live
    config = PipelineConfig(steps=2, groups_per_step=4, chunk_groups=2)
    with pytest.raises(ValueError, match="not group-local.*step_stages"):
        Pipeline(generators, learner, world.questions, [estimator_stage(est)], config)
    pipe = Pipeline(
        generators, learner, world.questions, [], config, step_stages=[estimator_stage(est)]
    )
    history = pipe.run()
    assert [m["bn/trajectories"] for m in history] == [8.0, 8.0]  # the whole step at once
    assert "time/stage_estimator_batch_norm_s" in history[0]
