"""03_rollout's environment: EMPA state, rules, judges, users and the token-in/token-out rollout."""

import math

import pytest
from test_advantages import expect

import common
import offline


class Args:
    min_turns, collapse_window, max_turns, eps = 12, 5, 45, 1.0


P0_EQUATION = "C = -2(C1 + C2 + 1.5 C3),  A = -2(A1 + 2 A2 + 1.5 A3),  P = -2(P1 + 2 P2 + 1.5 P3)"


def test_initial_deficit_ranges(env):
    zero = {n: 0 for n in env.DEFICIT_ITEMS}
    expect(env.initial_deficit(zero), [0.0, 0.0, 0.0], "every item 0: no deficit", f"items {zero}", P0_EQUATION)
    three = {n: 3 for n in env.DEFICIT_ITEMS}
    case = "every item 3, the largest deficit: C = -2 * 3.5 * 3, A = P = -2 * 4.5 * 3"
    expect(env.initial_deficit(three), [-21.0, -27.0, -27.0], case, f"items {three}", P0_EQUATION)
    items = dict(C1=1, C2=2, C3=2, A1=0, A2=1, A3=2, P1=3, P2=0, P3=1)
    case = "mixed items: C = -2(1 + 2 + 3), A = -2(0 + 2 + 3), P = -2(3 + 0 + 1.5)"
    expect(env.initial_deficit(items), [-12.0, -10.0, -9.0], case, f"items {items}", P0_EQUATION)


V_EQUATION = (
    "v_t,a = progress points[level] + negative points[a][level]: progress 0, +1, +3; negative 0, -2, -4 on C and "
    "0, -2, -5 on A and P"
)


def test_levels_to_v_reference_example(env):
    # the REFERENCE worked example's v = (1,3,0), (-1,1,1), (3,-1,1) as MDEP-PR levels
    cases = [
        ("progress only: level 1 is +1, level 2 is +3", {"C": (1, 0), "A": (2, 0), "P": (0, 0)}, [1, 3, 0]),
        ("progress and a negative level 1 on C: +1 - 2", {"C": (1, 1), "A": (1, 0), "P": (1, 0)}, [-1, 1, 1]),
        ("progress and a negative level 1 on A: +1 - 2", {"C": (2, 0), "A": (1, 1), "P": (1, 0)}, [3, -1, 1]),
        (
            "negative level 2 on every axis: -4 on C, -5 on A and P",
            {"C": (0, 2), "A": (0, 2), "P": (0, 2)},
            [-4, -5, -5],
        ),
    ]
    for case, levels, v in cases:
        expect(env.levels_to_v(levels), v, case, f"levels (progress, negative) {levels}", V_EQUATION)


HINGE = "d(P) = sqrt( sum_a w_a max(0, -eps - P_a)^2 )"


def test_hinge_distance(env):
    cases = [
        ("the reference P0, eps 1: sqrt(5^2 + 8^2 + 3^2)", ([-6, -9, -4], (1, 1, 1), 1.0), 9.899495),
        ("eps 3: sqrt(3^2 + 6^2 + 1^2)", ([-6, -9, -4], (1, 1, 1), 3.0), math.sqrt(9 + 36 + 1)),
        ("overshoot is not penalised: past the goal the distance is 0", ([5, 5, 5], (1, 1, 1), 1.0), 0.0),
        ("on the box's edge (P_a = -eps) and inside it: 0", ([-1, -0.5, 3], (1, 1, 1), 1.0), 0.0),
        ("weights multiply the squares: sqrt(4 * 2^2 + 1 * 2^2 + 0)", ([-3, -3, -3], (4, 1, 0), 1.0), math.sqrt(20)),
    ]
    for case, (P, w, eps), d in cases:
        got = env.hinge_distance(P, weights=w, eps=eps)
        expect(got, d, case, f"P = {P}, weights {w}, eps {eps}", HINGE, tol=1e-6)


END_RULES = (
    "after turn t: None before min_turns; success if round(E_total, 2) >= ||P0||, checked first; failure if the "
    "last collapse_window dE (rounded) are all < 0, or from 8 turns on if stagnant (the sample std of the last 5 "
    "||P_t|| < 0.5) and regressing (>= 6 of the last 8 dE < 0 and their sum < -1); else None"
)


