"""Credit as parts: every paper estimator equals its composition of parts, compositions
read the same as text and in Python, and a composition that cannot work is refused."""

from __future__ import annotations

import numpy as np
import pytest

from ray_credit.estimators import ESTIMATORS, get_estimator
from ray_credit.estimators.compose import CompositionError, P, compose, parse
from ray_credit.testing import make_batch, random_batch
from tests.unit import test_a2tgpo, test_cw_grpo, test_gigpo, test_igpo, test_search_p1

GRPO_KNOBS = [{}, {"std_ddof": 0}, {"norm_by_std": False}, {"singleton_policy": "center"},
              {"eps": 0.1}]  # fmt: skip
TSPO_KNOBS = [
    {},
    {"strategy": "all_groups"},
    {"alpha": 0.5, "std_ddof": 1},
    {"strategy": "all_groups", "padding": "none", "alpha": 0.3},
    {"padding": "none", "std_ddof": 1},
    {"eps": 0.05, "alpha": 0.0},
]


def _configs():
    """(estimator, config, batch maker) for every knob set the estimators' tests use."""
    plain = "plain"
    cases = [("grpo", k, plain) for k in GRPO_KNOBS]
    cases += [("dr_grpo", {}, plain), ("rloo", {}, plain),
              ("rloo", {"singleton_policy": "center"}, plain)]  # fmt: skip
    cases += [("tspo", k, plain) for k in TSPO_KNOBS]
    cases += [("igpo", k, plain) for k in test_igpo.CONFIGS]
    cases += [("a2tgpo", k, plain) for k in test_a2tgpo.CONFIGS]
    cases += [("a2tgpo", {"norm_mode": m, "gamma": 0.8}, plain) for m in ("joint", "separate")]
    cases += [("cw_grpo", k, plain) for k in test_cw_grpo.CONFIGS]
    cases += [("search_p1", k, "messy") for k in test_search_p1.CONFIGS]
    cases += [("gigpo", cfg, "anchors") for cfg in test_gigpo.CONFIGS]
    covered = {name for name, _, _ in cases}
    shipped = [n for n, e in ESTIMATORS.items() if e.fn.__module__.startswith("ray_credit.")]
    cases += [(name, {}, plain) for name in shipped if name not in covered]  # a new one
    return cases


def _batch(kind: str, seed: int):
    if kind == "messy":
        return test_search_p1.messy_batch(seed)
    if kind == "anchors":
        return test_gigpo.gigpo_random_batch(
            seed, num_groups=12, group_size=5, max_turns=5, singleton_frac=0.2
        )
    layouts = [  # ragged and equal-size groups, binary and graded rewards, many nulls, 1 turn
        dict(num_groups=12, group_size=5, max_turns=6, singleton_frac=0.2, null_frac=0.15),
        dict(num_groups=12, singleton_frac=0.0, binary_reward=False),
        dict(num_groups=10, group_size=4, max_turns=6, null_frac=0.3, binary_reward=False),
        dict(num_groups=8, group_size=3, max_turns=1),
    ]
    return random_batch(seed, **layouts[seed % len(layouts)])


CASES = _configs()


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(
    "name,params,kind", CASES, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(CASES)]
)
def test_every_paper_estimator_equals_its_composition(name, params, kind, seed):
    est = get_estimator(name)
    config = params if not isinstance(params, dict) else est.config_cls(**params)
    text = est.composition(config)
    if text is None:  # GiGPO's per-row episode scores without cross-step statistics
        assert name == "gigpo" and not config.cross_steps and config.invalid_action_penalty
        return
    batch = _batch(kind, seed)
    want = est(batch, config=config)
    got = compose(text)(batch)
    np.testing.assert_allclose(
        got.turn_values("turn_advantages"), want.turn_values("turn_advantages"),
        rtol=1e-6, atol=1e-6, err_msg=text,
    )  # fmt: skip
    want_clip = (
        want.turn_values("turn_clip_scale") if "turn_clip_scale" in want
        else np.ones(batch.num_turns)
    )  # fmt: skip
    got_clip = (
        got.turn_values("turn_clip_scale") if "turn_clip_scale" in got
        else np.ones(batch.num_turns)
    )  # fmt: skip
    np.testing.assert_allclose(got_clip, want_clip, rtol=1e-6, atol=1e-6, err_msg=text)


