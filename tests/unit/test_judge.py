"""Unit tests for the JudgePool and the built-in judged signals (no Ray): evidence rules,
strict parsing, the LLM backends, nulls counted by cause."""

from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from ray_credit.actors.judge import NULL_CAUSES, JudgePool
from ray_credit.batch import TrajectoryBatch
from ray_credit.data.synthetic import make_world
from ray_credit.estimators import get_estimator
from ray_credit.signals import get_signal
from ray_credit.signals._base import parse_json_object
from ray_credit.signals.cw_grpo_judgement import CWGRPOJudgement

CW = "cw_grpo_judgement"
SP1 = "search_p1_evaluation"
PLAN = "reference_plan"


def parse(signal, reply, context=None):
    return get_signal(signal).parse(reply, context)


def traj(i, actions, *, reward=0.0, answer=None, docs=None, obs=None, support=("d1", "d2"), **kw):
    """One trajectory record: ``docs`` / ``obs`` per turn (None: no search result)."""
    n = len(actions)
    docs = docs or [None] * n
    obs = obs or [None] * n
    turns = [
        {"text": f"step {t}", "action": a, "query": f"query {t}", "observation": o}
        for t, (a, o) in enumerate(zip(actions, obs, strict=True))
    ]
    record = {
        "group_id": kw.pop("group", "g0"),
        "traj_id": f"t{i}",
        "question": "Where does the treaty keep its seal?",
        "gold_answers": ["Velmora Hall"],
        "turns": turns,
        "answer": answer,
        "outcome_reward": float(reward),
        "supporting_doc_ids": None if support is None else list(support),
        "turn_doc_ids": docs,
    }
    record.update(kw)
    return record


def batch_of(*records) -> TrajectoryBatch:
    return TrajectoryBatch.from_records(list(records))


def judged(batch, name):
    return [row[name] for row in batch.to_records()]


def null_count(batch, names):
    return sum(v is None for name in names for row in judged(batch, name) for v in np.ravel(row))


def assert_nulls_accounted(batch, names, turns=True):
    """Every null is counted under exactly one cause."""
    m = batch.metrics
    causes = sum(m.get(f"judge/{c}", 0.0) for c in NULL_CAUSES)
    nulls = sum(v is None for row in judged(batch, names[0]) for v in (row if turns else [row]))
    assert nulls == causes
    for name in names[1:]:  # the fields of one judgement are null together
        assert [np.equal(r, None).tolist() for r in judged(batch, name)] == [
            np.equal(r, None).tolist() for r in judged(batch, names[0])
        ]


SEARCH3 = ["search", "search", "search", "answer"]
OBS = ["the seal rests in Velmora Hall", "unrelated", "more unrelated", None]


# ----------------------------------------------------------------------------- evidence
def test_evidence_cw_grpo_per_turn_rules():
    batch = batch_of(
        # new d1 (and a distractor), repeat of d1, new d2, grounded correct answer
        traj(0, SEARCH3, reward=1, answer="Velmora Hall", docs=[["x", "d1"], ["d1"], ["d2"], None], obs=OBS),
        # chain complete after turn 1: turn 2 is redundant; the answer is right but ungrounded
        traj(1, SEARCH3, reward=1, answer="velmora hall!", docs=[["d1", "d2"], ["x"], ["d2"], None]),
        # invalid turn, then a wrong answer that is grounded in what was retrieved
        traj(2, ["invalid", "search", "answer"], reward=1, answer="unrelated", docs=[None, ["d1"], None],
             obs=[None, "unrelated", None]),
    )  # fmt: skip
    out = JudgePool().judge(CW, batch)
    assert judged(out, "judge_utility") == [[1, 0, 1, 1], [1, 0, 0, 1], [0, 1, 0]]
    assert judged(out, "judge_correct") == [[1, 1, 1, 1], [1, 0, 0, 0], [0, 1, 1]]
    assert out.table.schema.field("judge_utility").type.value_type.bit_width == 8
    assert out.metrics["judge/requests"] == 11
    assert_nulls_accounted(out, ["judge_utility", "judge_correct"])