def test_episode_rules(env):
    P0 = [-6, -9, -4]  # ||P0|| = 11.53
    a = Args()
    still = [P0] * 13  # P_0 .. P_12 as 03's rollout keeps them (one state a turn, and P_0)
    rules = "min_turns 12, collapse_window 5"
    cases = [
        ("before min_turns nothing ends", P0, [3.0] * 5, still[:6], 5, None),
        ("E_total 12 >= ||P0|| 11.53: success", P0, [1.0] * 12, still, 12, "success"),
        ("E_total 10.8 < ||P0||: go on", P0, [0.9] * 12, still, 12, None),
        ("the last 5 dE all < 0: collapsed", P0, [1.0] * 7 + [-0.1] * 5, still, 12, "failure"),
        # E_total 5 = ||(-3, -4, 0)|| exactly: success (>=, not >)
        ("E_total equal to ||P0|| = 5 is a success (>=)", [-3, -4, 0], [5.0] + [0.0] * 11, still, 12, "success"),
        # E_total 12.5 >= 11.53 while the last 5 dE fell: success is checked first
        ("success and a collapse at once: success wins", P0, [13.0] + [0.0] * 6 + [-0.1] * 5, still, 12, "success"),
    ]
    # stagnant (std of last 5 ||P|| < 0.5) and regressing (>= 6 of last 8 dE < 0, sum < -1)
    dEs = [0.0] * 4 + [-0.3, -0.3, 0.1, -0.3, -0.3, 0.1, -0.3, -0.3]
    cases.append(("stagnant and regressing: failure", P0, dEs, [[-6, -9, -4]] * 13, 12, "failure"))
    moving = [[-6, -9, -4 + i] for i in range(13)]  # not stagnant
    cases.append(("regressing but the state moves (not stagnant): go on", P0, dEs, moving, 12, None))
    # the last 5 ||P_t|| are 10, 10, 10, 10, 11.15: sample std 0.514 (not stagnant); the population std is 0.46
    uneven = [[-10, 0, 0]] * 12 + [[-11.15, 0, 0]]
    cases.append(("stagnation takes the sample std (ddof 1): 0.514, not stagnant", P0, dEs, uneven, 12, None))
    # the regression sum runs over all 8 (MICA's scoring.py): six -0.3 and two +0.5 sum to -0.8, not < -1,
    # although the negatives alone sum to -1.8
    dEs = [0.0] * 4 + [-0.3, -0.3, 0.5, -0.3, -0.3, 0.5, -0.3, -0.3]
    states = [[-6, -9, -4]] * 13
    cases.append(("the regression sum runs over all 8 dE: -0.8, not < -1", P0, dEs, states, 12, None))
    # rounded to 2 decimals first: -0.004 is -0.0, not a negative step, so five of them are no collapse
    cases.append(("dE rounded to 2 decimals: -0.004 is 0, no collapse", P0, [1.0] * 7 + [-0.004] * 5, still, 12, None))
    cases.append(("-0.006 rounds to -0.01: a collapse", P0, [1.0] * 7 + [-0.006] * 5, still, 12, "failure"))
    # E_total 11.534 >= ||P0|| = 11.5326, but rounded it is 11.53, short of it; 11.536 rounds to 11.54
    cases.append(("E_total 11.534 rounds to 11.53 < 11.5326: go on", P0, [11.534] + [0.0] * 11, still, 12, None))
    cases.append(("E_total 11.536 rounds to 11.54: success", P0, [11.536] + [0.0] * 11, still, 12, "success"))
    for case, p0, dEs, states, t, outcome in cases:
        inputs = f"P0 {p0}, dEs {dEs}, the last 5 states {states[-5:]}, t {t}, {rules}"
        expect(env.episode_status(p0, dEs, states, t, a), outcome, case, inputs, END_RULES)