def test_every_registered_estimator_declares_its_composition():
    for name, est in ESTIMATORS.items():
        if not est.fn.__module__.startswith("ray_credit."):
            continue  # a user's (a test's) own
        assert est.composition is not None, f"{name} declares no composition of parts"
        assert est.composition(est.config_cls()) is not None, name


def test_the_paper_compositions_read_back_as_they_print():
    for est in ESTIMATORS.values():
        if est.composition is None:
            continue  # a user's (a test's) own
        text = str(parse(est.composition(est.config_cls())))
        assert str(parse(text)) == text and parse(text) == parse(est.composition(est.config_cls()))
    assert str(parse(ESTIMATORS["tspo"].composition(ESTIMATORS["tspo"].config_cls()))) == (
        "folr | turn_position"
    )


def test_python_and_text_write_the_same_composition():
    text = "outcome + 0.5*folr(alpha=0.5) + 0.3*info_gain | turn_position | contribution"
    in_python = (
        P.outcome + 0.5 * P.folr(alpha=0.5) + 0.3 * P.info_gain | P.turn_position | P.contribution
    )
    assert parse(text) == in_python and str(in_python) == text
    est = compose(in_python)
    assert est.name == text and est.group_local
    assert est.signals == {"info_gain": {"mode": "prob_diff"}, "cw_grpo_judgement": {}}
    assert {"turn_contains_gold", "turn_info_gain", "judge_utility"} <= set(est.requires)
    summed = "(folr | turn_position) - 0.25*(info_gain | turn_position(padding=none)) | discount"
    assert str(parse(summed)) == (
        "(folr | turn_position) - 0.25*(info_gain | turn_position(padding='none')) | discount"
    )
    assert parse(summed) == parse(str(parse(summed)))


def test_a_composition_of_parts_runs_each_part():
    """folr + outcome under turn_position, then the judged contribution: on a batch the
    composition's advantage is turn_position's over the summed rewards, times CW-GRPO's
    factors on the judged rounds."""
    batch = random_batch(5, num_groups=10, group_size=4, max_turns=5, null_frac=0.0)
    base = compose("outcome + 0.5*folr(groups=all) | turn_position")(batch)
    weighted = compose("outcome + 0.5*folr(groups=all) | turn_position | contribution")(batch)
    ratio = np.divide(
        weighted.turn_values("turn_advantages"), base.turn_values("turn_advantages"),
        out=np.ones(batch.num_turns), where=base.turn_values("turn_advantages") != 0,
    )  # fmt: skip
    # the final turns keep the advantage; the redistributed rounds of one trajectory sum
    # to the number of its rounds (Design 3), every other turn has factor 1
    assert np.allclose(ratio[batch.is_last_turn], 1.0)
    assert not np.allclose(ratio, 1.0)
    assert weighted.metrics["contribution/redistributed_trajs"] > 0
    assert "turn_rewards" in base and "folr/partial_reward_turns" in base.metrics
    rewards = base.turn_values("turn_rewards")
    outcome = np.repeat(batch.traj_values("outcome_reward"), batch.turn_counts)
    assert np.all((rewards == outcome) | (rewards == outcome + 0.5))  # alpha 1 on the lead


def test_turn_level_credit_reaches_all_wrong_groups_where_grpo_gives_none():
    # One all-wrong group: the trajectory that saw the gold gets credit for it.
    rows = [
        {"group_id": "g", "traj_id": f"t{i}", "reward": 0.0, "turns": 3,
         "turn_contains_gold": [False, i == 0, False]}
        for i in range(4)
    ]  # fmt: skip
    batch = make_batch(rows)
    assert not compose("outcome | group")(batch).turn_values("turn_advantages").any()
    adv = compose("outcome + 0.5*folr | turn_position")(batch).turn_values("turn_advantages")
    by_turn = adv.reshape(4, 3)  # turns 1-2: the one that saw the gold above the others
    assert by_turn[0, :2].min() > 0 and by_turn[1:, :2].max() < 0
    assert not by_turn[:, 2].any()  # after the gold every trajectory has 0 again


