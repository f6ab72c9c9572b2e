"""The generator's multi-turn loop (scripted turns) and its token alignment (a real tiny model)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from ray_credit.actors.generator import Generator, GeneratorConfig  # noqa: E402
from ray_credit.actors.sampling import SampledTurn, SamplingParams, TransformersSampler  # noqa: E402
from ray_credit.models import load_model  # noqa: E402
from ray_credit.protocol import INVALID_ACTION_FEEDBACK  # noqa: E402
from ray_credit.testing import max_logprob_gap  # noqa: E402

DOCS = [
    {"id": "d-velmora", "contents": "Velmora\nVelmora was founded by Ada Quill in 1873."},
    {"id": "d-quill", "contents": "Ada Quill\nAda Quill was born in Tarsk."},
    {"id": "d-tarsk", "contents": "Tarsk\nTarsk is a port city on the Orle river."},
]
QUESTIONS = [
    {"id": "q1", "question": "Who founded Velmora?", "golden_answers": ["Ada Quill"]},
    {"id": "q2", "question": "Where was Ada Quill born", "golden_answers": ["Tarsk"]},
]


class WordRetriever:
    """Ranks the three documents by shared words with the query (deterministic)."""

    def __init__(self):
        self.calls: list[list[str]] = []

    def search(self, queries, topk):
        self.calls.append(list(queries))
        out = []
        for q in queries:
            words = set(q.lower().split())
            scored = sorted(
                DOCS,
                key=lambda d: -len(words & set(d["contents"].lower().replace("\n", " ").split())),
            )
            out.append([{**d, "score": 1.0} for d in scored[:topk]])
        return out


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-random")


class ScriptedSampler(TransformersSampler):
    """Plays a script of turn texts, one list per call of ``sample`` (a row per context).

    The ids are the real tokenizer's; the log-probs are a recognisable constant, so the
    test can see where the generator put them. ``"<LIMIT>"`` marks a turn cut at the limit.
    """

    def __init__(self, model, tokenizer, script):
        super().__init__(model, tokenizer)
        self.script = list(script)
        self.contexts: list[list[list[int]]] = []

    def sample(self, contexts, params: SamplingParams, *, seed: int):
        self.contexts.append([list(c) for c in contexts])
        texts = self.script.pop(0)
        assert len(texts) == len(contexts), (texts, len(contexts))
        out = []
        for text in texts:
            hit = text.endswith("<LIMIT>")
            ids = self.tokenizer(text.removesuffix("<LIMIT>"), add_special_tokens=False)[
                "input_ids"
            ]
            out.append(SampledTurn(ids, [-0.5] * len(ids), hit))
        return out


def scripted_generator(tiny, script, **config):
    gen = Generator(tiny, WordRetriever(), GeneratorConfig(**{"group_size": 1, **config}))
    gen.sampler = ScriptedSampler(*tiny, script)
    return gen


def test_search_then_answer_layout(tiny):
    tokenizer = tiny[1]
    gen = scripted_generator(
        tiny,
        [
            [
                "<think>look it up</think><search> Velmora founded </search>",
                "<answer> Tarsk </answer>",
            ],
            ["<answer> Ada Quill </answer>"],
        ],
        topk=2,
    )
    batch = gen.generate(QUESTIONS)
    a, b = batch.to_records()
    assert [t["action"] for t in a["turns"]] == ["search", "answer"]
    assert a["turns"][0]["query"] == "Velmora founded"
    assert a["turn_doc_ids"] == [["d-velmora", "d-quill"], None]
    assert "<information>" in a["turns"][0]["observation"]
    assert "Ada Quill" in a["turns"][0]["observation"]
    assert a["turn_contains_gold"] == [True, False]
    assert a["answer"] == "Ada Quill" and a["outcome_reward"] == 1.0
    assert [t["action"] for t in b["turns"]] == ["answer"] and b["outcome_reward"] == 1.0
    assert gen._search.retriever.calls == [["Velmora founded"]]  # one call for the whole turn

    # Token layout of trajectory a: prompt | turn-0 sample | observation | turn-1 sample.
    ids, mask = np.array(a["input_ids"]), np.array(a["loss_mask"])
    turn, logp = np.array(a["token_turn"]), np.array(a["behavior_logprobs"])
    prompt = gen.sampler.contexts[0][0]
    assert ids[: len(prompt)].tolist() == prompt
    assert (turn[: len(prompt)] == -1).all() and (mask[: len(prompt)] == 0).all()
    second_context = gen.sampler.contexts[1][0]  # what the model saw before turn 1
    assert ids[: len(second_context)].tolist() == second_context
    sampled0 = tokenizer(
        "<think>look it up</think><search> Velmora founded </search>", add_special_tokens=False
    )["input_ids"]
    s0 = slice(len(prompt), len(prompt) + len(sampled0))
    assert ids[s0].tolist() == sampled0 and (mask[s0] == 1).all() and (turn[s0] == 0).all()
    obs = slice(s0.stop, len(second_context))
    assert (mask[obs] == 0).all() and (turn[obs] == 0).all() and (logp[obs] == 0).all()
    assert tokenizer.decode(ids[obs].tolist()) == a["turns"][0]["observation"]
    s1 = slice(len(second_context), len(ids))
    assert (mask[s1] == 1).all() and (turn[s1] == 1).all()
    np.testing.assert_array_equal(logp[mask == 1], -0.5)
    assert batch.metrics["gen/searches"] == 1 and batch.metrics["gen/answered"] == 2


def test_invalid_and_truncated_turns_get_feedback_and_are_counted(tiny):
    gen = scripted_generator(
        tiny,
        [
            ["I am not sure what to do", "<search> Ada Quill birthplace<LIMIT>"],
            ["<answer> Ada Quill </answer>", "<answer> Tarsk </answer>"],
        ],
    )
    batch = gen.generate(QUESTIONS)
    a, b = batch.to_records()
    assert [t["action"] for t in a["turns"]] == ["invalid", "answer"]
    assert [t["action"] for t in b["turns"]] == ["truncated", "answer"]
    for row in (a, b):
        assert INVALID_ACTION_FEEDBACK in row["turns"][0]["observation"]
        assert row["turn_doc_ids"][0] is None
    m = batch.metrics
    assert m["gen/invalid_actions"] == 1 and m["gen/truncated_turns"] == 1
    assert m["gen/searches"] == 0


def test_turn_limit_ends_without_answer(tiny):
    gen = scripted_generator(
        tiny,
        [["<search> Velmora </search>"], ["<search> Ada Quill </search>"]],
        max_turns=2,
    )
    batch = gen.generate(QUESTIONS[:1])
    (row,) = batch.to_records()
    assert [t["action"] for t in row["turns"]] == ["search", "search"]
    assert row["turns"][1]["observation"] is None  # no search is run on the last turn
    assert row["answer"] is None and row["outcome_reward"] == 0.0
    assert batch.metrics["gen/turn_limit_hits"] == 1 and batch.metrics["gen/searches"] == 1


def test_observation_cap_and_context_limit_are_counted(tiny):
    gen = scripted_generator(
        tiny,
        [["<search> Velmora </search>"], ["<answer> Ada Quill </answer>"]],
        max_observation_tokens=5,
    )
    batch = gen.generate(QUESTIONS[:1])
    (row,) = batch.to_records()
    observed = np.array(row["loss_mask"]) == 0
    assert int(observed.sum()) - len(gen.sampler.contexts[0][0]) == 5
    assert batch.metrics["gen/truncated_observations"] == 1

    prompt_len = len(gen.sampler.contexts[0][0])
    small = scripted_generator(
        tiny,
        [["<search> Velmora </search>"]],
        max_context_tokens=prompt_len + 20,
        max_new_tokens=16,
    )
    batch = small.generate(QUESTIONS[:1])
    (row,) = batch.to_records()
    assert len(row["input_ids"]) <= prompt_len + 20
    assert batch.metrics["gen/context_limit_hits"] == 1
    assert row["answer"] is None


def test_tool_call_style(tiny):
    call = '<tool_call>{"name": "search", "arguments": {"query_list": ["Velmora", "Tarsk"]}}</tool_call>'
    gen = scripted_generator(
        tiny,
        [[call], ["<answer> Ada Quill </answer>"]],
        action_style="tool_call",
        prompt_template="search_tool_call",
        topk=1,
    )
    batch = gen.generate(QUESTIONS[:1])
    (row,) = batch.to_records()
    assert row["turns"][0]["query"] == "Velmora"
    assert row["turn_doc_ids"][0] == ["d-velmora", "d-tarsk"]  # one hit per query
    assert row["turns"][0]["observation"].startswith("\n\n<tool_response>")
    assert gen._search.retriever.calls == [["Velmora", "Tarsk"]]


def test_response_prefix_is_prompt_and_parsed_with_turn_zero(tiny):
    gen = scripted_generator(
        tiny,
        [[" Velmora founder </search>"], ["<answer> Ada Quill </answer>"]],
        response_prefix="<search>",
    )
    batch = gen.generate(QUESTIONS[:1])
    (row,) = batch.to_records()
    assert row["turns"][0]["action"] == "search"
    assert row["turns"][0]["query"] == "Velmora founder"
    assert row["turns"][0]["text"] == " Velmora founder </search>"
    prompt = gen.sampler.contexts[0][0]
    assert tiny[1].decode(prompt).endswith("<search>")


def test_final_turn_prefix_is_fed_masked_and_parsed_with_the_last_turn(tiny):
    gen = scripted_generator(
        tiny,
        [["<search> Velmora founder </search>"], [" Ada Quill </answer>"]],
        max_turns=2,
        final_turn_prefix="<answer>",
    )
    batch = gen.generate(QUESTIONS[:1])
    (row,) = batch.to_records()
    assert [t["action"] for t in row["turns"]] == ["search", "answer"]
    assert row["answer"] == "Ada Quill" and row["outcome_reward"] == 1.0
    assert row["turns"][1]["text"] == " Ada Quill </answer>"
    # the last context ends with the observation and then the prefix, fed, not sampled
    last = gen.sampler.contexts[1][0]
    assert tiny[1].decode(last).endswith("</information>\n\n<answer>")
    prefix = len(tiny[1]("<answer>", add_special_tokens=False)["input_ids"])
    fed = slice(len(last) - prefix, len(last))
    assert row["loss_mask"][fed] == [0] * prefix
    assert row["token_turn"][fed] == [0] * prefix  # environment tokens after turn 0
    assert row["loss_mask"][len(last) :] == [1] * (len(row["input_ids"]) - len(last))


def test_final_turn_prefix_only_on_the_last_allowed_turn(tiny):
    gen = scripted_generator(
        tiny,
        [["<search> Velmora founder </search>"], ["<answer> Ada Quill </answer>"]],
        max_turns=3,
        final_turn_prefix="<answer>",
    )
    (row,) = gen.generate(QUESTIONS[:1]).to_records()
    assert row["answer"] == "Ada Quill"  # answered on turn 1: the prefix was never fed
    assert "<answer><answer>" not in tiny[1].decode(row["input_ids"])
    assert not tiny[1].decode(gen.sampler.contexts[1][0]).endswith("<answer>")


def test_real_tiny_model_logprobs_match_teacher_forcing(tiny):
    model, _ = tiny
    gen = Generator(
        tiny,
        WordRetriever(),
        GeneratorConfig(
            group_size=3,
            max_turns=2,
            max_new_tokens=12,
            temperature=1.0,
            seed=3,
            max_batch_size=4,  # two micro-batches for six rows
        ),
    )
    batch = gen.generate(QUESTIONS)
    assert len(batch) == 6 and batch.num_groups == 2
    for row in batch.to_records():
        turns = np.array(row["token_turn"])
        assert turns.max() == len(row["turns"]) - 1
    worst = max_logprob_gap(model, batch)
    assert worst < 1e-4, worst
    assert batch.metrics["gen/generated_tokens"] == sum(
        int(np.sum(r["loss_mask"])) for r in batch.to_records()
    )


def test_same_seed_same_rollouts(tiny):
    config = GeneratorConfig(group_size=2, max_turns=2, max_new_tokens=8, seed=11)
    first = Generator(tiny, WordRetriever(), config, name="g").generate(QUESTIONS)
    again = Generator(tiny, WordRetriever(), config, name="g").generate(QUESTIONS)
    assert first.table.column("input_ids").equals(again.table.column("input_ids"))
    other = Generator(
        tiny, WordRetriever(), GeneratorConfig(**{**config.__dict__, "seed": 12}), name="g"
    )
    assert (
        not other.generate(QUESTIONS)
        .table.column("input_ids")
        .equals(first.table.column("input_ids"))
    )


def test_one_generator_rolls_out_greedy_then_sampled_as_fresh_ones_would(tiny):
    """A call's temperature, group size and seed override the config's: an evaluation's
    greedy and sampled rollouts come from one generator, each as a fresh generator made
    with those settings rolls them out."""
    greedy = GeneratorConfig(group_size=1, max_turns=2, max_new_tokens=8, temperature=0.0)
    sampled = GeneratorConfig(**{**greedy.__dict__, "temperature": 0.9, "group_size": 3})
    one = Generator(tiny, WordRetriever(), greedy, name="g")
    first = one.generate(QUESTIONS)
    second = one.generate(QUESTIONS, group_size=3, temperature=0.9, seed=sampled.seed)
    fresh_greedy = Generator(tiny, WordRetriever(), greedy, name="g").generate(QUESTIONS)
    fresh_sampled = Generator(tiny, WordRetriever(), sampled, name="g").generate(QUESTIONS)
    assert first.table.column("input_ids").equals(fresh_greedy.table.column("input_ids"))
    assert second.table.column("input_ids").equals(fresh_sampled.table.column("input_ids"))
    assert len(second) == 3 * len(QUESTIONS)
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
        one.generate(QUESTIONS, temperature=-1.0)


def test_an_evaluation_first_leaves_the_training_calls_sampling_as_it_was(tiny):
    """A run that evaluates on its training generator before training (greedy, with the
    evaluation's own seed) samples its training calls as a run that read that evaluation
    from a cache: only calls without a seed of their own move the generator's seeds."""
    config = GeneratorConfig(group_size=2, max_turns=2, max_new_tokens=8, seed=11)
    cached = Generator(tiny, WordRetriever(), config, name="g")
    evaluated = Generator(tiny, WordRetriever(), config, name="g")
    evaluated.generate(QUESTIONS, group_size=1, temperature=0.0, seed=config.seed)
    for _ in range(2):  # the first two training calls, seeds 11 and 12 in both
        ids = evaluated.generate(QUESTIONS).table.column("input_ids")
        assert ids.equals(cached.generate(QUESTIONS).table.column("input_ids"))


def test_update_weights_is_versioned_and_changes_the_policy(tiny):
    model, tokenizer = load_model("tiny-random")  # its own copy: the test changes it
    gen = Generator(
        (model, tokenizer),
        WordRetriever(),
        GeneratorConfig(group_size=1, max_turns=1, max_new_tokens=4, temperature=0),
    )
    before = gen.generate(QUESTIONS[:1]).to_records()[0]
    other, _ = load_model("tiny-random", seed=5)
    assert gen.update_weights(1, other.state_dict()) == 1
    after = gen.generate(QUESTIONS[:1]).to_records()[0]
    assert after["behavior_logprobs"] != before["behavior_logprobs"]
    assert [t["policy_version"] for t in after["turns"]] == [1]
    with pytest.raises(ValueError, match="not newer"):
        gen.update_weights(1, other.state_dict())
    with pytest.raises(ValueError, match="do not match the model"):
        gen.update_weights(2, {"model.embed_tokens.weight": torch.zeros(3, 3)})


def test_bad_inputs_have_clear_errors(tiny):
    with pytest.raises(ValueError, match="needs a retriever"):
        Generator(tiny, None)
    gen = Generator(tiny, WordRetriever(), GeneratorConfig(group_size=1, max_new_tokens=2))
    with pytest.raises(ValueError, match="no 'golden_answers'"):
        gen.generate([{"question": "Who?"}])
    with pytest.raises(ValueError, match="normalizes to an empty string"):
        gen.generate([{"question": "Who?", "golden_answers": ["The"]}])
    with pytest.raises(ValueError, match="no questions"):
        gen.generate([])
    with pytest.raises(ValueError, match="max_context_tokens"):
        GeneratorConfig(max_context_tokens=100, max_new_tokens=100)
    with pytest.raises(ValueError, match="action_style"):
        GeneratorConfig(action_style="xml")
    with pytest.raises(TypeError, match="search\\(queries, topk\\)"):
        Generator(tiny, object())


def test_a_named_actor_travels_by_name_and_its_handle_stays():
    """What generators get of the pipeline's retriever actor: its name (a handle among a
    restartable actor's arguments makes Ray log an error on every start, ray#53727)."""
    import pickle

    from ray_credit.actors.generator import NamedActor

    held = object()
    local = NamedActor("retriever-abc", held)
    assert local.resolve() is held  # the creator's copy keeps the actor alive
    sent = pickle.loads(pickle.dumps(local))
    assert sent.name == "retriever-abc" and sent.handle is None
    assert repr(sent) == "NamedActor('retriever-abc')"


def test_a_question_s_own_prompt_is_the_prompt_used_as_given(tiny):
    """A question file's ``prompt`` (Search-R1's chat messages) replaces the template; the
    system prompt goes first only where the messages bring none."""
    tokenizer = tiny[1]
    own = [{"role": "user", "content": "Answer the given question. Question: who? \n"}]
    question = {**QUESTIONS[1], "prompt": own}
    gen = scripted_generator(tiny, [["<answer> Ada Quill </answer>"]], system_prompt="Be brief.")
    gen.generate([question])
    expected = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, *own],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert gen.sampler.contexts[0][0] == tokenizer(expected, add_special_tokens=False)["input_ids"]
    with_system = [{"role": "system", "content": "Search first."}, *own]
    assert (
        gen.prompt_ids("who?", with_system)
        == tokenizer(
            tokenizer.apply_chat_template(with_system, add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )["input_ids"]
    )
    template = gen.prompt_ids(QUESTIONS[1]["question"])  # no messages: the template's
    assert "Question:" in tokenizer.decode(template) and template != gen.sampler.contexts[0][0]


@pytest.mark.parametrize(("native", "chosen"), [(True, torch.bfloat16), (False, torch.float32)])
def test_native_dtype_is_bfloat16_where_the_device_computes_it(monkeypatch, native, chosen):
    """generator.dtype 'native' (the embedded run's): bfloat16 on a CPU with bfloat16
    instructions, float32 on one that would emulate them; said once, the log-probs still
    those of the model as loaded (bf16 rounding is what learner.off_policy 'tis' weighs)."""
    from ray_credit import models
    from ray_credit.models import resolve_dtype

    monkeypatch.setattr(models, "cpu_has_native_bf16", lambda: native)
    models.native_bf16.cache_clear()
    try:
        assert resolve_dtype("native", "cpu") == str(chosen).removeprefix("torch.")
        assert resolve_dtype("float16", "cpu") == "float16"
        config = GeneratorConfig(dtype="native", max_turns=2, max_new_tokens=8, group_size=2)
        gen = Generator("tiny-random", WordRetriever(), config)
        assert next(gen.sampler.model.parameters()).dtype == chosen
        batch = gen.generate(QUESTIONS[:1])
        assert max_logprob_gap(gen.sampler.model, batch) < (0.05 if native else 1e-4)
    finally:
        models.native_bf16.cache_clear()