def test_load_scenarios_shipped_sets(env):
    train = env.load_scenarios(common.Path(env.HERE) / "data" / "scenarios_train.jsonl")
    test = env.load_scenarios(common.Path(env.HERE) / "data" / "scenarios_test.jsonl")
    assert len(train) >= 20 and len(test) >= 8
    for s in train + test:
        assert s["kind"] in ("cognitive", "affective", "proactive")
        assert 12 <= env.norm(s["p0"]) <= 26
        assert all(len(s["user_lines"][t]) >= 3 for t in ("better", "stuck", "worse"))
    assert {s["kind"] for s in train} == {"cognitive", "affective", "proactive"}
    assert not {s["id"] for s in train} & {s["id"] for s in test}


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"id": "a", "persona": "p", "situation": "s"}', "x.jsonl:2: missing field 'opening'"),
        (
            '{"id": 3, "persona": "p", "situation": "s", "opening": "o", "p0": [-1, -1, -1]}',
            "x.jsonl:2: field 'id' must be str, got int",
        ),
        ('{"id": "a", "persona": "p", "situation": "s", "opening": "o", "p0": [-1, 2]}', "x.jsonl:2: field 'p0'"),
        (
            '{"id": "a", "persona": "p", "situation": "s", "opening": "o", "items": {"C1": 5}}',
            "x.jsonl:2: field 'items.C1' must be an integer 0-3",
        ),
        (
            '{"id": "a", "persona": "p", "situation": "s", "opening": "  ", "p0": [-1, -1, -1]}',
            "x.jsonl:2: field 'opening' is empty",
        ),
        (
            '{"id": "a", "persona": "p", "situation": "s", "opening": "o", "p0": [-1, -1, -1], '
            '"user_lines": {"better": "hi"}}',
            "x.jsonl:2: field 'user_lines.better'",
        ),
        ('{"id": "a", "persona": "p" "situation": "s"}', "x.jsonl:2: not valid JSON"),
        (
            '{"id": "ok", "persona": "q", "situation": "s", "opening": "o", "p0": [-1, -1, -1]}',
            "x.jsonl:2: id 'ok' again (first on line 1)",
        ),
    ],
)
def test_load_scenarios_errors_name_file_line_field(env, tmp_path, line, message):
    good = '{"id": "ok", "persona": "p", "situation": "s", "opening": "o", "p0": [-1, -2, -3]}'
    path = tmp_path / "x.jsonl"
    path.write_text(good + "\n" + line + "\n")
    with pytest.raises(common.UserError) as e:
        env.load_scenarios(path)
    assert message in str(e.value)


def test_parse_judge_json(env):
    ok = (
        '{"C": {"progress": 1, "negative": 0}, "A": {"progress": 2, "negative": 0}, '
        '"P": {"progress": 0, "negative": 1}}'
    )
    assert env.parse_judge_json(ok) == {"C": (1, 0), "A": (2, 0), "P": (0, 1)}
    assert env.parse_judge_json("Sure! ```json\n" + ok + "\n```") == {"C": (1, 0), "A": (2, 0), "P": (0, 1)}
    assert env.parse_judge_json(ok[:-5]) is None  # truncated
    assert env.parse_judge_json(ok.replace('"progress": 2', '"progress": 3')) is None  # out of range
    assert env.parse_judge_json(ok.replace('"progress": 2', '"progress": "2"')) is None  # wrong type
    assert env.parse_judge_json('{"C": {"progress": 1}}') is None  # missing fields
    assert env.parse_judge_json("no json here") is None and env.parse_judge_json(None) is None


def test_scripted_user_follows_trend_and_is_deterministic(env):
    s = {"id": "s", "user_lines": {"better": ["b1", "b2"], "stuck": ["s1", "s2"], "worse": ["w1"]}}
    hist = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]
    u = offline.ScriptedUser(seed=7)
    items = [{"scenario": s, "k": k, "history": hist, "trend": t} for k, t in enumerate(["better", "stuck", "worse"])]
    a = u.reply(items)
    assert a[0] in ("b1", "b2") and a[1] in ("s1", "s2") and a[2] == "w1"
    assert offline.ScriptedUser(seed=7).reply(items) == a
    # an unused line is preferred over one already said in this dialogue
    said = hist + [{"role": "user", "content": "b1"}, {"role": "assistant", "content": "ok"}]
    assert all(
        offline.ScriptedUser(seed=sd).reply([{"scenario": s, "k": 0, "history": said, "trend": "better"}]) == ["b2"]
        for sd in range(5)
    )


def test_embed_judge_ranks_validating_above_dismissive_on_affective_axis(env):
    judge = offline.EmbedJudge(common.Path(env.HERE) / "data" / "judge_prototypes.json")
    cases = [
        (
            "My dad died last month and I keep replaying our last phone call; I was short with him.",
            "That sounds so painful. Replaying that last call makes sense when you loved him this much, and "
            "one short moment doesn't erase what you were to each other.",
            "Everyone dies eventually. You should just move on and stop dwelling on it.",
        ),
        (
            "I got passed over for the promotion again and I feel humiliated in front of my team.",
            "Being passed over again, in front of people you work with every day, would sting anyone. "
            "It makes sense that you feel humiliated.",
            "Stop complaining, that's just how work is. Get over it.",
        ),
    ]
    for user, validating, dismissive in cases:
        out = judge.judge(
            [
                {"scenario": {}, "history": [{"role": "user", "content": user}], "reply": r}
                for r in (validating, dismissive)
            ]
        )
        v_good, v_bad = (env.levels_to_v(o["levels"]) for o in out)
        assert v_good[1] > v_bad[1], (user, out)
        assert sum(v_good) > sum(v_bad)
    # deterministic, and an empty reply gains nothing
    again = judge.judge([{"scenario": {}, "history": [{"role": "user", "content": cases[0][0]}], "reply": cases[0][1]}])
    assert (
        again[0]["levels"]
        == judge.judge([{"scenario": {}, "history": [{"role": "user", "content": cases[0][0]}], "reply": cases[0][1]}])[
            0
        ]["levels"]
    )
    empty = judge.judge([{"scenario": {}, "history": [{"role": "user", "content": "hi"}], "reply": ""}])
    assert sum(env.levels_to_v(empty[0]["levels"])) < 0


