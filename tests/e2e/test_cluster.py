"""The cluster workflows users run: `ray job submit` against `ray start --head`, the
fake-multinode twin of cluster.yaml scaling up and down, and cluster.yaml against Ray's
own config schema.

These start their own Ray head with `ray start`, on free ports (tests/_ports.py) and with
a Ray temp folder of its own, so that they run beside another Ray on this machine, in a
new process session that teardown kills entirely: no `ray stop`, which would kill every
Ray process on the machine. They run before tests/ray's shared cluster exists.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from tests._ports import ray_start_port_flags

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent

pytestmark = pytest.mark.slow


def _session_pids(sid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[3]) == sid:  # field 6 of stat: the session id
            pids.append(int(entry.name))
    return pids


class RayHead:
    """`ray start --head` in a process session of its own, with its own auth token, its
    own free ports (``address`` is its dashboard's, for `ray job`; ``gcs_address`` its
    GCS's) and its own Ray temp folder. The folder (RAY_TMPDIR, which every process of the
    head inherits) holds the address file through which Ray's CLIs and the state API in
    its workers find the cluster, so that they find this head and no other; it is short,
    for the sockets' paths. ``autoscaling_config``: a fake-multinode cluster of that YAML,
    whose nodes the provider starts against this head's GCS (its ``gcs_address``)."""

    def __init__(self, tmp: Path, *args: str, autoscaling_config: Path | None = None):
        from ray.util import get_node_ip_address

        ports, port_flags = ray_start_port_flags()
        self.address = f"http://127.0.0.1:{ports['dashboard-port']}"
        self.gcs_address = f"{get_node_ip_address()}:{ports['port']}"
        self.ray_tmp = Path(tempfile.mkdtemp(prefix="ray-e2e-"))
        if autoscaling_config is not None:
            # the fake provider starts nodes against port 6379 unless told the head's
            config = yaml.safe_load(autoscaling_config.read_text())
            config["provider"]["gcs_address"] = self.gcs_address
            autoscaling_config = tmp / autoscaling_config.name
            autoscaling_config.write_text(yaml.safe_dump(config, sort_keys=False))
            args = (*args, f"--autoscaling-config={autoscaling_config}")
        self.env = {
            **os.environ,
            "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
            # Token auth with a token of our own: works whether or not ~/.ray/auth_token
            # exists (a head started while it exists requires it from clients).
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": secrets.token_hex(32),
            "RAY_CREDIT_CACHE": os.environ.get("RAY_CREDIT_CACHE", str(tmp / "cache")),
            "RAY_TMPDIR": str(self.ray_tmp),
        }
        self.env.pop("RAY_ADDRESS", None)
        if autoscaling_config is not None:
            self.env["RAY_FAKE_CLUSTER"] = "1"
        self.tmp = tmp
        self.proc = subprocess.Popen(
            [str(BIN / "ray"), "start", "--head", *port_flags, *args],
            cwd=tmp, env=self.env, start_new_session=True,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        out, _ = self.proc.communicate(timeout=120)
        if self.proc.returncode != 0:
            self.stop()
            pytest.fail(f"ray start failed:\n{out}")
        self._wait_for_job_agent()

    def _wait_for_job_agent(self, timeout: float = 120) -> None:
        """`ray start` returns before the head's job agent is up, and a job submitted then
        fails with "No available agent to submit job": submit a no-op job (--no-wait) until
        one is taken."""
        deadline = time.monotonic() + timeout
        submit = ("job", "submit", "--address", self.address, "--no-wait")
        while True:
            probe = self.ray(*submit, "--", "python", "-c", "pass")
            if probe.returncode == 0:
                return
            if time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"the head's job agent never took a job:\n{probe.stdout}{probe.stderr}")
            time.sleep(1)

    def ray(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(BIN / "ray"), *args],
            cwd=self.tmp, env=self.env, capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip

    def active_nodes(self) -> dict[str, int]:
        """Node type -> count of the autoscaler's active nodes (`ray status`)."""
        out = self.ray("status", "--address", self.gcs_address, timeout=60).stdout
        counts: dict[str, int] = {}
        active = False
        for line in out.splitlines():
            if line.startswith("Active:"):
                active = True
            elif line.startswith(("Pending:", "Idle:")) or not line.strip():
                active = False
            elif active:
                n, node_type = line.split()
                counts[node_type] = int(n)
        return counts

    def first_report(self, timeout: float = 60) -> dict[str, int]:
        """The autoscaler's first non-empty report of active nodes (waiting up to
        ``timeout`` s for it after `ray start`)."""
        deadline = time.monotonic() + timeout
        while not (nodes := self.active_nodes()) and time.monotonic() < deadline:
            time.sleep(1)
        return nodes

    def run_watching_nodes(self, command: list[str], log, *, timeout: float
                           ) -> tuple[int | None, dict[str, int]]:  # fmt: skip
        """Run ``command`` (a job submission) with its output in ``log``, noting the most
        nodes of each type the autoscaler had up meanwhile; (exit status, those counts).
        A command past ``timeout`` is killed (status None)."""
        job = subprocess.Popen(command, cwd=self.tmp, env=self.env, stdout=log,
                               stderr=subprocess.STDOUT)  # fmt: skip
        peak: dict[str, int] = {}
        deadline = time.monotonic() + timeout
        while job.poll() is None and time.monotonic() < deadline:
            for node_type, n in self.active_nodes().items():
                peak[node_type] = max(peak.get(node_type, 0), n)
            time.sleep(2)
        if job.poll() is None:
            job.kill()
            return None, peak
        return job.returncode, peak

    def stop(self) -> None:
        sid = self.proc.pid  # start_new_session: the session id is ray start's pid
        for sig in (signal.SIGTERM, signal.SIGKILL):
            pids = _session_pids(sid)
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + 15
            while _session_pids(sid) and time.monotonic() < deadline:
                time.sleep(0.5)
        # its address file goes with it, as `ray stop` removes it; another Ray's stays
        shutil.rmtree(self.ray_tmp, ignore_errors=True)


