"""The peer side of ``bench/peers.py``: the main job's search task trained with TRL's
``GRPOTrainer`` (the ``[peers]`` extra), in a process of its own.

    python bench/peers_trl.py --model runs/peers/warm_start --out runs/peers/trl --steps 4 \
        --pipeline.groups_per_step 16   # any further flag: the task's, as tspo.py takes it

The task is the main job's, read from the same settings (``pipelines/tspo.py``'s embedded
config, with any further flags on top): the synthetic world and its held-out split, the
MiniLM index, the prompt, the ``<search>``/``<answer>`` protocol, three turns of at most 32
tokens, one document per search, exact match as the reward. TRL runs it the way its
documentation shows a custom multi-turn rollout: a ``rollout_func`` that returns each
completion's token ids with an ``env_mask`` that leaves the observations untrained, and a
reward function that reads the reward the rollout computed. Each turn is sampled as
TRL's own transformers generation samples (``model.generate`` on the trainer's model, the
contexts left-padded into one batch, nothing kept between turns); the protocol around it
(prompt, stop strings, parsing the action, searching, formatting the observation,
scoring the answer) is ray_credit's ``Generator``, so that both systems roll out the same
task. Writes ``steps.json`` (each step's seconds, generation and retrieval seconds,
trained tokens and mean reward) and the trained model in ``--out/final``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
STARTED = time.perf_counter()


class GenerateSampler:
    """One turn of every context through the trainer's model's ``generate``, as TRL's
    transformers generation samples: all contexts left-padded into one batch, sampled
    with the turn's settings and stop strings, no cache kept from one turn to the next.
    ``autocast``: generate under it (TRL's own generation runs in the model's dtype, float32
    here; under the trainer's bf16 autocast it samples in the precision ray_credit's
    generator does)."""

    def __init__(self, trainer, tokenizer, autocast: str | None = None):
        self.trainer = trainer
        self.tokenizer = tokenizer
        self.autocast = autocast  # the learner's setting: None, "auto", "bfloat16", ...
        self.eos_token_id = int(tokenizer.eos_token_id)
        self.pad_token_id = int(
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        )

    def sample(self, contexts, params, *, seed: int):
        import torch
        from transformers import GenerationConfig
        from trl.models import unwrap_model_for_generation

        from ray_credit.actors.learner import autocast
        from ray_credit.actors.sampling import SampledTurn

        torch.manual_seed(seed)
        width = max(len(c) for c in contexts)
        ids = torch.tensor([[self.pad_token_id] * (width - len(c)) + list(c) for c in contexts])
        mask = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in contexts])
        config = GenerationConfig(
            max_new_tokens=params.max_new_tokens, do_sample=params.temperature > 0,
            temperature=params.temperature or None, top_p=params.top_p,
            top_k=params.top_k or None, stop_strings=list(params.stop),
            pad_token_id=self.pad_token_id, eos_token_id=self.eos_token_id,
            output_scores=True, return_dict_in_generate=True, disable_compile=True,
        )  # fmt: skip
        trainer = self.trainer
        with (
            unwrap_model_for_generation(trainer.model_wrapped, trainer.accelerator) as model,
            torch.no_grad(),
            autocast(model.device, self.autocast),
        ):
            out = model.generate(
                input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                generation_config=config, tokenizer=self.tokenizer,
            )  # fmt: skip
            logps = model.compute_transition_scores(
                out.sequences, out.scores, normalize_logits=True
            )
        new = out.sequences[:, width:].cpu()
        turns = []
        for row, row_logps in zip(new.tolist(), logps.float().cpu().tolist(), strict=True):
            n, stopped = self._turn_length(row, row_logps, params.stop)
            turns.append(
                SampledTurn(row[:n], row_logps[:n], not stopped and n >= params.max_new_tokens)
            )
        return turns

    def _turn_length(self, row: list[int], logps: list[float], stop) -> tuple[int, bool]:
        """How many of ``row``'s tokens the turn sampled (through the first stop string or
        eos; a finished row is padded after it, and the padding scores -inf), and whether
        it stopped."""
        import math

        for n in range(1, len(row) + 1):
            if not math.isfinite(logps[n - 1]):
                return n - 1, True  # padding: the row had finished
            if row[n - 1] == self.eos_token_id:
                return n, True
            if any(s in self.tokenizer.decode(row[:n], skip_special_tokens=False) for s in stop):
                return n, True
        return len(row), False

    def load_weights(self, weights) -> None:  # the trainer's own model: always current
        raise NotImplementedError("GenerateSampler samples the trainer's model itself")


class ColocatedVLLMSampler:
    """One turn of every context through the vLLM engine TRL colocates with its trainer
    (``use_vllm=True, vllm_mode="colocate"``): the way TRL's documentation samples in a
    rollout function. TRL pushes the trainer's weights to it before each step."""

    def __init__(self, trainer, tokenizer):
        self.trainer = trainer
        self.tokenizer = tokenizer
        self.eos_token_id = int(tokenizer.eos_token_id)

    def sample(self, contexts, params, *, seed: int):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from ray_credit.actors.sampling import SampledTurn

        sampling = SamplingParams(
            max_tokens=params.max_new_tokens, temperature=params.temperature, top_p=params.top_p,
            top_k=params.top_k or -1, stop=list(params.stop), include_stop_str_in_output=True,
            logprobs=0, seed=seed,
        )  # fmt: skip
        llm = self.trainer.vllm_generation.llm
        outs = llm.generate([TokensPrompt(prompt_token_ids=list(c)) for c in contexts], sampling,
                            use_tqdm=False)  # fmt: skip
        turns = []
        for out in outs:
            done = out.outputs[0]
            ids = list(done.token_ids)
            logps = [float(next(iter(lp.values())).logprob) for lp in (done.logprobs or [])]
            turns.append(SampledTurn(ids, logps, done.finish_reason == "length"))
        return turns

    def load_weights(self, weights) -> None:  # TRL syncs the engine itself
        raise NotImplementedError("TRL pushes the trainer's weights to its colocated engine")