def test_a_composition_is_group_local():
    text = "(folr | turn_position) + 0.3*(info_gain | turn_position(padding=none)) | contribution"
    est = compose(text)
    batch = random_batch(9, num_groups=8, group_size=4, max_turns=5)
    whole = est(batch).turn_values("turn_advantages")
    half = batch.group_starts[4]
    first = batch.table.slice(0, int(half))
    rest = batch.table.slice(int(half))
    from ray_credit.batch import TrajectoryBatch

    parts = [
        est(TrajectoryBatch.from_table(t)).turn_values("turn_advantages") for t in (first, rest)
    ]
    np.testing.assert_allclose(np.concatenate(parts), whole, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "text, says",
    [
        ("folr | group", "one value per trajectory"),
        ("info_gain | turn_position", "padding='none'"),
        ("outcome", "has no normalizer"),
        ("outcome | group | group", "normalized already"),
        ("outcome + (outcome | group)", "not rewards to advantages"),
        ("outcome | contribution", "normalize the rewards first"),
        ("outcome | group | adaptive_clip", "reads the normalized info_gain term"),
        ("outcome | group | contribution | contribution", "twice"),
        ("outcome | discount", "put a normalizer before it"),
        ("group | outcome", "goes after a '|'"),
        ("outcome | folr", "after '|' comes a normalizer"),
        ("outcme | group", "unknown part 'outcme'"),
        ("folr(beta=1) | turn_position", "no setting 'beta'"),
        ("folr(alpha=2) | turn_position", "alpha is a partial reward"),
        ("folr(1) | turn_position", "given by name"),
        ("__import__('os').system('true') | group", "not part of a composition"),
        ("outcome | group(ddof=x.y)", "a setting's value"),
        ("folr * info_gain | turn_position", "multiplies a part by one number"),
        ("outcome + 2 | group", "stands only as a weight"),
        ("outcome | ", "cannot read the composition"),
        (
            "(info_gain(mode=prob_diff) | turn_position(padding=none)) + "
            "(info_gain(mode=log_prob_diff) + outcome | group_turns)",
            "wants the info_gain signal with mode='log_prob_diff'",
        ),
        ("outcome(at=last) + info_gain | anchor_state", "leaves turns without one"),
        ("folr(alpha=0.5, alpha=0.3) | turn_position", "given a setting twice"),
        ("0.5", "is a number, not a composition"),
        (" + ".join(["outcome"] * 5000) + " | group", "too deeply nested"),
    ],
)
def test_a_composition_that_cannot_work_is_refused_with_the_reason(text, says):
    with pytest.raises(CompositionError, match=None) as err:
        compose(text)
    assert says in str(err.value), str(err.value)


def test_learner_settings_follow_from_the_parts_and_conflicts_are_refused():
    est = compose(
        "0.3*(info_gain | turn_position(padding=none)) + (outcome | group) | adaptive_clip"
    )
    assert est.learner == {
        "loss.ratio_level": "turn",
        "loss.clip_low": 3e-3,
        "loss.clip_high": 4e-3,
    }
    assert compose("outcome | group", learner={"kl_coef": 1e-3}).learner == {"kl_coef": 1e-3}


def test_one_estimator_has_one_name_however_its_settings_are_spelled():
    import math

    assert P.turn_position(eps=1) == parse("turn_position(eps=1.0)") == P.turn_position(eps=1.0)
    assert str(P.folr(alpha=np.float64(0.25))) == "folr(alpha=0.25)"  # a numpy scalar
    assert str(P.turn_position(eps=np.float32(0.5))) == "turn_position(eps=0.5)"
    assert P.folr(alpha=1.0) == P.folr  # a default is not a setting
    from ray_credit.estimators.compose import _value_text, is_composition

    assert _value_text(-math.inf) == "-inf" and _value_text(math.inf) == "inf"
    assert is_composition("outcome - invalid") and not is_composition("tspo")