def _summary(out_dir: Path, name: str) -> dict:
    return json.loads((out_dir / name / "summary.json").read_text())


@pytest.mark.e2e  # starts a Ray head of its own: the second test command
@pytest.mark.vllm
def test_job_submit_against_a_local_head(tmp_path):
    """`ray job submit --working-dir . -- python pipelines/tspo.py`: the script connects
    to the head (RAY_ADDRESS) instead of starting its own Ray, and trains and evaluates on
    the embedded backend, vLLM engines whose weights are loaded in place after every step
    (the transformers sampler goes through a job in the rehearsal below)."""
    head = RayHead(tmp_path, "--num-cpus=4")
    try:
        out = subprocess.run(
            [
                str(BIN / "ray"), "job", "submit", "--address", head.address, "--working-dir", ".",
                "--", "python", "pipelines/tspo.py",
                "--config", "pipelines/configs/local_cluster.yaml",
                "--resources.generator_resource", "none",
                "--resources.learner_resource", "none",
                "--resources.service_resource", "none",
                "--name", "submitted", "--output_dir", str(tmp_path / "runs"),
                "--generator.backend", "vllm", "--generator.vllm.kv_cache_gb", "1",
            ],
            cwd=ROOT, env=head.env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        log = out.stdout + out.stderr
        assert out.returncode == 0, log[-6000:]
        assert "connected to the Ray cluster" in log and "started a local Ray" not in log
        summary = _summary(tmp_path / "runs", "submitted")
        assert summary["steps"] == 2 and summary["groups_trained"] == 4
        assert {"eval_before", "eval_after"} <= set(summary)
        path = tmp_path / "runs" / "submitted" / "metrics.jsonl"
        last = json.loads(path.read_text().splitlines()[-1])
        assert last["gen/generated_tokens"] > 0
        # published weights were loaded into the engines: the run waits for every
        # publication before it ends, and a failed load fails it
        assert last["sync/publications"] >= 1
    finally:
        head.stop()


REHEARSAL = [  # a GPU config run with a tiny model on logical GPUs, computing on CPUs
    "--model", "tiny-random", "--resources.cpu_rehearsal", "true",
    "--retriever.encoder.name", "minilm",  # the embedded encoder: nothing to download
    "--generator.backend", "transformers", "--generator.dtype", "float32",
    "--learner.autocast", "none", "--learner.gradient_checkpointing", "false",
    "--resources.generator_cpus", "1", "--resources.learner_cpus", "1",
    "--resources.retriever_cpus", "0.5", "--resources.eval_cpus", "1",
    "--generator.group_size", "2", "--generator.max_turns", "2",
    "--generator.max_new_tokens", "8", "--pipeline.steps", "2",
    "--pipeline.groups_per_step", "4", "--pipeline.chunk_groups", "2",
    "--pipeline.checkpoint_every", "1", "--data.eval_questions", "4",
    "--data.world.num_entities", "20", "--wandb", "disabled",
]  # fmt: skip


@pytest.mark.e2e
def test_the_readme_cluster_command_rehearsed_on_the_twin_which_scales_up_and_down(tmp_path):
    """`ray job submit -- python pipelines/tspo.py --config pipelines/configs/aws.yaml`
    on cluster.local.yaml, whose node types carry logical GPUs: placed before any actor
    starts against the twin's node types (the plan printed), the autoscaler adds the
    generator, learner and service nodes the plan names, the two FSDP learner workers and
    two generators take a logical GPU each, and the run goes through its checkpoints to
    the end; then the idle nodes go away. Without storage every node sees, the same
    command is refused up front."""
    head = RayHead(tmp_path, autoscaling_config=ROOT / "cluster.local.yaml")
    try:
        assert set(head.first_report()) == {"ray.head.default"}
        command = [
            str(BIN / "ray"), "job", "submit", "--address", head.address, "--",
            "python", str(ROOT / "pipelines" / "tspo.py"),
            "--config", str(ROOT / "pipelines" / "configs" / "aws.yaml"),
            "--output_dir", str(tmp_path / "runs"), *REHEARSAL,
            "--resources.cluster_config", str(ROOT / "cluster.local.yaml"),
            "--resources.num_generators", "2", "--resources.learner_workers", "2",
        ]  # fmt: skip
        # storage on this node's disk, not vouched for: refused before any actor starts
        refused = head.ray(*command[1:], "--storage_path", str(tmp_path / "bucket"), timeout=300)
        assert refused.returncode != 0
        assert "span" in refused.stdout + refused.stderr and "--storage_shared" in (
            refused.stdout + refused.stderr
        )
        log_path = tmp_path / "job.log"
        with log_path.open("w") as log:
            shared = ["--storage_path", str(tmp_path / "bucket"), "--storage_shared", "true"]
            code, peak = head.run_watching_nodes([*command, *shared], log, timeout=900)
        text = log_path.read_text()
        assert code == 0, text[-6000:]
        assert "placement (the node types of" in text and "generator_gpu#1" in text
        # every role's node type was added to place its actors
        assert peak.get("generator_gpu", 0) == 2 and peak.get("learner_gpu", 0) == 1, peak
        assert peak.get("service_cpu", 0) == 1, peak
        summary = _summary(tmp_path / "runs", "tspo-qwen2.5-3b")
        assert summary["steps"] == 2 and summary["eval_after"]["questions"] == 4
        checkpoint = tmp_path / "bucket" / "tspo-qwen2.5-3b" / "checkpoint"
        assert sorted(p.name for p in checkpoint.iterdir() if p.name.startswith("step_"))

        # idle_timeout_minutes is 0.25 in the twin: the workers go within a minute or two
        deadline = time.monotonic() + 180
        nodes = head.active_nodes()
        while set(nodes) != {"ray.head.default"} and time.monotonic() < deadline:
            time.sleep(3)
            nodes = head.active_nodes()
        assert set(nodes) == {"ray.head.default"}, f"workers still up after idle: {nodes}"
    finally:
        head.stop()


@pytest.mark.e2e
def test_search_r1_yaml_rehearsed_on_a_local_ray_of_8_logical_gpus(tmp_path):
    """The README's real-data command on files shaped as Search-R1 ships them (the merged
    NQ + HotpotQA parquet with its per-source ids and prompts, the gzipped corpus, a faiss
    index downloaded in two parts and joined with cat), on a local Ray the script starts
    with 8 logical GPUs: the plan puts the 4 FSDP learner workers and the 4 generators on
    a GPU each, with a slice of the index beside each (the slices on CPUs here), every
    actor starts (none waits), the index is imported and checked, the test file is
    evaluated whole, and the run goes through its checkpoints."""
    from tests.search_r1_files import write_search_r1_files

    files = write_search_r1_files(tmp_path)
    joined = tmp_path / "e5_Flat.index"
    subprocess.run(f"cat {tmp_path}/part_* > {joined}", shell=True, check=True)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    out = subprocess.run(
        [sys.executable, str(ROOT / "pipelines" / "tspo.py"),
         "--config", str(ROOT / "pipelines" / "configs" / "search_r1.yaml"),
         "--data.questions", str(files["train"]), "--data.eval_file", str(files["test"]),
         "--data.corpus", str(files["corpus"]), "--retriever.index_file", str(joined),
         "--output_dir", str(tmp_path / "runs"),
         "--resources.local_gpus", "8", "--resources.local_cpus", "24", *REHEARSAL],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=900,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    text = out.stdout + out.stderr
    assert "placement (a local Ray; 1 of 1 node(s) used, 8 GPU(s))" in text
    # the index in 8 slices, one beside each learner worker and generator, searched as one
    assert re.search(r"index slice 7 +this machine +7 \(0\.1\)", text), text[-3000:]
    assert re.search(r"retriever: \d+ vectors of \S+e5_Flat.index in 8 slices of", text)
    assert "ids repeat across data sources" in text and "bring their own prompt" in text
    assert "note: departs from search-r1: pipeline.max_staleness = 1" in text
    summary = _summary(tmp_path / "runs", "search-r1-3b")
    assert summary["steps"] == 2 and summary["groups_trained"] == 8
    assert summary["eval_after"]["questions"] == 16  # the test file, whole, by source
    assert summary["eval_before"]["count_by_source"] == {"nq": 8, "hotpotqa": 8}
    assert "search-r1: pipeline.max_staleness = 1 (search-r1: 0" in "\n".join(summary["departures"])
    checkpoint = tmp_path / "runs" / "search-r1-3b" / "checkpoint"
    assert any(p.name.startswith("step_") for p in checkpoint.iterdir())


def _raylet_of(node_id: str) -> int:
    """The pid of the raylet of node ``node_id`` (a fake node is a process tree here)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if args and args[0].endswith(b"raylet") and f"--node_id={node_id}".encode() in args:
            return int(entry.name)
    raise AssertionError(f"no raylet of node {node_id} is running")


@pytest.mark.e2e  # starts a Ray head of its own: the second test command
def test_a_node_hosting_a_generator_dies_mid_run(tmp_path):
    """cluster.local.yaml, two generators on generator nodes: once step 2 is logged, the
    node of one of them dies (its raylet SIGKILLed: every process of the node goes with
    it). The run goes on: the dead generator's chunks go to the other, Ray restarts it
    once a node with its resource is there again (the autoscaler adds one in place of the
    dead), and the run ends with every group trained once."""
    head = RayHead(tmp_path, autoscaling_config=ROOT / "cluster.local.yaml")
    job_id, steps = "node-dies", 150  # about 0.3 s each: time to find and kill a node
    out = tmp_path / "runs" / "local-cluster"

    def job_status() -> str:
        out = head.ray("job", "status", "--address", head.address, job_id)
        text = (out.stdout + out.stderr).lower()  # "Job 'node-dies' succeeded"
        return next((s for s in ("succeeded", "failed", "stopped") if s in text), "running")

    def logged_steps() -> int:
        path = out / "metrics.jsonl"
        return len(path.read_text().splitlines()) if path.exists() else 0

    try:
        head.first_report()
        # --no-wait and polling: a job's log tail over the dashboard's websocket can drop
        # while nodes come and go, which would end `ray job submit` but not the job
        submitted = head.ray(
            "job", "submit", "--address", head.address, "--submission-id", job_id, "--no-wait",
            "--", "python", str(ROOT / "pipelines" / "tspo.py"),
            "--config", str(ROOT / "pipelines" / "configs" / "local_cluster.yaml"),
            "--output_dir", str(tmp_path / "runs"), "--resources.num_generators", "2",
            "--pipeline.steps", str(steps), "--eval.enabled", "false",
        )  # fmt: skip
        assert submitted.returncode == 0, submitted.stdout + submitted.stderr
        deadline = time.monotonic() + 420
        while logged_steps() < 2:
            status = job_status()
            assert status == "running" and time.monotonic() < deadline, head.ray(
                "job", "logs", "--address", head.address, job_id
            ).stdout[-6000:]
            time.sleep(1)
        listed = head.ray(
            "list", "actors", "--address", head.address, "--detail", "--format", "json",
            "--filter", "class_name=Generator", "--filter", "state=ALIVE",
        )  # fmt: skip
        nodes = head.ray("list", "nodes", "--address", head.address, "--format", "json")
        head_ids = {n["node_id"] for n in json.loads(nodes.stdout) if n["is_head_node"]}
        generators = [a for a in json.loads(listed.stdout) if a["node_id"] not in head_ids]
        assert generators, listed.stdout + listed.stderr + nodes.stdout
        os.kill(_raylet_of(generators[0]["node_id"]), signal.SIGKILL)
        killed_at, at_step = time.monotonic(), logged_steps()
        deadline = killed_at + 600
        while (status := job_status()) == "running" and time.monotonic() < deadline:
            time.sleep(2)
        finished_at = time.monotonic()
        log_text = head.ray("job", "logs", "--address", head.address, job_id).stdout
        assert status == "succeeded", log_text[-6000:]
        summary = _summary(tmp_path / "runs", "local-cluster")
        assert summary["steps"] == steps and summary["groups_trained"] == 2 * steps
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert [r["pipeline/step"] for r in rows] == list(range(1, steps + 1))
        # the loss shows and nothing is lost. The death is seen either by the generate call
        # in flight on the node (its chunk redone) or, when the generator sat idle at the
        # staleness bound, by the next weight publication (no chunk of its own to redo)
        last = rows[-1]
        assert last["pipeline/generator_failures"] >= 1, last
        assert last["pipeline/chunks_lost"] == 0, last
        step_s = sorted(r["time/step_s"] for r in rows)
        print(
            f"\nRECOVERY a generator's node, killed after step {at_step} of {steps}: the run "
            f"finished {finished_at - killed_at:.0f} s later (median step {step_s[steps // 2]:.1f}"
            f" s); generator failures {last['pipeline/generator_failures']:.0f}, lost "
            f"{last.get('pipeline/generators_lost', 0):.0f}, chunks redone "
            f"{last['pipeline/chunks_redone']:.0f}"
        )
    finally:
        head.stop()


def _load(name: str) -> dict:
    return yaml.safe_load((ROOT / name).read_text())


@pytest.mark.parametrize("name", ["cluster.yaml", "cluster.local.yaml"])
def test_cluster_configs_pass_rays_schema(name):
    from ray.autoscaler._private.util import prepare_config, validate_config

    # as `ray up` does before it talks to the cloud: merge the provider's defaults, then
    # check against ray-schema.json (raises on a violation). The wheel lacks the fake
    # provider's defaults file, so the twin spells every field out and goes in as is.
    config = _load(name)
    if config["provider"]["type"] != "fake_multinode":
        config = prepare_config(config)
    validate_config(config)
    assert config["head_node_type"] in config["available_node_types"]


def test_twin_mirrors_cluster_yaml_and_pipeline_configs_use_its_resources():
    real, twin = _load("cluster.yaml"), _load("cluster.local.yaml")
    assert real["provider"]["type"] == "aws" and twin["provider"]["type"] == "fake_multinode"
    assert real["available_node_types"].keys() == twin["available_node_types"].keys()

    def custom(node_type: dict) -> set[str]:
        return set(node_type["resources"]) - {"CPU", "GPU", "memory", "object_store_memory"}

    for name, node_type in real["available_node_types"].items():
        assert custom(node_type) == custom(twin["available_node_types"][name]), name
    offered = set().union(*(custom(t) for t in real["available_node_types"].values()))
    assert offered == {"generator", "learner", "service"}
    assert any("pip install" in c and "ray_credit" in c for c in real["setup_commands"])
    for config in ("aws.yaml", "local_cluster.yaml"):
        res = yaml.safe_load((ROOT / "pipelines" / "configs" / config).read_text())["resources"]
        asked = {res[f"{role}_resource"] for role in ("generator", "learner", "service")}
        assert asked == offered, config