class FakeBackend:
    """Stands in for backends.ChatBackend: answers from a list, records what it was asked."""

    def __init__(self, answers):
        self.answers, self.asked = list(answers), []

    def chat(self, conversations, max_tokens=256, temperature=0.0):
        self.asked.append(conversations)
        return [self.answers.pop(0) if self.answers else None for _ in conversations]


GOOD = '{"C": {"progress": 2, "negative": 0}, "A": {"progress": 1, "negative": 1}, "P": {"progress": 0, "negative": 0}}'


def test_llm_judge_retries_malformed_output_then_fails_the_turn(env):
    case = {
        "scenario": {"persona": "Ana, 30", "situation": "lost her job"},
        "history": [{"role": "system", "content": "sys"}, {"role": "user", "content": "I lost my job."}],
        "reply": "That must be a shock.",
    }
    fake = FakeBackend(["not json", "```json\n" + GOOD + "\n```"])
    out = env.LLMJudge(fake, retries=2).judge([case])
    assert out[0]["levels"] == {"C": (2, 0), "A": (1, 1), "P": (0, 0)}
    assert len(fake.asked) == 2  # one retry was enough
    prompt = fake.asked[0][0][0]["content"]
    assert "Ana, 30" in prompt and "Supporter: That must be a shock." in prompt and "MDEP-PR" in prompt
    assert "sys" not in prompt.split("Conversation so far")[1]  # the system prompt is not shown
    fake = FakeBackend(["{}", "nope", None])
    assert env.LLMJudge(fake, retries=2).judge([case]) == [None]  # judge_failed, never a made-up score
    assert len(fake.asked) == 3


def test_llm_user_sees_the_band_not_the_numbers(env):
    fake = FakeBackend(["  I guess that helps a little.  ", ""])
    s = {"persona": "Ben, 40", "situation": "his shop is failing"}
    hist = [
        {"role": "system", "content": "policy system prompt"},
        {"role": "user", "content": "My shop is failing."},
        {"role": "assistant", "content": "That sounds stressful."},
    ]
    band = env.state_band(13.37, 27.9) + "; " + env.TREND_TEXT["better"]
    out = env.LLMUser(fake).reply(
        [{"scenario": s, "history": hist, "band": band}, {"scenario": s, "history": hist, "band": band}]
    )
    assert out == ["I guess that helps a little.", None]  # an empty answer is a failure
    conv = fake.asked[0][0]
    assert conv[0]["role"] == "system" and "Ben, 40" in conv[0]["content"] and band in conv[0]["content"]
    assert [m["role"] for m in conv[1:]] == ["assistant", "user"]  # roles swapped, policy system dropped
    assert "13.37" not in conv[0]["content"] and "27.9" not in conv[0]["content"] and "0.4" not in conv[0]["content"]
    assert env.state_band(19.0, 20.0).startswith("you still feel very low")
    assert env.state_band(2.0, 20.0).startswith("you feel much better")


def test_judge_and_user_concurrency_flags_bound_the_requests_in_flight(env, fault_server):
    """A served judge / user (vLLM, SGLang): --judge-concurrency 3 and --user-concurrency 2 keep at most
    3 and 2 requests in flight, and use all of them when more are queued (the server counts)."""
    server = fault_server(rate=0.0, delay_s=0.3)
    args = env.parse_args(
        [
            "--judge",
            "api:judge",
            "--user",
            "api:user",
            "--api-base",
            server.base,
            "--judge-concurrency",
            "3",
            "--user-concurrency",
            "2",
        ]
    )
    judge, user = env.make_judge(args), env.make_user(args)
    s = {"id": "s", "persona": "Ana, 30", "situation": "lost her job"}
    hist = [{"role": "user", "content": "I lost my job."}]
    verdicts = judge.judge([{"scenario": s, "history": hist, "reply": f"reply {i}"} for i in range(9)])
    assert all(v is not None for v in verdicts)
    answers = user.reply([{"scenario": s, "k": i, "history": hist, "band": "low"} for i in range(7)])
    assert all(answers)
    assert server.requests == 16 and server.max_active == {"judge": 3, "user": 2}
    assert env.parse_args(["--user", "api:u"]).user_concurrency is None  # default: --api-concurrency