def test_evidence_cw_grpo_skips_failed_and_rows_without_evidence():
    batch = batch_of(
        traj(0, SEARCH3, reward=1, answer="Velmora Hall", docs=[["d1"], ["d1"], ["d2"], None]),
        traj(1, ["search", "answer"], reward=0, answer="x", docs=[["d1"], None]),
        traj(2, ["search", "answer"], reward=1, answer="x", docs=[["d1"], None], support=None),
        traj(3, ["answer"], reward=1, answer="x", support=[]),
    )
    pool = JudgePool()
    out = pool.judge(CWGRPOJudgement(skip_failed=True), batch)
    assert judged(out, "judge_utility")[1:] == [[None, None], [None, None], [None]]
    assert out.metrics["judge/skipped"] == 2 and out.metrics["judge/no_evidence"] == 3
    assert_nulls_accounted(out, ["judge_utility", "judge_correct"])
    everything = pool.judge(CWGRPOJudgement(skip_failed=False), batch)
    assert judged(everything, "judge_utility")[1] == [1, 0]
    assert everything.metrics.get("judge/skipped", 0) == 0


def test_cw_grpo_estimator_reads_the_evidence_judgements():
    batch = batch_of(
        traj(0, SEARCH3, reward=1, answer="Velmora Hall", docs=[["d1"], ["x"], ["d2"], None], obs=OBS),
        traj(1, ["search", "answer"], reward=0, answer="x", docs=[["x"], None]),
    )  # fmt: skip
    out = get_estimator("cw_grpo")(JudgePool().judge(CW, batch))
    adv = judged(out, "turn_advantages")
    a = adv[0][-1]  # GRPO advantage of the success; alpha = inf: rounds with p = 1 share 3 a
    np.testing.assert_allclose(adv[0], [1.5 * a, 0, 1.5 * a, a], rtol=1e-5)
    np.testing.assert_allclose(adv[1], [-a, -a], rtol=1e-5)
    assert out.metrics["cw_grpo/null_judgement_trajs"] == 0  # the failed row's nulls are unread


@pytest.mark.parametrize(
    "actions, docs, answer, expected",
    [  # planner, effective steps, accuracy, reasoning
        (["search", "search", "answer"], [["d1"], ["d2"], None], "Velmora Hall", (1.2, 2, 1.0, 1.0)),
        (SEARCH3, [["d1"], ["x"], ["d2"], None], "the Velmora Hall annex", (1.0, 2, 0.5, 0.8)),
        (["search", "answer"], [["d2", "x"], None], "nowhere", (0.6, 1, 0.0, 0.5)),
        (["search", "answer"], [["x"], None], None, (0.2, 0, 0.0, 0.0)),
    ],
)  # fmt: skip
def test_evidence_search_p1_fields(actions, docs, answer, expected):
    reward = float(answer == "Velmora Hall")
    out = JudgePool().judge(
        SP1, batch_of(traj(0, actions, reward=reward, answer=answer, docs=docs))
    )
    row = out.to_records()[0]
    planner, effective, accuracy, reasoning = expected
    assert row["sp1_planner_score"] == pytest.approx(planner)
    assert row["sp1_plan_steps"] == row["sp1_ref_plan_steps"] == 2
    assert row["sp1_effective_steps_self"] == row["sp1_effective_steps_ref"] == effective
    assert row["sp1_outcome_accuracy"] == accuracy
    assert row["sp1_outcome_reasoning"] == pytest.approx(reasoning)