def test_turn_position_without_padding_follows_its_singleton_setting():
    """A one-trajectory group whose rewards are one per trajectory: 0 when centered, its
    value over (1 + eps) under zero_mean_unit_std, as every other normalizer does."""
    rows = [{"group_id": "alone", "traj_id": "t0", "reward": 1.0, "turns": 2,
             "turn_contains_gold": [False, False]}]  # fmt: skip
    batch = make_batch(rows)
    centered = compose("outcome | turn_position(padding=none)")(batch)
    kept = compose("outcome | turn_position(padding=none, singleton=zero_mean_unit_std)")(batch)
    assert not centered.turn_values("turn_advantages").any()
    np.testing.assert_allclose(kept.turn_values("turn_advantages"), [1 / (1 + 1e-6)] * 2)


@pytest.mark.parametrize(
    "spec",
    [
        "0*outcome | group",
        "0 * outcome + 0*folr | turn_position | contribution",
        "outcome - outcome | group",
        "0.1*outcome + 0.2*outcome - 0.3*outcome | group",
        "(outcome | group) - (outcome | group)",
        "0*(outcome | group) + 0*(folr | turn_position) | discount",
        "0*(outcome | group) + (0*folr | turn_position)",
        "path(lambda_path=0, lambda_outcome=0, lambda_format=0) | group",
        "path(variant=algorithm3, format_full=0, format_partial=0) | group",
        0 * P.outcome | P.group,
    ],
)
def test_a_composition_whose_advantages_are_all_zero_is_refused(spec):
    """Every advantage 0 by construction (zero weights, terms that cancel, a part whose
    settings give no reward): accepted before, and nothing was learned."""
    with pytest.raises(CompositionError) as err:
        compose(spec)
    text = str(parse(spec) if isinstance(spec, str) else spec)
    assert str(err.value).startswith(
        f"{text}: every advantage would be 0 whatever the batch, so nothing is learned: the "
        "weights of its terms are 0 or cancel out"
    ), str(err.value)
    assert str(err.value).endswith("give a term a weight other than 0, e.g. outcome | group")
    if "path" in text:
        assert "gives 0 on every turn with those settings" in str(err.value)


def test_compositions_with_a_zero_or_negative_term_still_compose():
    """A zero weight beside others, a penalty, a term taken away: legitimate, composed."""
    for text in [
        "outcome + 0*folr | turn_position",
        "(0*outcome | group) + (folr | turn_position)",
        "outcome - 0.1*invalid | group_turns",
        "-invalid | group_turns",
        "(outcome | group) - 0.3*(info_gain | turn_position(padding=none))",
        "path(lambda_path=0, lambda_outcome=0) | group",  # the format reward alone
        "2*0.5*folr | turn_position",
        # docs/estimators.md's examples
        "outcome + 0.5*folr | turn_position | contribution",
        "(folr | turn_position) + 0.3*(info_gain(mode=log_prob_diff) | "
        "turn_position(padding=none) | rescaled_sum)",
        "0.3*(info_gain | turn_position(padding='none') | rescaled_sum) + (outcome | group)",
    ]:
        compose(text)
    assert str(parse("2*0.5*folr | turn_position")) == "folr | turn_position"
    # a leading '+', as f"{w:+}*outcome" writes it: refused as "not part of a composition"
    assert parse("+outcome + 0.5*folr(alpha=+0.5) | turn_position") == parse(
        "outcome + 0.5*folr(alpha=0.5) | turn_position"
    ) == (+P.outcome + 0.5 * P.folr(alpha=0.5) | P.turn_position)  # fmt: skip
    # a transform at two levels is two transforms, each given once
    compose("(outcome | group | discount) + (folr | turn_position) | discount")
    assert str(np.float64(0.5) * P.folr) == "0.5*folr"  # a numpy weight is its number
    # one written over lines, as a YAML block scalar gives it
    assert compose("outcome + 0.5*folr  # TSPO's reward\n  | turn_position\n").name == (
        "outcome + 0.5*folr | turn_position"
    )


