"""LearnerGroup: the learner behind one API, as one Ray actor or a Ray Train DDP group.

``num_workers=1`` runs a :class:`~ray_credit.actors.learner.Learner` in one Ray actor.
``num_workers>1`` runs Ray Train's ``TorchTrainer`` (gloo on CPUs, NCCL on GPUs): every
worker holds a replica wrapped in DDP, and a small mailbox actor hands them commands in
order (train a batch, return the weights, save, stop). For a ``train`` command every
rank reads the whole batch from the object store and trains on its share of each
mini-batch; the loss is normalized over the whole mini-batch (see
:mod:`ray_credit.actors.learner`), so the update equals one worker's on the same data up
to float rounding.

Every call waits at most ``timeout_s`` and raises :class:`TimeoutError` naming the
command; a worker's exception is raised in the driver with the worker's traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ray_credit.actors.learner import LearnerConfig

__all__ = ["LearnerGroup", "LearnerWorkerError"]


class LearnerWorkerError(RuntimeError):
    """A learner worker failed; the message carries its rank and traceback."""


@dataclass
class _Reply:
    rank: int
    value: Any = None
    error: str | None = None


class _Mailbox:
    """Commands from the driver to every rank (in order), replies back (async actor)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.commands: dict[int, tuple[str, Any]] = {}
        self.replies: dict[int, dict[int, _Reply]] = {}
        self.changed = asyncio.Condition()

    async def command(self, step: int, op: str, payload: Any) -> None:
        async with self.changed:
            self.commands[step] = (op, payload)
            self.changed.notify_all()

    async def next_command(self, step: int) -> tuple[str, Any]:
        async with self.changed:
            await self.changed.wait_for(lambda: step in self.commands)
            return self.commands[step]

    async def reply(self, step: int, reply: _Reply) -> None:
        async with self.changed:
            self.replies.setdefault(step, {})[reply.rank] = reply
            if len(self.replies[step]) == self.world_size:
                self.commands.pop(step, None)
            self.changed.notify_all()

    async def wait_replies(self, step: int) -> list[_Reply]:
        async with self.changed:
            await self.changed.wait_for(
                lambda: (
                    len(self.replies.get(step, {})) == self.world_size
                    or any(r.error for r in self.replies.get(step, {}).values())
                )
            )
            replies = self.replies.pop(step) if step in self.replies else {}
            return [replies[r] for r in sorted(replies)]


def _worker_loop(cfg: Mapping[str, Any]) -> None:
    """Runs on every Ray Train worker: build the replica, then serve commands until stop."""
    import ray
    import ray.train
    import ray.train.torch

    from ray_credit.actors.learner import Learner, TorchDistributed, TorchFSDP

    context = ray.train.get_context()
    rank = context.get_world_rank()
    mailbox = cfg["mailbox"]
    step = 0
    try:
        device = str(ray.train.torch.get_device())
        world = TorchFSDP() if cfg.get("strategy") == "fsdp" else TorchDistributed()
        learner = Learner(cfg["model"], cfg["config"], device=device, world=world)
        if cfg.get("resume_from"):
            learner.load_state(cfg["resume_from"])
    except Exception:
        ray.get(mailbox.reply.remote(step, _Reply(rank, error=traceback.format_exc())))
        raise
    ray.get(mailbox.reply.remote(step, _Reply(rank, value="ready")))
    step += 1
    while True:
        op, payload = ray.get(mailbox.next_command.remote(step))
        if op == "stop":
            ray.get(mailbox.reply.remote(step, _Reply(rank, value="stopped")))
            return
        try:
            if op == "train":
                batch = ray.get(payload[0])
                value = learner.train(batch)  # each rank trains on its share
            elif op == "weights":  # every rank: FSDP gathers the shards at rank 0
                weights = learner.get_weights()
                value = [ray.put(weights)] if rank == 0 else None
            elif op == "save":  # every rank takes part, rank 0 writes
                path = str(learner.save(payload))
                value = path if rank == 0 else None
            elif op == "version":
                value = learner.policy_version
            elif op == "open_weight_group":
                value = learner.open_weight_group(*payload)
            elif op == "weight_manifest":
                value = learner.weight_manifest() if rank == 0 else None
            elif op == "join_weight_group":
                value = learner.join_weight_group(*payload)
            elif op == "broadcast":  # every rank: FSDP gathers, rank 0 sends
                value = learner.broadcast_weights()
            else:
                raise ValueError(f"unknown learner command {op!r}")
        except Exception:
            ray.get(mailbox.reply.remote(step, _Reply(rank, error=traceback.format_exc())))
            raise
        ray.get(mailbox.reply.remote(step, _Reply(rank, value=value)))
        step += 1