def probe_colocated_vllm(trainer) -> str | None:
    """None when TRL's colocated engine takes the trainer's weights (its sync before every
    step), else the error it raises."""
    try:
        trainer.vllm_generation.sync_weights()
    except Exception as err:  # noqa: BLE001 - what fails is the finding
        return f"{type(err).__name__}: {err}"
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="the policy to start from (a folder)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--questions", type=int, default=16, help="questions per step")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=8, help="completions per backward")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--generation",
        choices=("transformers", "vllm-colocate"),
        default="transformers",
        help="how TRL samples each turn",
    )
    parser.add_argument("--generation-autocast", choices=("on", "off"), default="off",
                        help="transformers generation in the model's float32 as TRL's own (off), "
                             "or under the learner's autocast: bf16 where the CPU has it (on)")  # fmt: skip
    parser.add_argument("--probe", action="store_true",
                        help="only build the trainer and sync its weights into the engine; "
                             "print whether that works")  # fmt: skip
    args, task = parser.parse_known_args()  # the rest: the task's settings, as tspo.py takes them
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GB: as the main job's engine

    try:
        import trl  # noqa: F401
    except ImportError:
        raise SystemExit(
            "TRL is not installed: pip install -e '.[peers]' (TRL's GRPOTrainer and datasets)"
        ) from None
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from ray_credit.actors.generator import Generator
    from ray_credit.actors.retriever import Retriever
    from ray_credit.models import load_model
    from ray_credit.pipeline.cli import run_config_class
    from ray_credit.pipeline.configs import load_config
    from ray_credit.pipeline.questions import load_data
    from ray_credit.warm_start import rl_questions

    cls = run_config_class(ROOT / "pipelines" / "tspo.py", "TSPORun")
    cfg = load_config(cls, "tspo", task)
    corpus, train_q, _ = load_data(cfg.data, seed=cfg.pipeline.seed)
    pool = rl_questions(train_q, cfg.warm_start)
    by_text = {q["question"]: q for q in pool}
    if len(by_text) != len(pool):
        raise SystemExit(
            "two training questions share a text: the rollout could not tell them apart"
        )
    retriever = Retriever.create(
        corpus, encoder=cfg.retriever.encoder, index=cfg.retriever.index,
        index_folder=cfg.retriever.index_folder,
    )  # fmt: skip
    model, tokenizer = load_model(args.model)  # a folder, an HF id or an embedded name
    completions = args.questions * args.group_size
    if completions % args.micro_batch:
        raise SystemExit(f"--micro-batch {args.micro_batch} must divide {completions} completions")
    gen_cfg = replace(cfg.generator, backend="transformers", group_size=args.group_size)
    state = {"generator": None}
    steps: list[dict] = []
    pending: dict = {}

    def rollout(prompts, trainer):
        """TRL's rollout_func: ``prompts`` holds each question ``group_size`` times in a row."""
        if state["generator"] is None:
            if args.generation == "transformers":
                cast = cfg.learner.autocast if args.generation_autocast == "on" else None
                sampler = GenerateSampler(trainer, tokenizer, autocast=cast)
            else:
                sampler = ColocatedVLLMSampler(trainer, tokenizer)
            state["generator"] = Generator(retriever=retriever, config=gen_cfg, sampler=sampler)
        questions = [by_text[p] for p in prompts[:: args.group_size]]
        if [p for p in prompts[:: args.group_size] for _ in range(args.group_size)] != list(
            prompts
        ):
            raise RuntimeError("rollout_func expects each prompt num_generations times in a row")
        start = time.perf_counter()
        batch = state["generator"].generate(questions, group_size=args.group_size)
        metrics = batch.metrics
        out = {
            "prompt_ids": [],
            "completion_ids": [],
            "logprobs": [],
            "env_mask": [],
            "outcome_reward": [],
        }
        trained = 0
        for record in batch.to_records():
            mask = record["loss_mask"]
            first = mask.index(1)  # the prompt (and the response prefix) end here
            out["prompt_ids"].append(record["input_ids"][:first])
            out["completion_ids"].append(record["input_ids"][first:])
            out["logprobs"].append(record["behavior_logprobs"][first:])
            out["env_mask"].append(mask[first:])
            out["outcome_reward"].append(record["outcome_reward"])
            trained += sum(mask)
        pending.update(
            generation_s=time.perf_counter() - start,
            retrieval_s=metrics.get("gen/retrieval_seconds", 0.0),
            trained_tokens=trained, tokens=sum(len(r) for r in out["prompt_ids"]) + sum(
                len(c) for c in out["completion_ids"]),
            reward=sum(out["outcome_reward"]) / len(out["outcome_reward"]), trajectories=len(out["outcome_reward"]),
        )  # fmt: skip
        return out

    def exact_match(completions, outcome_reward, **kwargs):
        """Exact match of each rollout's answer, as the rollout scored it."""
        return list(outcome_reward)

    class Steps(TrainerCallback):
        def on_step_begin(self, args_, state_, control, **kw):
            pending.clear()
            pending["begin"] = time.perf_counter()

        def on_step_end(self, args_, state_, control, **kw):
            end = time.perf_counter()
            row = {"step": state_.global_step, "seconds": end - pending.pop("begin"), **pending}
            row["update_s"] = row["seconds"] - row.get("generation_s", 0.0)
            steps.append(row)
            print(f"trl step {row['step']}/{args.steps}  reward {row.get('reward', 0):.3f}  "
                  f"step {row['seconds']:.0f}s (generation {row.get('generation_s', 0):.0f}s, "
                  f"retrieval {row.get('retrieval_s', 0):.1f}s)", flush=True)  # fmt: skip

    dataset = Dataset.from_list([{"prompt": q["question"]} for q in pool])
    config = GRPOConfig(
        output_dir=str(args.out / "trainer"), max_steps=args.steps,
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=completions // args.micro_batch,
        num_generations=args.group_size, learning_rate=cfg.learner.lr,
        lr_scheduler_type="constant", warmup_steps=0, beta=cfg.learner.kl_coef, num_iterations=1,
        epsilon=cfg.learner.loss.clip_low, epsilon_high=cfg.learner.loss.clip_high,
        loss_type="dapo",  # token-mean over the step's batch, as the learner's agg_mode
        temperature=cfg.generator.temperature, top_p=cfg.generator.top_p,
        max_completion_length=cfg.generator.max_context_tokens,
        max_grad_norm=cfg.learner.max_grad_norm or 0.0, weight_decay=cfg.learner.weight_decay,
        bf16=cfg.learner.autocast is not None, use_cpu=True, seed=args.seed,
        use_vllm=args.generation == "vllm-colocate", vllm_mode="colocate",
        vllm_max_model_length=cfg.generator.max_context_tokens,
        logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=model.train(), reward_funcs=exact_match, args=config, train_dataset=dataset,
        processing_class=tokenizer, rollout_func=rollout, callbacks=[Steps()],
    )  # fmt: skip
    if args.probe:
        failure = probe_colocated_vllm(trainer) if config.use_vllm else None
        print(json.dumps({"generation": args.generation, "works": failure is None,
                          "error": failure}), flush=True)  # fmt: skip
        return 0
    startup = time.perf_counter() - STARTED
    print(f"trl: started in {startup:.0f}s; {args.steps} steps of {args.questions} questions x "
          f"G={args.group_size}", flush=True)  # fmt: skip
    trainer.train()
    trainer.save_model(str(args.out / "final"))
    tokenizer.save_pretrained(str(args.out / "final"))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "steps.json").write_text(json.dumps(
        {"startup_s": startup, "steps": steps, "trl": trl.__version__,
         "generation": args.generation, "generation_autocast": args.generation_autocast},
        indent=2))  # fmt: skip
    print(f"wrote {args.out / 'steps.json'} and {args.out / 'final'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