def test_search_p1_estimator_accepts_the_evidence_fields():
    batch = batch_of(
        traj(0, ["search", "search", "answer"], reward=1, answer="Velmora Hall", docs=[["d1"], ["d2"], None]),
        traj(1, ["search", "answer"], answer="nowhere", docs=[["d2"], None]),
        traj(2, ["search", "answer"], answer="nowhere", docs=[["d2"], None], support=None),
    )  # fmt: skip
    out = get_estimator("search_p1")(JudgePool().judge(SP1, batch))
    assert out.metrics["search_p1/evaluator_missing"] == out.metrics["judge/no_evidence"] == 1
    rewards = [row[0] for row in judged(out, "turn_rewards")]
    # row 0: R_path = 1.2 * 1 * 1, R_out = 1, r_f = 0.1; row 1: S_ref = 0.5, soft outcome 0.2 * 0.5
    np.testing.assert_allclose(
        rewards, [0.3 * 1.2 + 0.6 + 0.01, 0.3 * 0.5 + 0.6 * 0.1 + 0.01, 0.01], rtol=1e-5
    )


def test_evidence_reference_plans_from_the_synthetic_world():
    world = make_world(num_entities=40, num_questions=20)
    pool = JudgePool(corpus=world.corpus)
    questions = world.questions[:8] + [
        {"question": "x?", "golden_answers": ["y"], "supporting_doc_ids": None}
    ]
    plans = pool.judge(PLAN, questions)
    titles = {d["id"]: d["contents"].split("\n")[0] for d in world.corpus}
    assert [p["reference_plan"] for p in plans[:-1]] == [
        [titles[d] for d in q["supporting_doc_ids"]] for q in world.questions[:8]
    ]
    assert [len(p["reference_plan"]) for p in plans[:-1]] == [
        q["hops"] for q in world.questions[:8]
    ]
    assert plans[-1] is None


def test_bad_inputs_say_what_to_do():
    with pytest.raises(
        ValueError, match=r"unknown judge backend 'gpt'.*'evidence', 'hf', 'openai'"
    ):
        JudgePool("gpt")
    no_support = TrajectoryBatch.from_records(
        [{k: v for k, v in traj(0, ["answer"]).items() if k != "supporting_doc_ids"}]
    )
    with pytest.raises(ValueError, match=r"\['supporting_doc_ids'\].*backend='hf'"):
        JudgePool().judge(CW, no_support)
    with pytest.raises(ValueError, match="base_url"):
        JudgePool("openai", model="m")
    with pytest.raises(ValueError, match="model="):
        JudgePool("openai", base_url="http://localhost:1/v1")
    with pytest.raises(ValueError, match="pass the corpus"):
        JudgePool().judge(PLAN, [{"question": "q?", "supporting_doc_ids": ["1"]}])
    no_plan = TrajectoryBatch.from_records([traj(0, ["answer"])])
    with pytest.raises(ValueError, match=r"\['reference_plan'\].*reference plans first"):
        JudgePool(StaticBackend("{}")).judge(SP1, no_plan)
    with pytest.raises(TypeError, match="TrajectoryBatch or an ObjectRef"):
        JudgePool().judge(CW, [1, 2])
    with pytest.raises(ValueError, match="max_concurrency"):
        JudgePool(max_concurrency=0)
    with pytest.raises(ValueError, match="evidence judge runs in process"):
        JudgePool("evidence", num_actors=2)
    with pytest.raises(TypeError, match="judges JudgedSignal objects"):
        JudgePool().judge(get_signal("info_gain"), no_plan)
    with pytest.raises(ValueError, match="num_actors >= 1"):
        JudgePool(StaticBackend("{}")).stage(CW)
    with pytest.raises(KeyError, match="unknown signal 'nope'.*registered"):
        JudgePool().judge("nope", no_plan)