def check_strategy(strategy: str) -> None:
    """Raise unless ``strategy`` is one :class:`LearnerGroup` knows."""
    if strategy not in ("ddp", "fsdp"):
        raise ValueError(f"learner strategy must be 'ddp' or 'fsdp', got {strategy!r}")


class LearnerGroup:
    """One learner, or ``num_workers`` data-parallel replicas under Ray Train.

    Args:
        model: what :class:`~ray_credit.actors.learner.Learner` takes (a name or folder).
        config: :class:`LearnerConfig`.
        num_workers: 1 = one actor; more = a ``TorchTrainer`` with ``strategy``.
        use_gpu: one GPU per worker (NCCL); else CPU (gloo).
        strategy: ``"ddp"`` (a full replica per worker) or ``"fsdp"`` (parameters,
            gradients and optimizer state sharded over the workers, FSDP2); the same
            update either way. Only with ``num_workers > 1``.
        resources_per_worker: e.g. ``{"CPU": 2}`` or custom resources to pin learner nodes.
        resume_from: a folder written by :meth:`save`: the learner restarts from it.
        timeout_s: the longest any command may take.
    """

    def __init__(
        self,
        model: str = "smollm2-135m",
        config: LearnerConfig | None = None,
        *,
        num_workers: int = 1,
        use_gpu: bool = False,
        resources_per_worker: Mapping[str, float] | None = None,
        resume_from: str | None = None,
        timeout_s: float = 1800.0,
        name: str = "learner",
        strategy: str = "ddp",
    ) -> None:
        import ray

        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        check_strategy(strategy)
        self.config = config or LearnerConfig()
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self._ray = ray
        if resume_from is not None:
            model = f"{resume_from}/model"
        resources = dict(resources_per_worker or {"CPU": 1})
        if num_workers == 1:
            from ray_credit.actors.learner import Learner

            options = {
                "num_cpus": resources.pop("CPU", 1),
                "num_gpus": resources.pop("GPU", 1 if use_gpu else 0),
                "resources": resources,
            }
            self._actor = (
                ray.remote(Learner)
                .options(**options)
                .remote(model, self.config, device="cuda" if use_gpu else "cpu")
            )
            if resume_from is not None:
                self._get(self._actor.load_state.remote(resume_from), "resume")
            self._get(self._actor.get_policy_version.remote(), "start")
            return

        from ray.train import RunConfig, ScalingConfig
        from ray.train.torch import TorchTrainer

        self._actor = None
        self._mailbox = ray.remote(_Mailbox).options(num_cpus=0).remote(num_workers)
        self._step = 0
        trainer = TorchTrainer(
            _worker_loop,
            train_loop_config={
                "model": model,
                "config": self.config,
                "mailbox": self._mailbox,
                "resume_from": resume_from,
                "strategy": strategy,
            },
            scaling_config=ScalingConfig(
                num_workers=num_workers, use_gpu=use_gpu, resources_per_worker=resources
            ),
            run_config=RunConfig(name=name),
        )
        self._fit_error: BaseException | None = None
        self._thread = threading.Thread(target=self._fit, args=(trainer,), daemon=True)
        self._thread.start()
        self._command(None, None, wait_for="start")  # step 0: every rank built its replica

    # ----------------------------------------------------------------------- API
    def train(self, batch: Any) -> dict[str, float]:
        """One policy update on a batch (a TrajectoryBatch or an ObjectRef to one)."""
        if self._actor is not None:
            return self._get(self._actor.train.remote(batch), "train")
        ref = batch if isinstance(batch, self._ray.ObjectRef) else self._ray.put(batch)
        replies = self._command("train", [ref])
        return replies[0].value

    def weights(self) -> Any:
        """An ObjectRef to the policy's full state dict (CPU tensors)."""
        if self._actor is not None:
            return self._actor.get_weights.remote()
        return self._command("weights", None)[0].value[0]

    def save(self, folder: str) -> str:
        """Model, optimizer, scheduler, RNG states and counters (rank 0 writes)."""
        if self._actor is not None:
            return str(self._get(self._actor.save.remote(folder), "save"))
        return self._command("save", str(folder))[0].value

    # ------------------------------------------------ collective weight sync
    def open_weight_group(self, world_size: int, backend: str) -> tuple[str, list]:
        """Open the learner's side of a broadcast group (rank 0 sends); returns the
        group's address and the weights' manifest (see ``ray_credit.pipeline.collective``)."""
        if self._actor is not None:
            address = self._get(
                self._actor.open_weight_group.remote(world_size, backend, self.timeout_s),
                "open_weight_group",
            )
            return address, self._get(self._actor.weight_manifest.remote(), "weight_manifest")
        address = self._command("open_weight_group", (world_size, backend, self.timeout_s))
        manifest = self._command("weight_manifest", None)
        return address[0].value, manifest[0].value

    def join_weight_group(self, address: str, manifest: list) -> Any:
        """Join the group; returns an ObjectRef (joining waits for every member)."""
        if self._actor is not None:
            return self._actor.join_weight_group.remote(address, manifest)
        return self._post("join_weight_group", (address, manifest))

    def broadcast_weights(self) -> Any:
        """Broadcast the current weights to the group; returns an ObjectRef."""
        if self._actor is not None:
            return self._actor.broadcast_weights.remote()
        return self._post("broadcast", None)

    @staticmethod
    def check(value: Any) -> Any:
        """The value of a ref from :meth:`join_weight_group` / :meth:`broadcast_weights`;
        raises :class:`LearnerWorkerError` when a replica reported an error."""
        if isinstance(value, list) and value and isinstance(value[0], _Reply):
            errors = [r for r in value if r.error]
            if errors:
                raise LearnerWorkerError(
                    f"learner rank {errors[0].rank} failed:\n{errors[0].error}"
                )
            return value[0].value
        return value

    def _post(self, op: str, payload: Any) -> Any:
        """Send a command to every replica without waiting; returns the replies' ref."""
        if self._fit_error is not None or not self._thread.is_alive():
            raise LearnerWorkerError(f"the learner group has stopped: {self._fit_error!r}")
        step = self._step
        self._get(self._mailbox.command.remote(step, op, payload), op)
        self._step += 1
        return self._mailbox.wait_replies.remote(step)

    @property
    def policy_version(self) -> int:
        if self._actor is not None:
            return int(self._get(self._actor.get_policy_version.remote(), "version"))
        versions = {r.value for r in self._command("version", None)}
        if len(versions) != 1:
            raise LearnerWorkerError(f"learner replicas disagree on the policy version: {versions}")
        return versions.pop()

    def shutdown(self) -> None:
        """Stop the workers (the group cannot be used afterwards)."""
        if self._actor is not None:
            self._ray.kill(self._actor)
            self._actor = None
            return
        if self._thread.is_alive() and self._fit_error is None:
            # the workers may already have ended (after a failure): nothing left to stop
            with contextlib.suppress(LearnerWorkerError):
                self._command("stop", None)
        self._thread.join(timeout=self.timeout_s)

    # ------------------------------------------------------------------ plumbing
    def _fit(self, trainer: Any) -> None:
        try:
            trainer.fit()
        except BaseException as err:  # reported by the next command
            self._fit_error = err

    def _get(self, ref: Any, what: str) -> Any:
        try:
            return self._ray.get(ref, timeout=self.timeout_s)
        except self._ray.exceptions.GetTimeoutError:
            raise TimeoutError(
                f"learner command {what!r} did not finish within {self.timeout_s:.0f} s"
            ) from None

    def _command(self, op: str | None, payload: Any, wait_for: str | None = None) -> list[_Reply]:
        step = self._step
        what = wait_for or op
        if op is not None:
            if self._fit_error is not None or not self._thread.is_alive():
                raise LearnerWorkerError(f"the learner group has stopped: {self._fit_error!r}")
            self._get(self._mailbox.command.remote(step, op, payload), what)
        pending = self._mailbox.wait_replies.remote(step)
        deadline_s, waited = self.timeout_s, 0.0
        while True:  # poll so a crashed trainer is noticed before the timeout
            ready, _ = self._ray.wait([pending], timeout=5.0)
            if ready:
                break
            waited += 5.0
            if not self._thread.is_alive():
                raise LearnerWorkerError(
                    f"the learner group stopped during {what!r}: {self._fit_error!r}"
                )
            if waited >= deadline_s:
                raise TimeoutError(
                    f"learner command {what!r} did not finish within {self.timeout_s:.0f} s"
                )
        replies = self._ray.get(pending)
        self._step += 1
        errors = [r for r in replies if r.error]
        if errors:
            raise LearnerWorkerError(
                f"learner rank {errors[0].rank} failed during {what!r}:\n{errors[0].error}"
            )
        return replies
