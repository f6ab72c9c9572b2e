"""The warm-start: the scripted expert's turns, its demonstrations through the real
generator loop, and the fine-tuning that saves a loadable policy."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from ray_credit.actors.generator import Generator, GeneratorConfig  # noqa: E402
from ray_credit.config import InputError  # noqa: E402
from ray_credit.models import load_model, load_tokenizer  # noqa: E402
from ray_credit.warm_start import (  # noqa: E402
    ScriptedSampler,
    WarmStartConfig,
    _trained,
    demonstrate,
    demonstrated,
    expert_turns,
    rl_questions,
    warm_start,
    weights_digest,
)

DOCS = {
    "d1": "Velmora\nVelmora was founded by Ada Quill in 1873.",
    "d2": "Ada Quill\nAda Quill was born in Tarsk.",
    "d3": "Tarsk\nTarsk is a port city on the Orle river.",
}
TITLES = {k: v.partition("\n")[0] for k, v in DOCS.items()}
ONE_HOP = {"question": "Who founded Velmora?", "golden_answers": ["Ada Quill"],
           "supporting_doc_ids": ["d1"]}  # fmt: skip
TWO_HOP = {"question": "Where was the founder of Velmora born?", "golden_answers": ["Tarsk"],
           "supporting_doc_ids": ["d1", "d2"]}  # fmt: skip
# the retriever below cannot find d3, so this question's demonstration never sees its gold
UNFINDABLE = {"question": "On which river is Tarsk?", "golden_answers": ["Orle"],
              "supporting_doc_ids": ["d3"]}  # fmt: skip

GEN = GeneratorConfig(
    group_size=1, max_turns=3, max_new_tokens=24, topk=1, prompt_template="search_brief",
    response_prefix="<search>", final_turn_prefix="<answer>",
)  # fmt: skip


class TitleRetriever:
    """Finds a document when the query is its title; d3 is never found (the second document
    is returned instead)."""

    def search(self, queries, topk):
        by_title = {t: k for k, t in TITLES.items() if k != "d3"}
        out = []
        for q in queries:
            key = by_title.get(q, "d2")
            out.append([{"id": key, "contents": DOCS[key], "score": 1.0}][:topk])
        return out


def test_expert_searches_each_hop_then_answers_after_the_prefixes():
    assert expert_turns(ONE_HOP, TITLES, GEN) == [
        " Velmora </search>",
        "<answer> Ada Quill </answer>",
    ]
    assert expert_turns(TWO_HOP, TITLES, GEN) == [
        " Velmora </search>", "<search> Ada Quill </search>", " Tarsk </answer>"
    ]  # fmt: skip
    # two turns leave room for one search: the answer turn comes after the first hop
    two = GeneratorConfig(**{**GEN.__dict__, "max_turns": 2})
    assert expert_turns(TWO_HOP, TITLES, two) == [" Velmora </search>", " Tarsk </answer>"]
    plain = GeneratorConfig(**{**GEN.__dict__, "response_prefix": "", "final_turn_prefix": ""})
    assert expert_turns(ONE_HOP, TITLES, plain)[0] == "<search> Velmora </search>"
    tool = GeneratorConfig(**{**plain.__dict__, "action_style": "tool_call"})
    assert json.loads(expert_turns(ONE_HOP, TITLES, tool)[0][len("<tool_call>"):-len("</tool_call>")]) == {
        "name": "search", "arguments": {"query": "Velmora"}
    }  # fmt: skip


def test_expert_refuses_what_it_cannot_demonstrate():
    with pytest.raises(ValueError, match="supporting_doc_ids"):
        expert_turns({"question": "Who?", "golden_answers": ["x"]}, TITLES, GEN)
    with pytest.raises(ValueError, match="not in the corpus"):
        expert_turns({**ONE_HOP, "supporting_doc_ids": ["d9"]}, TITLES, GEN)
    think = GeneratorConfig(**{**GEN.__dict__, "response_prefix": "<think>"})
    with pytest.raises(ValueError, match="<think>"):
        expert_turns(ONE_HOP, TITLES, think)


def test_demonstrations_are_generator_rollouts_of_the_script():
    tokenizer = load_tokenizer("tiny-random")
    batch, counts = demonstrate(
        [ONE_HOP, TWO_HOP, UNFINDABLE], TITLES, tokenizer, TitleRetriever(), GEN
    )
    assert counts["warm_start/demonstrations"] == 2
    assert counts["warm_start/left_out_no_gold_seen"] == 1
    assert batch.column("question").to_pylist() == [ONE_HOP["question"], TWO_HOP["question"]]
    assert batch.traj_values("outcome_reward").tolist() == [1.0, 1.0]
    records = batch.to_records()
    assert [t["action"] for t in records[1]["turns"]] == ["search", "search", "answer"]
    assert [t["query"] for t in records[1]["turns"][:2]] == ["Velmora", "Ada Quill"]
    # the ids are the prompt the policy gets, then exactly the expert's ids (trained) and
    # the environment's (not trained), as the generator lays out an RL rollout
    gen = Generator(retriever=TitleRetriever(), config=GEN, sampler=ScriptedSampler(tokenizer))
    prompt = gen.prompt_ids(ONE_HOP["question"])
    ids, mask = records[0]["input_ids"], np.array(records[0]["loss_mask"])
    assert ids[: len(prompt)] == prompt
    expert = tokenizer(" Velmora </search>", add_special_tokens=False)["input_ids"]
    assert ids[len(prompt) : len(prompt) + len(expert)] == expert
    assert mask[: len(prompt)].sum() == 0 and mask[len(prompt) : len(prompt) + len(expert)].all()
    trained = [i for i, m in zip(ids, mask, strict=True) if m]
    answer = tokenizer("<answer> Ada Quill </answer>", add_special_tokens=False)["input_ids"]
    assert trained == expert + answer
    assert (
        counts["warm_start/expert_tokens"] == mask.sum() + np.array(records[1]["loss_mask"]).sum()
    )


def test_detours_search_an_unneeded_title_then_answer_from_the_earlier_document():
    assert expert_turns(ONE_HOP, TITLES, GEN, detour="Ada Quill") == [
        " Velmora </search>", "<search> Ada Quill </search>", " Ada Quill </answer>"
    ]  # fmt: skip
    # a two-hop question has no turn to spare: the detour is not taken
    assert expert_turns(TWO_HOP, TITLES, GEN, detour="Tarsk") == expert_turns(TWO_HOP, TITLES, GEN)
    tokenizer = load_tokenizer("tiny-random")
    batch, counts = demonstrate(
        [ONE_HOP, TWO_HOP], TITLES, tokenizer, TitleRetriever(), GEN, detours=1.0
    )
    assert counts["warm_start/detours"] == 1 and counts["warm_start/demonstrations"] == 2
    one_hop = batch.to_records()[0]["turns"]
    assert [t["action"] for t in one_hop] == ["search", "search", "answer"]
    assert one_hop[1]["query"] in {"Ada Quill", "Tarsk"} and one_hop[1]["query"] != "Velmora"
    # the detour's search is shown, not taught: its tokens are out of the cross-entropy
    tensors = batch.to_torch()
    taught = _trained(tensors)
    turn, written = tensors["token_turn"][0], tensors["loss_mask"][0] == 1
    assert written[turn == 1].any() and taught[0][turn == 1].sum() == 0
    assert taught[0][written & (turn != 1)].all()
    assert (taught[1] == tensors["loss_mask"][1]).all()
    assert counts["warm_start/expert_tokens"] == float(taught.sum())
    _, none = demonstrate([ONE_HOP], TITLES, tokenizer, TitleRetriever(), GEN, detours=0.0)
    assert none["warm_start/detours"] == 0
    with pytest.raises(ValueError, match="detours"):
        WarmStartConfig(detours=1.5)


def test_scripted_sampler_refuses_unknown_prompts_and_extra_turns():
    tokenizer = load_tokenizer("tiny-random")
    sampler = ScriptedSampler(tokenizer)
    sampler.add([1, 2, 3], ["a"])
    with pytest.raises(ValueError, match="share a prompt"):
        sampler.add([1, 2, 3], ["b"])
    from ray_credit.actors.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=8)
    assert (
        sampler.sample([[1, 2, 3, 9]], params, seed=0)[0].token_ids
        == tokenizer("a", add_special_tokens=False)["input_ids"]
    )
    with pytest.raises(RuntimeError, match="1 turns"):
        sampler.sample([[1, 2, 3, 9, 9]], params, seed=0)
    with pytest.raises(KeyError, match="no scripted prompt"):
        sampler.sample([[7, 7]], params, seed=0)


def test_warm_start_trains_saves_a_loadable_policy_and_is_reused(tmp_path):
    cfg = WarmStartConfig(enabled=True, epochs=4, lr=3e-3, batch_size=2)
    folder = tmp_path / "ws"
    made = warm_start("tiny-random", [ONE_HOP, TWO_HOP, UNFINDABLE], TITLES, TitleRetriever(),
                      GEN, cfg, str(folder))  # fmt: skip
    m = made["metrics"]
    assert not made["reused"] and m["warm_start/demonstrations"] == 2
    assert m["warm_start/optimizer_steps"] == 4  # one step of 2 per epoch
    assert m["warm_start/loss_last_epoch"] < m["warm_start/loss_first_epoch"]
    policy, _ = load_model(str(folder))
    base, _ = load_model("tiny-random")
    base.save_pretrained(tmp_path / "base", safe_serialization=True)
    changed = [
        k for k, v in base.state_dict().items() if not torch.equal(v, policy.state_dict()[k])
    ]
    assert changed, "the saved policy is the base model"
    again = warm_start("tiny-random", [ONE_HOP, TWO_HOP, UNFINDABLE], TITLES, TitleRetriever(),
                       GEN, cfg, str(folder))  # fmt: skip
    assert again["reused"] and again["fingerprint"] == made["fingerprint"]
    # the weights' digest names what was saved: another policy's weights digest otherwise
    assert made["weights_sha256"] == again["weights_sha256"] == weights_digest(folder)
    assert len(made["weights_sha256"]) == 64
    assert weights_digest(folder) != weights_digest(tmp_path / "base")
    manifest = json.loads((folder / "warm_start.json").read_text())
    del manifest["weights_sha256"]  # a warm start saved before the manifest kept it
    (folder / "warm_start.json").write_text(json.dumps(manifest))
    assert warm_start("tiny-random", [ONE_HOP, TWO_HOP, UNFINDABLE], TITLES, TitleRetriever(),
                      GEN, cfg, str(folder))["weights_sha256"] == made["weights_sha256"]  # fmt: skip
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        weights_digest(tmp_path)
    manifest["weights_sha256"] = made["weights_sha256"]
    (folder / "warm_start.json").write_text(json.dumps(manifest))
    weights = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(
        (tmp_path / "base" / "model.safetensors").read_bytes()
    )
    with pytest.raises(ValueError, match="its weights are not those its warm-start saved"):
        warm_start("tiny-random", [ONE_HOP, TWO_HOP, UNFINDABLE], TITLES, TitleRetriever(),
                   GEN, cfg, str(folder))  # fmt: skip
    (folder / "model.safetensors").write_bytes(weights)
    # what RL draws from afterwards is not how the warm start is made
    rl_other = WarmStartConfig(
        enabled=True, epochs=4, lr=3e-3, batch_size=2, rl_questions="undemonstrated"
    )
    assert warm_start("tiny-random", [ONE_HOP, TWO_HOP, UNFINDABLE], TITLES, TitleRetriever(),
                      GEN, rl_other, str(folder))["reused"]  # fmt: skip
    # sampling settings do not shape a demonstration: still the same warm start
    sampling = GeneratorConfig(**{**GEN.__dict__, "group_size": 8, "temperature": 0.7})
    assert warm_start("tiny-random", [ONE_HOP, TWO_HOP, UNFINDABLE], TITLES, TitleRetriever(),
                      sampling, cfg, str(folder))["reused"]  # fmt: skip
    with pytest.raises(ValueError, match="other settings"):  # the protocol does
        topk = GeneratorConfig(**{**GEN.__dict__, "topk": 2})
        warm_start("tiny-random", [ONE_HOP, TWO_HOP, UNFINDABLE], TITLES, TitleRetriever(),
                   topk, cfg, str(folder))  # fmt: skip
    with pytest.raises(ValueError, match="other settings"):
        warm_start("tiny-random", [ONE_HOP], TITLES, TitleRetriever(), GEN, cfg, str(folder))
    # hops is a set of hop counts: another order of it is the same warm start
    hopped = [{**ONE_HOP, "hops": 1}, {**TWO_HOP, "hops": 2}]
    by_hops = WarmStartConfig(enabled=True, epochs=1, batch_size=2, hops=(1, 2))
    made = warm_start("tiny-random", hopped, TITLES, TitleRetriever(), GEN, by_hops,
                      str(tmp_path / "hops"))  # fmt: skip
    again = WarmStartConfig(enabled=True, epochs=1, batch_size=2, hops=(2, 1, 1))
    assert warm_start("tiny-random", hopped, TITLES, TitleRetriever(), GEN, again,
                      str(tmp_path / "hops"))["fingerprint"] == made["fingerprint"]  # fmt: skip
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("a user's file")
    with pytest.raises(ValueError, match="holds no warm start"):
        warm_start(
            "tiny-random", [ONE_HOP], TITLES, TitleRetriever(), GEN, cfg, str(tmp_path / "mine")
        )
    assert (tmp_path / "mine" / "notes.txt").read_text() == "a user's file"


def test_rl_draws_from_the_questions_the_warm_start_does_not_demonstrate():
    questions = [{"question": f"q{i}"} for i in range(50)]
    cfg = WarmStartConfig(enabled=True, questions=20, seed=3, rl_questions="undemonstrated")
    shown = demonstrated(len(questions), cfg)
    assert len(shown) == 20 and shown == sorted(set(shown))
    assert shown == demonstrated(len(questions), cfg)  # seeded
    assert shown != demonstrated(len(questions), WarmStartConfig(questions=20, seed=4))
    rest = rl_questions(questions, cfg)
    assert len(rest) == 30
    assert {q["question"] for q in rest}.isdisjoint({f"q{i}" for i in shown})
    assert [q["question"] for q in rest] == [f"q{i}" for i in range(50) if i not in shown]
    # all of them: with rl_questions="all", or with no warm-start at all
    assert rl_questions(questions, WarmStartConfig(enabled=True, questions=20,
                                                   rl_questions="all")) == questions  # fmt: skip
    assert rl_questions(questions, WarmStartConfig(enabled=True, questions=20)) == questions
    assert (
        rl_questions(
            questions, WarmStartConfig(enabled=False, questions=20, rl_questions="undemonstrated")
        )
        == questions
    )
    # the warm-start demonstrates each question it draws, and only those
    assert demonstrated(50, WarmStartConfig(questions=0)) == list(range(50))
    assert demonstrated(50, WarmStartConfig(questions=80)) == list(range(50))


def test_a_warm_start_of_every_question_leaves_rl_none_and_says_what_to_set():
    questions = [{"question": f"q{i}"} for i in range(5)]
    for n in (0, 5):
        with pytest.raises(InputError, match="leaves none for RL.*rl_questions=all"):
            rl_questions(
                questions, WarmStartConfig(enabled=True, questions=n, rl_questions="undemonstrated")
            )


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("epochs", 0),
        ("batch_size", 0),
        ("questions", -1),
        ("lr", 0.0),
        ("autocast", "int8"),
        ("rl_questions", "some"),
    ],
)
def test_warm_start_config_refuses_bad_values(field, value):
    with pytest.raises(ValueError, match=field):
        WarmStartConfig(**{field: value})


def test_the_warm_start_demonstrates_only_the_hops_it_is_given():
    questions = [{"question": f"q{i}", "hops": 1 + i % 3} for i in range(60)]
    one_hop = demonstrated(questions, WarmStartConfig(hops=(1,)))
    assert one_hop == [i for i in range(60) if i % 3 == 0]
    drawn = demonstrated(questions, WarmStartConfig(hops=(1, 2), questions=10, seed=2))
    assert len(drawn) == 10 and all(questions[i]["hops"] in (1, 2) for i in drawn)
    rest = rl_questions(questions, WarmStartConfig(enabled=True, hops=(1,),
                                                   rl_questions="undemonstrated"))  # fmt: skip
    assert len(rest) == 40 and all(q["hops"] > 1 for q in rest)
    with pytest.raises(InputError, match="no training question has those hops"):
        demonstrated(questions, WarmStartConfig(hops=(4,)))
    with pytest.raises(ValueError, match="hop counts >= 1"):
        WarmStartConfig(hops=(0,))