@pytest.mark.parametrize(
    "spec, says",
    [
        (
            "nan*outcome | group",
            "in 'nan*outcome | group': nan is not a part, and a weight is a finite number",
        ),
        ("inf*outcome | group", "inf is not a part, and a weight is a finite number"),
        ("-inf*outcome | group", "inf is not a part, and a weight is a finite number"),
        (
            "1e400*outcome | group",
            "in '1e400*outcome | group': a weight is a finite number, got inf",
        ),
        (
            "-outcome | group",
            "-outcome | group: every reward in it (outcome) has a negative "
            "weight, so the policy is trained away from its rewards",
        ),
        (
            "-(outcome + 0.5*folr | turn_position)",
            "every reward in it (outcome, folr) has a negative weight",
        ),
        (
            "outcome + invalid | group_turns",
            "outcome + invalid | group_turns: invalid is a "
            "penalty (larger where the policy did worse), and "
            "its weight is 1, which rewards what it penalizes",
        ),
        (
            "group",
            "group is a normalizer, and a composition begins with rewards: rewards | "
            "normalizer, e.g. outcome | group",
        ),
        ("contribution", "contribution is a weighting, and a composition begins with rewards"),
        ("outcome |\n| group", "cannot read the composition"),
        ("outcome + | group", "cannot read the composition"),
        ("outcome & group", "is not part of a composition"),
        ("lambda: outcome", "is not part of a composition"),
        # finite, but the normalizer's variance overflowed: NaN advantages, refused by
        # the batch only when the first step's advantages were made
        (
            "1e308*outcome | group",
            "in '1e308*outcome | group': a weight in a composition is at most 3.4e+38 in size "
            "(the advantages are float32; a larger one overflows to inf or NaN), got 1e+308",
        ),
        ("1e30*(1e30*outcome) | group", "is at most 3.4e+38 in size (the advantages are"),
        # a transform given twice applied itself to its own output
        (
            "outcome | group | discount | discount",
            "discount appears twice among the transforms of outcome | group | discount: the "
            "second applies it again to what the first gave; give it once",
        ),
        # said "a part's settings are given by name", as if float were a part
        (
            "float('nan')*outcome | group",
            "in \"float('nan')*outcome | group\": unknown part 'float'",
        ),
        # "column 0" for text that ends too early
        (
            "outcome | group |",
            "cannot read the composition 'outcome | group |': invalid syntax at its end (after "
            "'|'); write e.g.",
        ),
        # a minus sign pasted from a paper, a non-breaking space, a zero-width space
        (
            "outcome \u2212 0.1*invalid | group_turns",
            "invalid character '\u2212' (U+2212) at column 9; write '\u2212' (U+2212) as '-'",
        ),
        ("outcome\u00a0| group", "write '\\xa0' (U+00A0) as ' '"),
        ("outcome | group\u200b", "remove '\\u200b' (U+200B)"),
    ],
)
def test_weights_that_are_no_number_or_turn_learning_around_are_refused(spec, says):
    with pytest.raises(CompositionError) as err:
        compose(spec)
    assert says in str(err.value), str(err.value)


def test_python_weights_and_specs_that_are_not_compositions_are_named():
    import math

    for weight in (math.nan, math.inf, np.float64("nan"), True):
        with pytest.raises(CompositionError, match="a weight in a composition is a finite number"):
            weight * P.outcome
    for weigh in (lambda: 1e308 * P.outcome, lambda: 1e30 * (1e30 * P.outcome)):
        with pytest.raises(CompositionError, match=r"is at most 3.4e\+38 in size"):
            weigh()
    with pytest.raises(CompositionError, match="discount appears twice among the transforms"):
        P.outcome | P.group | P.discount | P.discount
    with pytest.raises(CompositionError) as err:  # a TypeError from inside before
        compose("outcome | group", learner=[("kl_coef", 1e-3)])
    assert str(err.value) == (
        "learner maps learner settings to their values, e.g. {'kl_coef': 1e-3}, got "
        "[('kl_coef', 0.001)] (list)"
    )
    with pytest.raises(CompositionError, match=r"group is a normalizer, and a composition begins"):
        compose(P.group)
    for spec, shown in [(5, "5 (int)"), (None, "None (NoneType)"), (["outcome"], "['outcome'] "
                        "(list)"), (b"outcome | group", "b'outcome | group' (bytes)")]:  # fmt: skip
        with pytest.raises(CompositionError) as err:
            compose(spec)
        assert str(err.value) == (
            f"compose takes a composition's text or parts put together with P, got {shown}; "
            'e.g. compose("outcome | group") or compose(P.outcome | P.group)'
        )
