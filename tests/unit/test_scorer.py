"""InfoGainScorer against a direct, unbatched computation, and on a real model's beliefs."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from ray_credit.actors.scorer import InfoGainScorer  # noqa: E402
from ray_credit.batch import TrajectoryBatch  # noqa: E402
from ray_credit.estimators import get_estimator  # noqa: E402
from ray_credit.models import load_model  # noqa: E402


def token_batch(tokenizer, trajectories):
    """Rows from (gold, prompt text, [(turn text, observation text or None), ...])."""
    records = []
    for n, (gold, prompt, turns) in enumerate(trajectories):
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        token_turn, mask = [-1] * len(ids), [0] * len(ids)
        for k, (text, obs) in enumerate(turns):
            t = tokenizer(text, add_special_tokens=False)["input_ids"]
            ids, token_turn, mask = ids + t, token_turn + [k] * len(t), mask + [1] * len(t)
            if obs is not None:
                o = tokenizer(obs, add_special_tokens=False)["input_ids"]
                ids, token_turn, mask = ids + o, token_turn + [k] * len(o), mask + [0] * len(o)
        records.append(
            {
                "group_id": "g",
                "traj_id": f"t{n}",
                "question": prompt,
                "gold_answers": [gold],
                "turns": [
                    {"text": t, "action": "search" if o else "answer", "observation": o}
                    for t, o in turns
                ],
                "outcome_reward": 0.0,
                "input_ids": ids,
                "loss_mask": mask,
                "token_turn": token_turn,
                "behavior_logprobs": [0.0] * len(ids),
            }
        )
    return TrajectoryBatch.from_records(records)


def direct_mean_logprob(model, tokenizer, context, gold):
    scorer = InfoGainScorer((model, tokenizer))
    pseudo, lo, hi = scorer.gold_tokens(gold)
    ids = torch.tensor([list(context) + pseudo])
    with torch.inference_mode():
        logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    at = len(context)
    return float(np.mean([logp[at + j - 1, ids[0, at + j]] for j in range(lo, hi)]))


TRAJECTORIES = [
    (
        "Ada Quill",
        "Question: Who founded Velmora?\n",
        [
            (
                "<search> Velmora </search>",
                "<information>Velmora was founded by Ada Quill.</information>",
            ),
            ("<search> founder </search>", "<information>Nothing here.</information>"),
            ("<answer> Ada Quill </answer>", None),
        ],
    ),
    ("Tarsk", "Question: Where was Ada Quill born?\n", [("<answer> Tarsk </answer>", None)]),
    (
        "1873",
        "Question: When was Velmora founded?\n",
        [
            ("<search> Velmora year </search>", "<information>Founded in 1873.</information>"),
            ("<answer> 1873 </answer>", None),
        ],
    ),
]


@pytest.mark.parametrize("mode", ["prob_diff", "log_prob_diff"])
def test_matches_direct_computation(mode):
    model, tokenizer = load_model("tiny-random")
    batch = token_batch(tokenizer, TRAJECTORIES)
    scorer = InfoGainScorer((model, tokenizer), mode=mode, max_batch_tokens=64)  # many chunks
    out = scorer.score(batch)
    gains = out.table.column("turn_info_gain").to_pylist()
    for row, (gold, _, turns), got in zip(batch.to_records(), TRAJECTORIES, gains, strict=True):
        assert len(got) == len(turns) and got[-1] is None  # the final turn has no gain
        ids, token_turn = row["input_ids"], np.array(row["token_turn"])
        m = [
            direct_mean_logprob(model, tokenizer, ids[: int(np.searchsorted(token_turn, k))], gold)
            for k in range(len(turns))
        ]
        for k in range(len(turns) - 1):
            want = math.exp(m[k + 1]) - math.exp(m[k]) if mode == "prob_diff" else m[k + 1] - m[k]
            assert got[k] == pytest.approx(want, abs=1e-5)
    assert out.metrics["scorer/forward_rows"] == 6 and out.metrics["scorer/nonfinite"] == 0
    for name in ("igpo", "a2tgpo"):  # the estimators take the scored batch as is
        get_estimator(name)(out)


def test_a_repeated_context_is_computed_once():
    """Copies of a trajectory (a group's shared prompt, identical first turns) reuse the
    first copy's rows: the same gains, fewer forward rows, the reuse counted."""
    model, tokenizer = load_model("tiny-random")
    scorer = InfoGainScorer((model, tokenizer), max_batch_tokens=64)
    alone = scorer.score(token_batch(tokenizer, TRAJECTORIES))
    twice = scorer.score(token_batch(tokenizer, TRAJECTORIES + TRAJECTORIES[:1]))
    gains = twice.table.column("turn_info_gain").to_pylist()
    assert gains[3] == gains[0] == alone.table.column("turn_info_gain").to_pylist()[0]
    assert twice.metrics["scorer/forward_rows"] == 6 and twice.metrics["scorer/rows_reused"] == 3
    assert alone.metrics["scorer/rows_reused"] == 0


def test_autocast_reads_the_same_beliefs_in_bf16():
    model, tokenizer = load_model("tiny-random")
    batch = token_batch(tokenizer, TRAJECTORIES)
    full = InfoGainScorer((model, tokenizer), mode="log_prob_diff").score(batch)
    half = InfoGainScorer((model, tokenizer), mode="log_prob_diff", autocast="bfloat16")
    for a, b in zip(
        full.table.column("turn_info_gain").to_pylist(),
        half.score(batch).table.column("turn_info_gain").to_pylist(),
        strict=True,
    ):
        assert b[-1] is None and b[:-1] == pytest.approx(a[:-1], abs=0.05)
    with pytest.raises(ValueError, match="autocast must be None, 'auto', 'bfloat16' or 'float16'"):
        InfoGainScorer((model, tokenizer), autocast="bf16")


def test_a_scorer_behind_the_batchs_weights_refuses_it():
    """A restarted scorer is back on the base model: a batch sampled with newer weights
    is refused (naming the versions) until the current weights reach it."""
    from ray_credit.actors.scorer import WeightsBehind

    model, tokenizer = load_model("tiny-random")
    records = token_batch(tokenizer, TRAJECTORIES).to_records()
    for row in records:
        row["turns"] = [{**turn, "policy_version": 2} for turn in row["turns"]]
    batch = TrajectoryBatch.from_records(records)
    scorer = InfoGainScorer((model, tokenizer))
    with pytest.raises(WeightsBehind, match="holds weights version 0 but the batch was sampled "
                       "with version 2"):  # fmt: skip
        scorer.score(batch)
    scorer.update_weights(2, model.state_dict())
    scored = scorer.score(batch)
    assert "turn_info_gain" in scored
    assert scored.metrics["scorer/turns_on_newer_weights"] == 0  # the weights that acted


def test_turns_scored_by_a_newer_policy_than_sampled_them_are_counted():
    """IG is the acting policy's belief change: a turn scored with newer weights than
    sampled it is a departure, counted per turn (a pipeline makes none)."""
    model, tokenizer = load_model("tiny-random")
    records = token_batch(tokenizer, TRAJECTORIES).to_records()
    for n, row in enumerate(records):  # the first sampled with version 1, the others 0
        row["turns"] = [{**turn, "policy_version": int(n == 0)} for turn in row["turns"]]
    batch = TrajectoryBatch.from_records(records)
    scorer = InfoGainScorer((model, tokenizer))
    scorer.update_weights(1, model.state_dict())
    older = sum(len(row["turns"]) for row in records[1:])
    assert older > 0
    assert scorer.score(batch).metrics["scorer/turns_on_newer_weights"] == older


def test_a_restart_is_counted_once():
    """A scorer Ray restarted says so with the first batch it scores, not with every
    batch of the rest of the run."""
    model, tokenizer = load_model("tiny-random")
    batch = token_batch(tokenizer, TRAJECTORIES)
    scorer = InfoGainScorer((model, tokenizer))
    assert scorer.score(batch).metrics["scorer/restarts"] == 0  # not a restarted actor
    scorer._restarted = True  # as Ray's context says of a reconstructed actor
    assert [scorer.score(batch).metrics["scorer/restarts"] for _ in range(3)] == [1, 0, 0]


def test_gold_span_covers_exactly_the_answer():
    _, tokenizer = load_model("tiny-random")
    scorer = InfoGainScorer(load_model("tiny-random"))
    pseudo, lo, hi = scorer.gold_tokens("Ada Quill")
    assert tokenizer.decode(pseudo[lo:hi]).strip() == "Ada Quill"
    assert "<answer>" in tokenizer.decode(pseudo[:lo])


def test_update_weights_is_versioned():
    scorer = InfoGainScorer("tiny-random")
    other, _ = load_model("tiny-random", seed=9)
    assert scorer.update_weights(1, other.state_dict()) == 1
    with pytest.raises(ValueError, match="not newer"):
        scorer.update_weights(1, other.state_dict())
    with pytest.raises(ValueError, match="mode must be one of"):
        InfoGainScorer("tiny-random", mode="ratio")


@pytest.mark.slow
@pytest.mark.e2e  # the real 135M policy on CPU (about 30 s): the second test command
def test_smollm2_gains_belief_from_a_document_with_the_answer():
    """The real policy believes the gold more after reading it: IG > 0 on that turn only."""
    model, tokenizer = load_model("smollm2-135m")
    batch = token_batch(
        tokenizer,
        [
            (
                "Ada Quill",
                "Question: Who founded the trading house Velmora?\n",
                [
                    (
                        "<search> weather in Tarsk </search>",
                        "<information>Tarsk is rainy in spring.</information>",
                    ),
                    (
                        "<search> Velmora founder </search>",
                        "<information>Velmora was founded in 1873 by Ada Quill.</information>",
                    ),
                    ("<answer> Ada Quill </answer>", None),
                ],
            )
        ],
    )
    out = InfoGainScorer((model, tokenizer), mode="log_prob_diff").score(batch)
    irrelevant, relevant, final = out.table.column("turn_info_gain").to_pylist()[0]
    assert relevant > 1.0 and relevant > abs(irrelevant) and final is None