# ----------------------------------------------------------------------------- parsing
def test_json_replies_are_parsed_strictly():
    good = '{"retrieval_reward": 1, "thinking_reward": 0, "analysis": "ok"}'
    grades = {"judge_utility": 1, "judge_correct": 0}
    assert parse(CW, good) == grades
    assert parse(CW, f"  \n```json\n{good}\n```\n") == grades
    assert parse(CW, f"```\n{good}\n```") == grades
    for bad in [
        f"Sure! {good}",  # prose around the object
        f"```json\n{good}\n``` and more",
        '{"retrieval_reward": true, "thinking_reward": 0}',  # a bool is not a grade
        '{"retrieval_reward": 2, "thinking_reward": 0}',
        '{"retrieval_reward": 1}',
        "[1, 0]",
        "",
    ]:
        assert parse(CW, bad) is None, bad
    assert parse_json_object('{"a": 1}') == {"a": 1}
    sp1 = {
        "planner_score": 1.2, "model_plan_steps": 3, "effective_steps_self": 2, "effective_steps_ref": 2,
        "outcome_accuracy_score": 0.5, "outcome_reasoning_score": 0.8,
    }  # fmt: skip
    parsed = parse(SP1, json.dumps(sp1), 2)
    assert parsed["sp1_plan_steps"] == 3 and parsed["sp1_ref_plan_steps"] == 2
    for change in [
        {"planner_score": 0.9},
        {"outcome_reasoning_score": 0.7},
        {"model_plan_steps": -1},
        {"model_plan_steps": 2.5},
        {"effective_steps_self": 4},  # more than the plan it counts
        {"effective_steps_ref": 3},  # more than the reference's 2 steps
    ]:
        assert parse(SP1, json.dumps({**sp1, **change}), 2) is None, change
    assert parse(PLAN, '{"steps": ["a", " b "]}') == {"reference_plan": ["a", "b"]}
    assert parse(PLAN, '{"steps": []}') is None
    assert parse(PLAN, '{"steps": ["a", ""]}') is None
    assert parse_json_object(None) is None


def test_prompts_ship_with_their_signals():
    """Each judged signal renders its own prompt file (shipped in the package), asking for
    JSON, with literal braces surviving str.format."""
    from importlib import resources

    folder = resources.files("ray_credit.signals") / "prompts"
    assert sorted(p.name for p in folder.iterdir()) == sorted(f"{n}.txt" for n in (CW, SP1, PLAN))
    row = traj(0, SEARCH3, reward=1, answer="x", obs=OBS, reference_plan=["a", "b"])
    row["golden_answers"] = row["gold_answers"]
    for name, turn in ((CW, 2), (SP1, None), (PLAN, None)):
        request = get_signal(name).request(row, turn)
        assert "JSON" in request.prompt and "{" in request.prompt and request.schema


# ----------------------------------------------------------------------------- LLM backends
class StaticBackend:
    """A completion backend that answers every prompt with the same reply."""

    def __init__(self, reply):
        self.reply = reply
        self.prompts = []

    def complete(self, prompts, counts, schemas=None):
        self.prompts.extend(prompts)
        self.schemas = schemas
        return [self.reply] * len(prompts)


def test_llm_judge_renders_one_prompt_per_turn_with_the_trace_so_far():
    backend = StaticBackend('{"retrieval_reward": 1, "thinking_reward": 1}')
    batch = batch_of(traj(0, SEARCH3, reward=1, answer="Velmora Hall", obs=OBS))
    out = JudgePool(backend, batch_size=3).judge(CW, batch)
    assert judged(out, "judge_utility") == [[1, 1, 1, 1]]
    assert len(backend.prompts) == 4
    agent_blocks = [
        sum(line.startswith("Agent: ") for line in p.splitlines()) for p in backend.prompts
    ]
    assert agent_blocks == [1, 2, 3, 4]
    assert "Information: the seal rests in Velmora Hall" in backend.prompts[1]


def _server_reply(content):
    return {"choices": [{"message": {"role": "assistant", "content": content}}]}


