"""Guided decoding: every reply has its schema's form, and the model's choices are the
argmaxes a slow, one-forward-per-candidate reference finds."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ray_credit.actors import guided  # noqa: E402
from ray_credit.actors.guided import guided_replies  # noqa: E402
from ray_credit.models import load_model, load_tokenizer  # noqa: E402
from ray_credit.signals._reply import Choice, Count, Strings  # noqa: E402

GRADES = (("retrieval_reward", Choice((0, 1))), ("thinking_reward", Choice((0, 1))))
EVAL = (  # Search-P1-like
    ("planner_score", Choice((0.2, 0.6, 1.0, 1.2))),
    ("model_plan_steps", Count(max=3)),
    ("effective_steps_self", Count(max=5, at_most="model_plan_steps")),
    ("effective_steps_ref", Count(max=12)),
)
PLAN = (("steps", Strings(min_items=1, max_items=3, max_tokens=8)),)
MIXED = (  # values after a list; a count bounded by a Choice of integers
    ("grade", Choice((0, 1, 2))),
    ("steps", Strings(min_items=2, max_items=2, max_tokens=4)),
    ("hits", Count(max=4, at_most="grade")),
)
SCHEMAS = [GRADES, EVAL, PLAN, MIXED]


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Tiny batches run faster on one thread, and far faster on a shared, busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-random")


def contexts(tokenizer, n):
    """Rendered prompts of different lengths (so that padding matters)."""
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Grade answer {i}: {'why ' * (3 * i)}. Reply in JSON."}],
            tokenize=False,
            add_generation_prompt=True,
        )
        for i in range(n)
    ]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def check(reply, schema):
    """The reply is json.dumps-style JSON with the schema's fields, values allowed."""
    obj = json.loads(reply)
    assert reply == json.dumps(obj, ensure_ascii=False)
    assert list(obj) == [name for name, _ in schema]
    for name, kind in schema:
        value = obj[name]
        if isinstance(kind, Choice):
            assert value in kind.values and type(value) is type(
                kind.values[kind.values.index(value)]
            )
        elif isinstance(kind, Count):
            bound = kind.max if kind.at_most is None else min(kind.max, obj[kind.at_most])
            assert type(value) is int and 0 <= value <= bound
        else:
            assert kind.min_items <= len(value) <= kind.max_items
            assert all(isinstance(s, str) and s.strip() for s in value)


def test_every_reply_has_its_schemas_form(tiny):
    model, tokenizer = tiny
    schemas = SCHEMAS * 2
    replies = guided_replies(model, tokenizer, contexts(tokenizer, len(schemas)), schemas)
    for reply, schema in zip(replies, schemas, strict=True):
        check(reply, schema)
        if schema is GRADES:
            assert all(type(v) is int for v in json.loads(reply).values())


def test_deterministic_and_independent_of_batching(tiny):
    model, tokenizer = tiny
    schemas = SCHEMAS * 2
    ctx = contexts(tokenizer, len(schemas))
    replies = guided_replies(model, tokenizer, ctx, schemas)
    assert guided_replies(model, tokenizer, ctx, schemas) == replies
    for rows in (1, 3):  # one by one; uneven chunks, a Count's candidates split over passes
        assert guided_replies(model, tokenizer, ctx, schemas, max_batch_rows=rows) == replies


# ---------------------------------------------------------------- slow references
def total_logprob(model, tokenizer, context, text):
    """log p(text's tokens | context): one plain forward pass, no padding, no cache."""
    ids = context + tokenizer(text, add_special_tokens=False)["input_ids"]
    logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), -1)
    return float(sum(logp[t - 1, ids[t]] for t in range(len(context), len(ids))))


def test_scores_match_one_forward_per_candidate(tiny):
    """The batched two-stage scores (shared prefix, then each candidate after a copy of its
    cache) differ between candidates exactly as whole-reply log-probabilities do; this
    covers candidates that merge with the text before them (`"` + `, "` is `",` + ` "`)."""
    model, tokenizer = tiny
    ctx = contexts(tokenizer, 3)
    asks = [
        ('{"planner_score": ', ["0.2", "0.6", "1.0", "1.2"]),
        ('{"steps": ["first step"', [', "', "]"]),
        ('{"a": 1, "effective_steps_ref": ', [str(v) for v in range(13)]),
    ]
    rows = [guided._Row(c, PLAN) for c in ctx]
    for row, (text, _) in zip(rows, asks, strict=True):
        row.text = text
    with torch.inference_mode():
        for cap in (64, 2):
            chunk = guided._Chunk(model, tokenizer, rows, cap)
            scores = chunk.score([(i, candidates) for i, (_, candidates) in enumerate(asks)])
            for context, (text, candidates), got in zip(ctx, asks, scores, strict=True):
                want = [total_logprob(model, tokenizer, context, text + c) for c in candidates]
                np.testing.assert_allclose(got - got[0], np.array(want) - want[0], atol=1e-4)


def test_values_are_the_most_likely(tiny):
    """Each Choice / Count value in a reply is the argmax of the reference over the values
    allowed there, each scored with the literal that follows it ("1," against "10,": no
    value wins by being shorter; the first on a tie is not tested: a random model has
    none)."""
    model, tokenizer = tiny
    ctx = contexts(tokenizer, 4)
    schemas = [EVAL, GRADES, EVAL, MIXED]
    for context, schema, reply in zip(
        ctx, schemas, guided_replies(model, tokenizer, ctx, schemas), strict=True
    ):
        obj = json.loads(reply)
        for position, (name, kind) in enumerate(schema):
            if isinstance(kind, Strings):
                continue
            follower = "," if position + 1 < len(schema) else "}"
            head = reply[: reply.index(json.dumps(name)) + len(json.dumps(name)) + 2]
            if isinstance(kind, Choice):
                values = list(kind.values)
            else:
                bound = kind.max if kind.at_most is None else min(kind.max, obj[kind.at_most])
                values = list(range(bound + 1))
            with torch.inference_mode():
                scores = [
                    total_logprob(model, tokenizer, context, head + json.dumps(v) + follower)
                    for v in values
                ]
            assert obj[name] == values[int(np.argmax(scores))], (name, reply)


