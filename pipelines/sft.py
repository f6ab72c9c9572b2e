"""Supervised fine-tuning of a policy on a demonstrations file, as a Ray Train job: N
workers (DDP, or FSDP2 sharding), a checkpoint after every epoch in the storage path, a
worker's death restarting the group from the newest one, and a job started again with
the same --name and --storage_path resuming there.

    python pipelines/sft.py --data demos.jsonl --out runs/sft-policy
    python pipelines/sft.py --model Qwen/Qwen2.5-3B-Instruct --data demos.jsonl \\
        --out /shared/sft-3b --fit.workers 8 --fit.strategy fsdp --fit.use_gpu true \\
        --fit.autocast bfloat16 --storage_path s3://bucket/sft
    ray job submit --working-dir . -- python pipelines/sft.py --data /shared/demos.jsonl ...

The file is JSON lines (.jsonl, or .jsonl.gz), one JSON array of rows (.json) or
.parquet. Each row is one of:

  a chat, {"messages": [{"role": "user", "content": ...}, {"role": "assistant",
    "content": ...}, ...]} (roles system, user, assistant, tool; an assistant message
    may carry tool_calls), or ShareGPT's {"conversations": [{"from": "human", "value":
    ...}, {"from": "gpt", "value": ...}]} (roles human, gpt, system): rendered by the
    model's chat template, every assistant message taught (all the replies of a
    multi-turn chat, as TRL's SFTTrainer with assistant_only_loss), from after its header
    to its end-of-turn token;
  TRL's conversational prompt/completion, {"prompt": [messages], "completion":
    [messages]}: the completion's assistant messages taught, the prompt context (a chat
    whose earlier replies should not be taught is written so);
  TRL's standard prompt/completion, {"prompt": "...", "completion": "..."}: the
    completion and an end-of-sequence token taught.

A row with nothing to teach (no assistant message; a null, empty or whitespace-only
reply), a content that is not text or holds a special token as text (<|im_end|>), an
unknown role, a per-message weight or train flag that says otherwise than the rule above,
a key given twice, an unknown shape or two shapes in one row is refused with its file and
line; so are a file that is one JSON object (its rows under a key) and demonstrations
over --max_tokens, all of them counted (none is cut). Nothing is skipped but blank lines. The loss is the token
mean of the taught tokens' cross-entropy; AdamW with linear decay. The fitted policy is a
model folder (--out) that any pipeline takes as --model.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace

from ray_credit.config import InputError, check_fields
from ray_credit.log import LogLevel, log, setup_logging
from ray_credit.sft import FitConfig, fine_tune, tokenize_demonstrations


@dataclass(frozen=True)
class SFTRun:
    """One fine-tuning job."""

    model: str = "smollm2-135m"
    """The policy to fine-tune: an embedded name, an HF id or a folder."""
    data: str = ""
    """The demonstrations file (.jsonl, .json or .parquet; see above)."""
    out: str = "runs/sft/policy"
    """Where the fitted policy is saved (a model folder)."""
    name: str = "sft"
    """The job's name: its checkpoints are storage_path/name; the same name resumes."""
    storage_path: str | None = None
    """Where the checkpoints go: a path every node sees or a URI (s3://...). None: the
    folder of --out."""
    max_tokens: int = 4096
    """The longest demonstration taken (longer ones are refused, counted, the first named by
    its line)."""
    fit: FitConfig = field(default_factory=FitConfig)
    """How it trains and on what workers."""
    log_level: LogLevel = "info"

    def __post_init__(self) -> None:
        check_fields(self)
        if self.max_tokens < 2:
            raise ValueError(f"max_tokens must be >= 2, got {self.max_tokens}")


def main(argv=None) -> dict:
    from ray_credit.config import parse_config
    from ray_credit.models import load_tokenizer
    from ray_credit.pipeline.configs import ResourcesConfig
    from ray_credit.pipeline.preflight import check_model
    from ray_credit.pipeline.services import connect

    cfg = parse_config(SFTRun, argv, description=__doc__)
    setup_logging(cfg.log_level)
    out = Path(cfg.out).resolve()
    try:  # everything handed to us is checked before Ray starts
        if not cfg.data or not Path(cfg.data).is_file():
            raise InputError(
                f"--data {cfg.data!r}: no such file; give a demonstrations file (.jsonl, .json "
                "or .parquet)"
            )
        check_model("--model", cfg.model)
        if out.exists() and any(out.iterdir()):
            raise InputError(f"--out {out} is not empty; give a new folder")
        tokenizer = load_tokenizer(cfg.model)
        rows = tokenize_demonstrations(cfg.data, tokenizer, max_tokens=cfg.max_tokens)
    except InputError as err:
        raise SystemExit(f"sft.py: error: {err}") from None
    storage = cfg.storage_path or str(out.parent)
    taught = sum(sum(r["loss_mask"]) for r in rows)
    log.info(f"sft: {len(rows)} demonstrations, {taught} taught tokens; {cfg.fit.workers} "
             f"worker(s), {cfg.fit.strategy}; checkpoints in {storage}/{cfg.name}")  # fmt: skip
    workers_cpus = int(cfg.fit.workers * cfg.fit.cpus_per_worker) + 1
    connect(SimpleNamespace(log_level=cfg.log_level,
                            resources=ResourcesConfig(local_cpus=max(6, workers_cpus))))  # fmt: skip
    result = fine_tune(cfg.model, rows, cfg.fit, pad_token_id=int(tokenizer.pad_token_id),
                       storage_path=storage, name=cfg.name, out=out)  # fmt: skip
    tokenizer.save_pretrained(out)
    summary = {"demonstrations": len(rows), "taught_tokens": taught, **result,
               "config": asdict(cfg)}  # fmt: skip
    (out / "sft.json").write_text(json.dumps(summary, indent=2))
    losses = " -> ".join(f"{x:.3f}" for x in result["loss_per_epoch"])
    log.info(f"sft: loss {losses} over {cfg.fit.epochs} epoch(s)"
             + (f" (resumed after epoch {result['resumed_epoch']})" if result["resumed_epoch"] else "")
             + f", {result['seconds']:.0f}s; saved {out}")  # fmt: skip
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