@contextmanager
def fake_openai_server(script):
    """An OpenAI-compatible server on localhost. ``script(n, prompt)`` -> (status, body,
    delay_s) for the n-th request. Yields (base_url, state) with the requests seen and the
    peak number of concurrent requests."""
    state = {"n": 0, "active": 0, "peak": 0, "prompts": []}
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with lock:
                n = state["n"]
                state["n"] += 1
                state["active"] += 1
                state["peak"] = max(state["peak"], state["active"])
                state["prompts"].append(body["messages"][0]["content"])
            try:
                status, payload, delay = script(n, body["messages"][0]["content"])
                time.sleep(delay)
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client timed out and left
            finally:
                with lock:
                    state["active"] -= 1

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1", state
    finally:
        server.shutdown()
        server.server_close()


GOOD = '{"analysis": "fine", "retrieval_reward": 1, "thinking_reward": 0}'


def openai_pool(url, **kw):
    kw = {"timeout_s": 2.0, "max_retries": 2, "backoff_s": 0.01, **kw}
    return JudgePool("openai", base_url=url, model="judge", **kw)


def one_turn_batch(n=1):
    rows = [traj(i, ["answer"], reward=1, answer="x", question=f"question {i}?") for i in range(n)]
    return batch_of(*rows)


def test_openai_good_and_garbage_replies():
    replies = {0: GOOD, 1: "I think the answer is 1", 2: f"```json\n{GOOD}\n```"}

    def script(n, prompt):
        row = next(i for i in replies if f"question {i}?" in prompt)
        return 200, _server_reply(replies[row]), 0

    with fake_openai_server(script) as (url, state):
        out = openai_pool(url, batch_size=2).judge(CW, one_turn_batch(3))
    assert judged(out, "judge_utility") == [[1], [None], [1]]
    assert judged(out, "judge_correct") == [[0], [None], [0]]
    assert out.metrics["judge/unparseable"] == 1 and out.metrics["judge/requests"] == 3
    assert "judge/retries" not in out.metrics
    assert_nulls_accounted(out, ["judge_utility", "judge_correct"])


def test_openai_retries_5xx_and_429_then_succeeds():
    script = {0: (500, {"error": "busy"}, 0), 1: (429, {"error": "slow down"}, 0)}
    with fake_openai_server(lambda n, _: script.get(n, (200, _server_reply(GOOD), 0))) as (
        url,
        state,
    ):
        out = openai_pool(url).judge(CW, one_turn_batch())
    assert judged(out, "judge_utility") == [[1]]
    assert out.metrics["judge/retries"] == 2 and state["n"] == 3
    assert out.metrics["judge/latency_s"] > 0


def test_openai_gives_up_after_retries_and_does_not_retry_4xx():
    with fake_openai_server(lambda n, _: (503, {}, 0)) as (url, state):
        out = openai_pool(url, max_retries=2).judge(CW, one_turn_batch())
    assert judged(out, "judge_utility") == [[None]] and state["n"] == 3
    assert out.metrics["judge/failed"] == 1 and out.metrics["judge/retries"] == 2
    with fake_openai_server(lambda n, _: (400, {"error": "prompt too long"}, 0)) as (url, state):
        out = openai_pool(url).judge(CW, one_turn_batch())
    assert judged(out, "judge_utility") == [[None]] and state["n"] == 1
    assert out.metrics["judge/failed"] == 1
    not_found = fake_openai_server(lambda n, _: (404, {"error": "no such model"}, 0))
    with not_found as (url, _), pytest.raises(RuntimeError, match="404.*base_url or the model"):
        openai_pool(url).judge(CW, one_turn_batch())


def test_openai_timeout_is_null_and_counted():
    with fake_openai_server(lambda n, _: (200, _server_reply(GOOD), 1.0 if n == 0 else 0)) as (
        url,
        _,
    ):
        pool = openai_pool(url, timeout_s=0.3, max_retries=0)
        out = pool.judge(CW, one_turn_batch(2))
    assert judged(out, "judge_utility") == [[None], [1]]
    assert out.metrics["judge/timeouts"] == 1 and "judge/failed" not in out.metrics
    assert_nulls_accounted(out, ["judge_utility", "judge_correct"])