def test_strings_follow_the_masked_greedy_reference(tiny):
    """A string is the greedy pick among allowed tokens, one plain forward per token; the
    list goes on exactly when `,` is likelier than `]` (one character each)."""
    model, tokenizer = tiny
    content, first, closer = guided._vocab_masks(tokenizer)
    ctx = contexts(tokenizer, 2)
    for context, reply in zip(
        ctx, guided_replies(model, tokenizer, ctx, [PLAN, PLAN]), strict=True
    ):
        steps = json.loads(reply)["steps"]
        head = '{"steps": ["'
        tokens = []
        with torch.inference_mode():
            while len(tokens) < PLAN[0][1].max_tokens:
                ids = context + tokenizer(head, add_special_tokens=False)["input_ids"] + tokens
                logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float().numpy()
                allowed = first if not tokens else content | closer
                pick = int(np.argmax(np.where(allowed[: len(logits)], logits, -np.inf)))
                if closer[pick]:
                    break
                tokens.append(pick)
            assert steps[0] == tokenizer.decode(tokens, clean_up_tokenization_spaces=False)
            text = head + steps[0] + '"'
            go_on, stop = (total_logprob(model, tokenizer, context, text + c) for c in (",", "]"))
        assert (len(steps) > 1) == (go_on > stop)


class _Biased(torch.nn.Module):
    """A model whose logits favour one token (to make a random model close its strings)."""

    def __init__(self, inner, token, bias):
        super().__init__()
        self.inner, self.token, self.bias = inner, token, bias

    def forward(self, **kwargs):
        out = self.inner(**kwargs)
        out.logits = out.logits.clone()
        out.logits[..., self.token] += self.bias
        return out


def test_a_string_ends_when_a_closing_token_is_the_best(tiny):
    model, tokenizer = tiny
    quote = tokenizer.convert_tokens_to_ids('"')
    schema = (("steps", Strings(min_items=2, max_items=3, max_tokens=8)),)
    ctx = contexts(tokenizer, 3)
    singles = set(tokenizer.batch_decode([[i] for i in range(len(tokenizer))]))
    for reply in guided_replies(_Biased(model, quote, 100.0), tokenizer, ctx, [schema] * 3):
        check(reply, schema)
        assert all(step in singles for step in json.loads(reply)["steps"])  # one token each


def test_vocab_masks():
    tokenizer = load_tokenizer("tiny-random")  # a fresh instance: nothing cached for it
    start = time.perf_counter()
    content, first, closer = guided._vocab_masks(tokenizer)
    assert time.perf_counter() - start < 3.0  # about 0.3 s for 49k tokens here
    assert guided._vocab_masks(tokenizer)[0] is content  # cached per tokenizer
    ids = tokenizer.convert_tokens_to_ids
    for text in ('"', '",', '"]'):
        assert closer[ids(text)] and not content[ids(text)]
    assert not closer[ids('")')]
    for token in ("\\", "Ċ", "<|im_end|>"):  # a backslash, a newline, a special token
        assert not content[ids(token)]
    assert content[ids("Ġ")] and not first[ids("Ġ")]  # a space may continue, not start
    assert first[ids("Ġthe")] and first[ids("1")]


@pytest.mark.parametrize(
    ("contexts_", "schemas", "options", "error", "match"),
    [
        ([[1, 2], [3]], [GRADES], {}, ValueError, "one schema per context"),
        ([[1, 2]], [()], {}, ValueError, "at least one field"),
        ([[]], [GRADES], {}, ValueError, "context 0 is empty"),
        ([[1, 2]], [(("x", int),)], {}, TypeError, "not a Choice, Count or Strings"),
        ([[1, 2]], [GRADES + GRADES[:1]], {}, ValueError, "repeats the field"),
        ([[1, 2]], [(("n", Count(at_most="m")),)], {}, ValueError, "must name an earlier"),
        ([[1, 2]], [(("s", Choice((0.5,))), ("n", Count(at_most="s")))], {}, ValueError, "earlier"),
        ([[1, 2]], [GRADES], {"max_batch_rows": 0}, ValueError, "max_batch_rows must be >= 1"),
    ],
)
def test_bad_input(tiny, contexts_, schemas, options, error, match):
    model, tokenizer = tiny
    with pytest.raises(error, match=match):
        guided_replies(model, tokenizer, contexts_, schemas, **options)


def test_no_input_no_reply(tiny):
    assert guided_replies(*tiny, [], []) == []


@pytest.mark.e2e  # the embedded policy, a second model in the run: the second test command
@pytest.mark.slow
def test_smollm2_replies_in_form():
    try:
        model, tokenizer = load_model("smollm2-135m")
    except (ImportError, FileNotFoundError) as err:
        pytest.skip(f"SmolLM2 is not installed here: {err}")
    prompt = (
        "Question: what is the capital of France? Answer: Paris.\n"
        'Grade the answer. Reply with JSON: {"retrieval_reward": 0 or 1, '
        '"thinking_reward": 0 or 1}, then list the steps to check it.'
    )
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )
    context = tokenizer(text, add_special_tokens=False)["input_ids"]
    schemas = [GRADES, PLAN, EVAL]
    for reply, schema in zip(
        guided_replies(model, tokenizer, [context] * 3, schemas), schemas, strict=True
    ):
        check(reply, schema)