def test_openai_search_p1_and_reference_plans():
    sp1 = {
        "planner_score": 1.0, "model_plan_steps": 2, "effective_steps_self": 1, "effective_steps_ref": 1,
        "outcome_accuracy_score": 0.5, "outcome_reasoning_score": 0.5,
    }  # fmt: skip
    bad = {**sp1, "effective_steps_ref": 3}  # more than the 2-step reference

    def script(n, prompt):
        if "shortest search plan" in prompt:
            return 200, _server_reply('{"steps": ["who founded it", "where was she born"]}'), 0
        return 200, _server_reply(json.dumps(bad if "ROW1" in prompt else sp1)), 0

    with fake_openai_server(script) as (url, state):
        pool = openai_pool(url)
        plans = pool.judge(PLAN, [{"question": "q?", "golden_answers": ["Velmora Hall"]}])
        plans = [p["reference_plan"] for p in plans]
        assert plans == [["who founded it", "where was she born"]]
        assert "Velmora Hall" in state["prompts"][0]
        batch = batch_of(
            traj(0, ["search", "answer"], answer="x", reference_plan=plans[0]),
            traj(1, ["search", "answer"], answer="x", reference_plan=plans[0], question="ROW1?"),
            traj(2, ["search", "answer"], answer="x", reference_plan=None),
        )
        out = pool.judge(SP1, batch)
    rows = out.to_records()
    assert rows[0]["sp1_ref_plan_steps"] == 2 and rows[0]["sp1_outcome_reasoning"] == 0.5
    assert rows[1]["sp1_planner_score"] is None and rows[2]["sp1_planner_score"] is None
    assert out.metrics["judge/unparseable"] == 1 and out.metrics["judge/no_evidence"] == 1
    assert "1. who founded it" in state["prompts"][1]
    assert get_estimator("search_p1")(out).metrics["search_p1/evaluator_missing"] == 2


def test_hf_tiny_random_garbage_is_null_and_counted():
    """Unguided, a random model's replies are garbage: null and counted, never 0."""
    pool = JudgePool("hf", model="tiny-random", max_new_tokens=6, batch_size=3, guided=False)
    batch = batch_of(
        traj(0, SEARCH3, reward=1, answer="Velmora Hall", obs=OBS), traj(1, ["answer"], reward=1)
    )
    out = pool.judge(CW, batch)
    assert judged(out, "judge_utility") == [[None] * 4, [None]]
    assert out.metrics["judge/unparseable"] == out.metrics["judge/requests"] == 5
    assert out.metrics["judge/latency_s"] > 0
    assert pool.judge(PLAN, [{"question": "q?", "golden_answers": ["a"]}]) == [None]
    assert get_estimator("cw_grpo")(out).metrics["cw_grpo/null_judgement_trajs"] == 1


def test_hf_guided_replies_parse_even_from_a_random_model():
    """Guided (the hf default), a tiny random judge's replies are in form: every turn is
    judged, every reference plan parses, every Search-P1 field is set."""
    pool = JudgePool("hf", model="tiny-random", batch_size=3)
    batch = batch_of(
        traj(0, SEARCH3, reward=1, answer="Velmora Hall", obs=OBS, reference_plan=["a", "b"]),
        traj(1, ["answer"], reward=1, answer="x", reference_plan=["a"]),
    )
    out = pool.judge(CW, batch)
    assert all(v in (0, 1) for row in judged(out, "judge_utility") for v in row)
    assert out.metrics.get("judge/unparseable", 0) == 0 and out.metrics["judge/requests"] == 5
    (plan,) = pool.judge(PLAN, [{"question": "q?", "golden_answers": ["a"]}])
    assert plan["reference_plan"] and all(s.strip() for s in plan["reference_plan"])
    sp1 = pool.judge(SP1, batch)
    assert None not in judged(sp1, "sp1_planner_score")
    for row in sp1.to_records():
        assert row["sp1_effective_steps_ref"] <= row["sp1_ref_plan_steps"]
        assert row["sp1_effective_steps_self"] <= row["sp1_plan_steps"]
