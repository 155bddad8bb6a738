"""05_eval.py: EPM metrics, loaders, EmoBench scoring, judge-answer parsing, bad inputs, and subprocess runs
of every suite on the tiny random model (with an adapter, --resume, an LLM judge on a loopback server)."""

import importlib
import json
import math
import random
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

import common
import offline
import runs
import sampling
from benchmarks import emobench, eqbench3, sage
from conftest import ROOT, LoopbackServer, ok, prompt_text, run_script, write_jsonl

ev = importlib.import_module("05_eval")
SAMPLES = ROOT / "data" / "eval"
# the REFERENCE worked example: P0 = (-6,-9,-4), v = (1,3,0), (-1,1,1), (3,-1,1) as MDEP-PR levels
P0 = [-6.0, -9.0, -4.0]
VS = [[1, 3, 0], [-1, 1, 1], [3, -1, 1]]
LEVELS = [
    {"C": (1, 0), "A": (2, 0), "P": (0, 0)},
    {"C": (1, 1), "A": (1, 0), "P": (1, 0)},
    {"C": (2, 0), "A": (1, 1), "P": (1, 0)},
]


def test_epm_worked_example():
    m = ev.epm_index(P0, VS, LEVELS)
    want = {
        "RDI": 0.393,
        "RDI_idx": 69.65,
        "E_total": 4.596,
        "E_total_idx": 33.21,
        "S_net": 8,
        "S_net_idx": 46.25,
        "rho": 1.532,
        "S_proj": 1.532,
        "rho_idx": 44.22,
        "S_proj_idx": 44.22,
        "tau": 1.751,
        "tau_idx": 62.47,
        "R_pos_idx": 100,
        "Align": 0.532,
        "Align_idx": 76.59,
        "R_pen": 0.667,
        "R_pen_idx": 77.78,
        "Outcome": 49.70,
        "Efficiency": 50.30,
        "Stability": 84.79,
        "EPM": 63.86,
    }
    for k, v in want.items():
        assert m[k] == pytest.approx(v, abs=0.006), k
    assert ev.epm_index(P0, VS, LEVELS, r_pen="points")["EPM"] == pytest.approx(60.89, abs=0.006)
    # per-step direction u_t = -P_{t-1}/||P_{t-1}||: (v1.v* + 5/sqrt(77) + 16/sqrt(70)) / 3
    step = (33 / math.sqrt(133) + 5 / math.sqrt(77) + 16 / math.sqrt(70)) / 3
    assert ev.epm_index(P0, VS, LEVELS, s_proj="step")["S_proj"] == pytest.approx(step)


def test_epm_tau_undefined_and_ci():
    # there and back: P_T = P0, tau undefined -> saved as None, index 0
    m = ev.epm_efficiency(P0, [[1, 1, 1], [-1, -1, -1]])
    assert m["tau"] is None and m["tau_idx"] == 0.0
    mean, half = ev.t_interval([1.0, 2.0, 3.0, 4.0])  # Student t over 4 units: t_{0.975, 3} = 3.182446 (scipy)
    assert mean == 2.5 and half == pytest.approx(3.182446 * math.sqrt(5 / 3) / 2, abs=1e-6)
    assert ev.t_interval([7.0]) == (7.0, None)


def test_eqbench3_sample_and_irregular_text(tmp_path):
    tasks, stats = eqbench3.load(SAMPLES / "eqbench3_sample.txt")
    assert (stats["scenarios"], stats["prompts"]) == (4, 7)
    assert [(t["id"], t["kind"], len(t["prompts"])) for t in tasks] == [
        ("1", "roleplay", 3),
        ("7", "drafting", 2),
        ("15", "roleplay", 1),
        ("402", "analysis", 1),
    ]
    text = (
        "preamble line\r\n####### Prompt1\r\norphan turn\r\n"
        "######## 3|Work Dilemma|A | title with a pipe\r\n\r\n####### Prompt1\r\nfirst\r\n\r\nstill first\r\n"
        "#######Prompt 2\r\nsecond\r\n####### 3:\r\n\r\n"  # an empty third prompt is dropped
        "########   9 |  Family  \r\nno marker yet\r\n####### 1\r\nonly\r\n"
        "######## 10 | Empty | no prompts here\r\n"
        "######## 3 | Dup | same id again\r\n####### Prompt1\r\ndup\r\n"
        "######## 405 | Something | analysis by id\r\n####### 1\r\nread this\r\n#######  2\r\nand this"
    )
    (tmp_path / "odd.txt").write_bytes(text.encode())
    tasks, stats = eqbench3.load(tmp_path / "odd.txt")
    assert [t["id"] for t in tasks] == ["3", "9", "405"]
    assert stats == {"scenarios": 3, "prompts": 5, "ignored_lines": 4, "empty_scenarios": 1, "duplicates": 1}
    assert tasks[0]["prompts"] == ["first\n\nstill first", "second"]
    assert tasks[0]["title"] == "A | title with a pipe" and tasks[0]["category"] == "Work Dilemma"
    assert tasks[1]["category"] == "" and tasks[1]["title"] == "Family"
    assert tasks[2]["kind"] == "analysis" and tasks[2]["prompts"] == ["read this", "and this"]
    (tmp_path / "none.txt").write_text("# nothing\n## Prompt1\n")
    with pytest.raises(common.UserError, match="no scenarios with prompts"):
        eqbench3.load(tmp_path / "none.txt")
    (tmp_path / "bin.txt").write_bytes(b"######## 1 | a | b\n####### 1\n\xff\xfe\n")
    with pytest.raises(common.UserError, match=r"bin.txt:3: not UTF-8"):
        eqbench3.load(tmp_path / "bin.txt")


def test_sage_profiles_including_chinese(tmp_path):
    profiles = sage.load_profiles(SAMPLES / "sage_profiles.jsonl")
    zh = [p for p in profiles if "林晓" in p["player"]][0]
    assert (
        zh["first_talk"].startswith("我被调岗了")
        and zh["cha_group"] == ["要强", "敏感", "倔强"]
        and zh["main_cha"] == "回避型"
    )
    s = sage.scenario(zh)
    assert s["opening"] == zh["first_talk"] and s["user_lines"] is sage.TEXTS["sage_zh_lines"]
    assert [p["language"] for p in profiles] == ["en", "zh", "zh", "en"]
    no_first = [p for p in profiles if "first_talk" not in p][0]  # offline: a short fixed line (main_cha is a type)
    s = sage.scenario(no_first)
    assert (s["opening"], s["opening_from"]) == ("你好。能跟你聊聊吗？有件事一直压在我心里。", "offline line")
    assert sage.scenario(no_first, "儿子又不回来过年了。")["opening"] == "儿子又不回来过年了。"
    assert sage.scenario(profiles[0])["user_lines"] == ev.env.DEFAULT_USER_LINES
    en = {**profiles[0], "first_talk": "  "}  # blank first_talk: not used
    assert sage.scenario(en)["opening"] == "Hi. Can I talk to you about something? It's been weighing on me."
    for p in profiles + [en]:  # no dialogue opens with (part of) its scene
        assert p["scene"][:40] not in sage.scenario(p)["opening"]
    bad = {k: v for k, v in zh.items() if k not in ("task", "_where")}
    write_jsonl(tmp_path / "p.jsonl", [{k: v for k, v in zh.items() if k != "_where"}, bad])
    with pytest.raises(common.UserError, match=r"p.jsonl:2: missing field 'task'"):
        sage.load_profiles(tmp_path / "p.jsonl")


def test_emobench_loaders(tmp_path):
    eu = emobench.load(str(SAMPLES / "emobench_eu.jsonl"), "EU")
    ea = emobench.load(str(SAMPLES / "emobench_ea.jsonl"), "EA")
    assert len(eu) == 6 and len(ea) == 6
    assert {r["language"] for r in eu} == {"en", "zh"} == {r["language"] for r in ea}
    assert "question type" in ea[0] and eu[3]["case"] == "EU-zh-1"
    item = {k: v for k, v in ea[0].items() if k not in ("_where", "case")}
    write_jsonl(tmp_path / "ea.jsonl", [item, {**item, "qid": 9, "label": "not a choice"}])
    with pytest.raises(common.UserError, match=r"ea.jsonl:2: field 'label' is not one of 'choices'"):
        emobench.load(str(tmp_path / "ea.jsonl"), "EA")
    write_jsonl(tmp_path / "ea2.jsonl", [{k: v for k, v in item.items() if k != "question type"}])
    with pytest.raises(common.UserError, match=r"ea2.jsonl:1: missing field 'question type'"):
        emobench.load(str(tmp_path / "ea2.jsonl"), "EA")
    with pytest.raises(common.UserError, match="no_such_file.jsonl: no such file"):  # paths only, no hub names
        emobench.load("no_such_file.jsonl", "EU")


def variants(tmp_path, name, text) -> dict:
    """The same text written plain, with a UTF-8 byte-order mark, with CRLF line ends, and with both."""
    out = {}
    for tag, data in (
        ("plain", text),
        ("bom", "\ufeff" + text),
        ("crlf", text.replace("\n", "\r\n")),
        ("bom_crlf", "\ufeff" + text.replace("\n", "\r\n")),
    ):
        out[tag] = tmp_path / f"{tag}-{name}"
        out[tag].write_bytes(data.encode("utf-8"))
    return out


def as_read(result, path) -> str:
    """A loader's result as text, its own file name replaced (records carry _where = path:line)."""
    return json.dumps(result, ensure_ascii=False, sort_keys=True).replace(str(path), "FILE")


@pytest.mark.parametrize(
    "loader", ["eqbench3", "eqbench3_header_first", "sage", "emobench_eu", "emobench_ea", "scenarios", "read_jsonl"]
)
def test_every_loader_reads_a_bom_and_a_crlf_file_as_the_plain_one(tmp_path, loader):
    source = {
        "eqbench3": SAMPLES / "eqbench3_sample.txt",
        "eqbench3_header_first": SAMPLES / "eqbench3_sample.txt",
        "sage": SAMPLES / "sage_profiles.jsonl",
        "emobench_eu": SAMPLES / "emobench_eu.jsonl",
        "emobench_ea": SAMPLES / "emobench_ea.jsonl",
        "scenarios": ROOT / "data" / "scenarios_test.jsonl",
        "read_jsonl": SAMPLES / "sage_profiles.jsonl",
    }[loader]
    text = source.read_text(encoding="utf-8")
    if loader == "eqbench3_header_first":  # the public file opens with a header: a BOM there lost it
        text = text[text.index("######## 1 |") :]
    if loader == "read_jsonl":  # U+2028 inside a record is no line end
        text += json.dumps({"id": "x", "note": "a\u2028b"}, ensure_ascii=False) + "\n"
    read = {
        "eqbench3": eqbench3.load,
        "eqbench3_header_first": eqbench3.load,
        "sage": sage.load_profiles,
        "emobench_eu": lambda p: emobench.load(str(p), "EU"),
        "emobench_ea": lambda p: emobench.load(str(p), "EA"),
        "scenarios": ev.env.load_scenarios,
        "read_jsonl": runs.read_jsonl,
    }[loader]
    files = variants(tmp_path, source.name, text)
    got = {tag: as_read(read(p), p) for tag, p in files.items()}
    assert got["bom"] == got["plain"] and got["crlf"] == got["plain"] and got["bom_crlf"] == got["plain"]
    n = {
        "eqbench3": 4,
        "eqbench3_header_first": 4,
        "sage": 4,
        "emobench_eu": 6,
        "emobench_ea": 6,
        "scenarios": 8,
        "read_jsonl": 5,
    }[loader]
    result = read(files["bom_crlf"])
    assert len(result[0] if loader.startswith("eqbench3") else result) == n
    if loader.startswith("eqbench3"):
        assert result[1]["prompts"] == 7 and result[0][0]["id"] == "1"
        assert result[0][0]["category"] == "Workplace Dilemma"
    if loader == "read_jsonl":
        assert result[-1]["note"] == "a\u2028b"


def test_json_errors_name_the_column_once(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_text('{"id": 1}\n{"id": "cut off\n', encoding="utf-8")
    with pytest.raises(common.UserError) as e:
        runs.read_jsonl(p)
    assert str(e.value) == f"{p}:2: not valid JSON (Unterminated string starting at column 8)"
    write_jsonl(
        p, [{"id": "a", "first_talk": 3, "player": "p", "scene": "s", "main_cha": "m", "cha_group": [], "task": "t"}]
    )
    with pytest.raises(common.UserError, match=r"x.jsonl:1: field 'first_talk' must be str, got int"):
        sage.load_profiles(p)
    item = json.loads((SAMPLES / "emobench_ea.jsonl").read_text(encoding="utf-8").splitlines()[0])
    write_jsonl(p, [item, {**item, "scenario": "another"}])
    with pytest.raises(common.UserError, match=r"x.jsonl:2: language, qid 'en/1' again \(first on line 1\)"):
        emobench.load(str(p), "EA")


def test_the_chinese_ea_prompt_names_the_question_type_in_chinese():
    ea = emobench.load(str(SAMPLES / "emobench_ea.jsonl"), "EA")
    zh = {it["question type"]: emobench.mcq_prompt(it, "EA", it["choices"]) for it in ea if it["language"] == "zh"}
    assert "最有效的回应是什么" in zh["Response"] and "最有效的行动是什么" in zh["Action"]
    for prompt in zh.values():  # the question line has no English in it
        question = prompt.splitlines()[1]
        assert question.startswith("问题：") and not any("a" <= ch.lower() <= "z" for ch in question)
    en = [emobench.mcq_prompt(it, "EA", it["choices"]) for it in ea if it["language"] == "en"]
    assert "the most effective action for Lena?" in en[0]


def public_like_items(order_seed=None) -> list[dict]:
    """50 EA items ordered like the public file (every English item, then every Chinese one), categories
    of unequal size: en 12/9/6/3, zh 8/6/4/2; order_seed shuffles the lines."""
    base = json.loads((SAMPLES / "emobench_ea.jsonl").read_text(encoding="utf-8").splitlines()[0])
    items = []
    for lang, sizes in (("en", (12, 9, 6, 3)), ("zh", (8, 6, 4, 2))):
        for cat, size in zip("ABCD", sizes):
            items += [{**base, "qid": f"{cat}{i}", "language": lang, "category": cat} for i in range(size)]
    if order_seed is not None:
        random.Random(order_seed).shuffle(items)
    return items


def test_max_cases_samples_by_language_and_category(tmp_path, capsys):
    # largest remainder, level by level: en 20*30/50 = 12, zh 8; en's 12 -> 4.8 3.6 2.4 1.2 -> 5 4 2 1;
    # zh's 8 -> 3.2 2.4 1.6 0.8 -> 3 2 2 1 (the leftover to the largest fractions)
    want = {
        ("en", "A"): 5,
        ("en", "B"): 4,
        ("en", "C"): 2,
        ("en", "D"): 1,
        ("zh", "A"): 3,
        ("zh", "B"): 2,
        ("zh", "C"): 2,
        ("zh", "D"): 1,
    }
    picks = {}
    for order in (None, 1, 2):  # the file's order does not change the counts
        p = write_jsonl(tmp_path / f"ea{order}.jsonl", public_like_items(order))
        for seed in (0, 7):
            args = ev.parse_args(
                ["--suite", "emobench", "--emobench-ea", str(p), "--max-cases", "20", "--seed", str(seed)]
            )
            taken = [it for it in ev.load_suite_data(args)["emobench"] if it["case"].startswith("EA-")]
            got = {k: sum((it["language"], it["category"]) == k for it in taken) for k in want}
            assert got == want, (order, seed)
            picks[order, seed] = sorted(it["case"] for it in taken)
    assert picks[None, 0] == sorted(
        it["case"]
        for it in ev.sample_cases(
            emobench.load(str(tmp_path / "eaNone.jsonl"), "EA"),
            ev.parse_args(["--max-cases", "20"]),
            "emobench EA",
            lambda it: (it["language"], it["category"]),
        )
    )  # the same seed draws the same items
    assert picks[None, 0] != picks[None, 7]
    out = capsys.readouterr().out
    assert (
        "emobench EA: --max-cases 20 of 50, stratified (seed 7): en/A 5/12, en/B 4/9, en/C 2/6, en/D 1/3, "
        "zh/A 3/8, zh/B 2/6, zh/C 2/4, zh/D 1/2" in out
    )
    assert "emobench EU" not in out  # 6 EU items under --max-cases 20: all, no sampling


def test_the_offline_proxy_scores_empty_and_gibberish_replies_clearly_below_a_supportive_one():
    judge = offline.EmbedJudge(ROOT / "data" / "judge_prototypes.json")
    task = eqbench3.load(SAMPLES / "eqbench3_sample.txt")[0][0]
    replies = {
        "empty": "",
        "gibberish": "blorp fzzt quaxle wub wub zindo prrk.",
        "keyword salad": "meeting manager mock-ups VP launch Greg credit onboarding redesign weeks",
        "supportive": "I'm thinking that Greg took credit for six weeks of my work on the onboarding "
        "redesign, and I feel hurt and angry, but I also want to handle it well. He is "
        "probably feeling pressure to look good for the VP. I'll reply: 'Happy to send them. "
        "Before I do, can we talk about how the redesign was presented? I'd like my role to "
        "be visible.'",
    }
    convs = [
        [{"role": "user", "content": task["prompts"][0]}, {"role": "assistant", "content": r}] for r in replies.values()
    ]
    scores = eqbench3.proxy_scores(convs, [eqbench3.ROLEPLAY_CRITERIA] * len(convs), judge)
    score = {k: 5 * sum(s.values()) / len(s) for k, s in zip(replies, scores)}
    assert score["empty"] == 25.0 and score["keyword salad"] == 25.0  # negative 1 on every axis: 5/20 each
    assert score["supportive"] >= 60.0
    assert all(score["supportive"] - score[k] >= 30.0 for k in ("empty", "gibberish", "keyword salad")), score


def old_option_logliks(model, tok, questions) -> list[list[float]]:
    """The path before the shared prompt: prompt + option as one row, the whole row run for every option."""
    import torch

    out = []
    with torch.no_grad():
        for q in questions:
            prompt = common.render_ids(tok, [{"role": "user", "content": q["prompt"]}])
            opts = [tok(o, add_special_tokens=False)["input_ids"] for o in q["options"]]
            ids, attn, mask = sampling.right_pad(
                [prompt + o for o in opts], tok.pad_token_id, [[(len(prompt), len(prompt) + len(o))] for o in opts]
            )
            lp = sampling.token_logprobs(model, ids, attn, mask)
            out.append([x.mean().item() for x in lp.split([len(o) for o in opts])])
    return out


def test_emobench_shared_prompt_scoring_gives_the_old_choices_on_the_sample(tiny_model):
    import torch
    from transformers import AutoModelForCausalLM

    tok = common.load_tokenizer(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    eu = emobench.load(str(SAMPLES / "emobench_eu.jsonl"), "EU")
    ea = emobench.load(str(SAMPLES / "emobench_ea.jsonl"), "EA")
    questions = (
        [{"prompt": emobench.mcq_prompt(it, "EA", it["choices"]), "options": it["choices"]} for it in ea]
        + [
            {"prompt": emobench.mcq_prompt(it, "emotion", it["emotion_choices"]), "options": it["emotion_choices"]}
            for it in eu
        ]
        + [
            {
                "prompt": emobench.mcq_prompt(it, "cause", it["cause_choices"], it["emotion_label"]),
                "options": it["cause_choices"],
            }
            for it in eu
        ]
    )
    old = old_option_logliks(model, tok, questions)
    for batch_size in (1, 3, 8):  # options in one batch, or split across several
        new = emobench.option_logliks(model, tok, questions, batch_size)
        assert [max(range(len(s)), key=s.__getitem__) for s in new] == [
            max(range(len(s)), key=s.__getitem__) for s in old
        ]
        for a, b in zip(new, old):
            assert a == pytest.approx(b, rel=1e-4, abs=1e-5)


def test_emobench_scoring_with_a_fake_scorer():
    eu = emobench.load(str(SAMPLES / "emobench_eu.jsonl"), "EU")
    ea = emobench.load(str(SAMPLES / "emobench_ea.jsonl"), "EA")
    asked = []

    def fake(questions):
        """Knows every answer, except: the cause of EU-en-2 and the EA answer for EA-zh-3."""
        asked.extend(q["prompt"] for q in questions)
        picks = []
        for q in questions:
            it = next(x for x in eu + ea if x["scenario"] in q["prompt"])
            gold = it.get("label") or (
                it["emotion_label"] if q["options"] == it["emotion_choices"] else it["cause_label"]
            )
            wrong = (it["case"] == "EU-en-2" and q["options"] == it["cause_choices"]) or it["case"] == "EA-zh-3"
            picks.append((q["options"].index(gold) + 1) % len(q["options"]) if wrong else q["options"].index(gold))
        return picks

    cases = emobench.cases(eu, "EU", fake) + emobench.cases(ea, "EA", fake)
    by = {c["case"]: c for c in cases}
    assert by["EU-en-2"]["emotion_correct"] == 1 and by["EU-en-2"]["cause_correct"] == 0
    assert by["EU-en-2"]["correct"] == 0  # EU needs both the emotion and the cause
    assert by["EA-zh-3"]["correct"] == 0
    assert sum(c["correct"] for c in cases) == 10
    assert any("Why would Rosa feel Pride and grief" in p for p in asked)  # the cause names the chosen emotion
    assert any("为什么小林在这种情况下会感到失落和委屈" in p for p in asked)
    s = ev.summarize(cases, "emobench")  # per task and language, never pooled
    assert s["EU en"]["accuracy"][0] == pytest.approx(200 / 3) and s["EU zh"]["accuracy"][0] == 100.0
    assert s["EA en"]["n"] == 3 and s["EA zh"]["accuracy"][0] == pytest.approx(200 / 3)
    assert s["EA zh"]["by_category"]["Personal-Personal"] == 0.0
    assert s["protocol"] == "option log-likelihood (not the official protocol)" and s["EU en"]["unparseable"] is None


class FakeChat:
    """A chat backend that answers from a list in turn and records the conversations it was asked."""

    def __init__(self, answers):
        self.answers, self.asked, self.spec, self.failures = list(answers), [], "api:fake", 0

    def chat(self, conversations, max_tokens=256, temperature=0.0):
        self.asked += conversations
        return [self.answers.pop(0) for _ in conversations]


def test_an_llm_user_writes_the_first_message_without_reciting_the_scene():
    profiles = sage.load_profiles(SAMPLES / "sage_profiles.jsonl")
    no_first = [p for p in profiles if "first_talk" not in p][0]
    args = type("A", (), {"judge_retries": 1})()
    # first answer recites the scene (rejected, asked again), the second is the character speaking
    user = type("U", (), {"backend": FakeChat([no_first["scene"] + " 我该怎么办？", "  儿子今年又不回家过年了。  "])})()
    written = sage.openings(profiles, user, args)
    assert written == {no_first["id"]: "儿子今年又不回家过年了。"}
    assert len(user.backend.asked) == 2 and no_first["player"] in user.backend.asked[0][0]["content"]
    assert "personality type: 被动型" in user.backend.asked[0][0]["content"]
    s = sage.scenario(no_first, written[no_first["id"]])
    assert (s["opening"], s["opening_from"]) == ("儿子今年又不回家过年了。", "user model")
    assert sage.openings(profiles, offline.ScriptedUser(0), args) == {}  # scripted: the offline line


def test_option_loglik_matches_a_direct_computation(tiny_model):
    import torch
    from transformers import AutoModelForCausalLM

    tok = common.load_tokenizer(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    q = {
        "prompt": "I feel so alone since my dad died.",
        "options": ["That sounds really painful.", "What happened next?", "alone", "我很难过"],
    }
    got = emobench.option_logliks(model, tok, [q, q], batch_size=3)  # the options in padded batches of 3 and 1
    prompt = ev.common.render_ids(tok, [{"role": "user", "content": q["prompt"]}])
    want = []
    with torch.no_grad():
        for o in q["options"]:  # mean_j log pi(o_j | prompt, o_<j) from the full logits
            ids = tok(o, add_special_tokens=False)["input_ids"]
            logp = model(torch.tensor([prompt + ids])).logits[0].log_softmax(-1)
            want.append(sum(logp[len(prompt) - 1 + j, x].item() for j, x in enumerate(ids)) / len(ids))
    assert got[0] == pytest.approx(want, abs=1e-4) and got[1] == pytest.approx(want, abs=1e-4)


def test_judge_answer_parsing():
    crit = eqbench3.ROLEPLAY_CRITERIA
    good = "Sure.\n```json\n" + json.dumps({c: 12 for c in crit}) + "\n```"
    assert eqbench3.parse_criteria(good, crit) == {c: 12.0 for c in crit}
    assert eqbench3.parse_criteria(json.dumps({c: "7" for c in crit}), crit)["pragmatic_ei"] == 7.0
    assert eqbench3.parse_criteria(json.dumps({c: 21 for c in crit}), crit) is None  # out of 0-20
    assert eqbench3.parse_criteria(json.dumps({crit[0]: 5}), crit) is None  # a criterion missing
    assert eqbench3.parse_criteria("no json", crit) is None and eqbench3.parse_criteria(None, crit) is None
    assert sage.parse_change('{"analysis": "ok", "change": 4}') == 4.0
    assert sage.parse_change('{"change": -25}') == -10.0  # clipped
    assert sage.parse_change("analysis... change: +3") == 3.0
    assert sage.parse_change('{"change": "a lot"}') is None and sage.parse_change("") is None


@pytest.mark.parametrize(
    "flags, make, message",
    [
        (["--suite", "empa,nope"], None, "--suite: unknown suite(s) ['nope']"),
        (["--adapters", "/no/such/adapter"], None, "--adapters /no/such/adapter: no adapter_config.json"),
        (["--sage-turns", "0"], None, "argument --sage-turns: must be >= 1, got 0"),
        (["--adapter", "x"], None, "05_eval.py takes --adapters"),
        (
            ["--suite", "sage", "--sage-profiles", "{p}"],
            '{"id": 1}\n{"id": 2, oops}\n',
            "p.jsonl:1: missing field 'player'",
        ),
        (["--suite", "sage", "--sage-profiles", "{p}"], None, "p.jsonl:2: not valid JSON"),
        (
            ["--suite", "emobench", "--emobench-eu", "{p}"],
            '{"qid": "1", "language": 3}\n',
            "p.jsonl:1: field 'language' must be str",
        ),
        (["--suite", "eqbench3", "--eqbench3", "{p}"], "just text\n", "no scenarios with prompts"),
    ],
)
def test_bad_inputs_exit_2_with_one_message(tmp_path, capsys, flags, make, message):
    p = tmp_path / "p.jsonl"
    profile = json.loads((SAMPLES / "sage_profiles.jsonl").read_text(encoding="utf-8").splitlines()[0])
    p.write_text(make if make is not None else json.dumps(profile) + "\n{not json\n", encoding="utf-8")
    out = tmp_path / "runs"
    with pytest.raises(SystemExit) as e:
        common.run_main(ev.main, [f.format(p=p) for f in flags] + ["--out-dir", str(out)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1
    assert not out.exists()  # nothing written for a rejected run


@pytest.fixture(scope="module")
def tiny_adapter(tiny_model, tmp_path_factory):
    """A LoRA adapter with random (non-zero) B matrices: the adapted model differs from the base."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
    )
    torch.manual_seed(1)
    for n, p in model.named_parameters():
        if "lora_B" in n:
            p.data.normal_(0, 0.5)
    out = tmp_path_factory.mktemp("adapter")
    model.save_pretrained(out)
    return str(out)


TINY = [
    "--max-turns",
    "2",
    "--min-turns",
    "1",
    "--sage-turns",
    "2",
    "--max-new-tokens",
    "6",
    "--max-cases",
    "4",
    "--batch-size",
    "3",
    "--no-progress",
]


def only_run(out_dir):
    runs = [p for p in Path(out_dir).iterdir() if p.is_dir()]
    assert len(runs) == 1, runs
    return runs[0]


def test_eval_script_all_suites_with_an_adapter_then_resume(tiny_model, tiny_adapter, tmp_path):
    p = run_script("05_eval.py", "--model", tiny_model, "--adapters", tiny_adapter, "--out-dir", tmp_path, *TINY)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "eqbench3: read 4 scenarios and 7 prompts" in p.stdout
    assert "empa: --max-cases 4 of 8, stratified (seed 0): cognitive " in p.stdout and "proactive 1/2" in p.stdout
    assert "emobench EU: --max-cases 4 of 6" in p.stdout and "eqbench3: --max-cases" not in p.stdout  # 4 of 4: all
    run = only_run(tmp_path)
    lines = (run / "cases.jsonl").read_text(encoding="utf-8").splitlines()
    recs = [json.loads(x) for x in lines]
    # per model: 4 EMPA scenarios x K=1, 4 EQ-Bench tasks, 4 SAGE profiles, 4 EU + 4 EA items
    for model in ("base", tiny_adapter):
        got = {s: sum(r["model"] == model and r["suite"] == s for r in recs) for s in ev.SUITES}
        assert got == {"empa": 4, "eqbench3": 4, "sage": 4, "emobench": 8}, (model, got)
    by = {(r["model"], r["suite"], r["case"]): r for r in recs}
    empa = next(r for (m, s, _), r in by.items() if (m, s) == ("base", "empa"))
    assert empa["outcome"] in ("success", "failure", "timeout") and len(empa["distances"]) == empa["turns"] + 1
    assert 0 <= empa["R_pos_idx"] <= 100 and "EPM" in empa and "tau" in empa
    zh = by[("base", "sage", "sage-zh-1")]  # a Chinese profile ran, with a warning
    assert p.stderr.count("sage: Chinese profiles with the offline judge") == 1  # once, not per batch or model
    assert zh["emotions"][0] == 40 and all(abs(c) <= 10 for c in zh["changes"]) and not zh["failed"]
    assert {r["language"] for r in recs if r["suite"] == "emobench"} == {"en", "zh"}
    eq = by[("base", "eqbench3", "402")]  # offline: an analysis task is not scored
    assert eq["kind"] == "analysis" and eq["unscored"] == "not scored (needs an LLM judge)" and not eq["failed"]
    assert "score" not in eq and eq["replies"] == 0
    rp = by[("base", "eqbench3", "1")]
    assert rp["proxy"] and rp["score"] == pytest.approx(5 * sum(rp["criteria"].values()) / 6)
    sage_cases = [r for r in recs if r["suite"] == "sage"]  # the profile without first_talk: not its scene
    assert {r["case"]: r["opening"] for r in sage_cases if r["model"] == "base"}["sage-zh-2"] == "offline line"

    # the adapter is really applied: its EmoBench log-likelihood choices are not the base's, or EMPA differs
    def same(a, b):
        return {k: v for k, v in a.items() if k != "model"} == {k: v for k, v in b.items() if k != "model"}

    assert not all(same(by[("base", s, c)], by[(tiny_adapter, s, c)]) for (m, s, c) in by if m == "base")
    table = (run / "results.md").read_text(encoding="utf-8")
    assert "base weights: fp32 (--load-in-4bit off)" in table  # evaluation is not 4-bit unless asked
    assert "EMPA-style, not the EMPA benchmark: MICA's public end rules (2 turns, none before turn 1, " in table
    assert "and K = 1 dialogues per scenario (the benchmark plays one: --k 1). R_pen counts negative levels" in table
    assert (
        "| model | EMPA EPM-Index | EMPA success % | EQ-Bench 3 (offline proxy, not comparable with EQ-Bench 3) | "
        "SAGE Sentient (this project's variant, not the official protocol) |"
    ) in table
    assert "| base | " in table and f"| {tiny_adapter} | " in table and "(n=4)" in table
    assert "± " in table and "(4 scenarios, 4 dialogues)" in table  # EMPA's cell names its unit and its count
    assert "(n=3); 1 analysis not scored (needs an LLM judge) |" in table
    assert "(offline proxy, not comparable with EQ-Bench 3) |" in p.stdout
    res = json.loads((run / "results.json").read_text(encoding="utf-8"))
    assert res["summary"]["base"]["sage"]["n"] == 4 and len(res["cases"]) == len(recs)
    assert "EQ-Bench 3 (offline proxy, not comparable with EQ-Bench 3)" in res["columns"]
    assert res["summary"]["base"]["eqbench3"]["proxy"]
    assert (res["summary"]["base"]["eqbench3"]["n"], res["summary"]["base"]["eqbench3"]["unscored"]) == (3, 1)
    # the adapter against the base on EMPA, paired by scenario (04's held-out comparison lives here now)
    assert f"held out: {tiny_adapter} vs base on 4 scenarios, 4 dialogues paired" in p.stdout
    assert res["comparison"][tiny_adapter]["idr_return"]["scenarios"] == 4
    transcripts = [json.loads(x) for x in (run / "transcripts.jsonl").read_text(encoding="utf-8").splitlines()]
    profiles = {p["id"]: p for p in sage.load_profiles(SAMPLES / "sage_profiles.jsonl")}
    for t in (t for t in transcripts if t["suite"] == "sage"):  # no SAGE dialogue opens with its scene
        assert profiles[t["case"]]["scene"][:40] not in t["turns"][0]["user"]
    assert (run / "distance_per_turn.png").exists() and (run / "emotion_per_turn.png").exists()
    assert "| EmoBench EA zh % |" in p.stdout
    assert "EmoBench: option log-likelihood (not the official protocol)" in p.stdout

    # a kill mid-way: the last 10 cases lost, one half-written line left; --resume cuts it (runs.open_run)
    # and redoes only those
    keep = 30
    (run / "cases.jsonl").write_text("\n".join(lines[:keep]) + "\n" + lines[keep][:25], encoding="utf-8")
    q = run_script("05_eval.py", "--model", tiny_model, "--adapters", tiny_adapter, "--resume", run, *TINY)
    assert q.returncode == 0, q.stderr[-3000:]
    assert f"{keep} cases finished; batches of finished cases are skipped" in q.stdout
    assert "removed a torn last line" in q.stderr
    after = (run / "cases.jsonl").read_text(encoding="utf-8").splitlines()
    assert after[:keep] == lines[:keep]  # finished cases untouched
    redone = [json.loads(x) for x in after[keep:]]  # the torn line was cut, then redone

    def key(r):
        return r["model"], r["suite"], r["case"]

    # the lost cases and the rest of the batch the kill cut, in the first run's order
    assert len(redone) >= len(recs) - keep
    assert [key(r) for r in redone] == [key(r) for r in recs[len(recs) - len(redone) :]]
    # a batch cut by the kill runs again whole, with its seed and batch-mates: every case as the first run had it
    first = {key(r): r for r in recs}
    assert all(r == first[key(r)] for r in redone), [key(r) for r in redone if r != first[key(r)]]
    assert json.loads((run / "results.json").read_text())["summary"][tiny_adapter]["emobench"]["n"] == 8


def test_eval_with_an_llm_judge_on_a_loopback_server_then_endpoint_down(tiny_model, tmp_path):
    """EQ-Bench criteria and SAGE changes asked of an OpenAI-compatible judge on 127.0.0.1 (sometimes
    malformed: retried); the key reaches the server and no file; then a dead endpoint stops the run."""
    calls = {"eq": 0, "sage": 0, "opening": 0}

    def respond(index, body):  # called under the server's lock
        text = prompt_text(body)
        if "EQ-Bench" in text:
            calls["eq"] += 1
            crit = eqbench3.ANALYSIS_CRITERIA if "task (analysis)" in text else eqbench3.ROLEPLAY_CRITERIA
            return ok("hmm" if calls["eq"] == 1 else json.dumps({c: 10 for c in crit}))
        if "Write the first message you send" in text:  # the LLM user opens a profile without first_talk
            calls["opening"] += 1
            return ok("我儿子今年又不回家过年了。")
        if "role-playing a person" in text:  # the LLM user's later turns
            return ok("嗯，也许吧。")
        calls["sage"] += 1
        return ok('{"analysis": "a bit better", "change": 15}')

    flags = ["--model", tiny_model, "--suite", "eqbench3,sage", "--judge", "api:judge", *TINY]
    with LoopbackServer(respond) as server:
        p = run_script(
            "05_eval.py",
            *flags,
            "--user",
            "api:user",
            "--api-base",
            server.base,
            "--out-dir",
            tmp_path / "ok",
            env_extra={"OPENAI_API_KEY": "sk-test-secret-42"},
        )
    assert p.returncode == 0, p.stderr[-3000:]
    assert server.auth == {"Bearer sk-test-secret-42"} and calls["eq"] == 5 and calls["sage"] >= 4
    recs = [json.loads(x) for x in (only_run(tmp_path / "ok") / "cases.jsonl").read_text().splitlines()]
    assert all(r["score"] == 50.0 for r in recs if r["suite"] == "eqbench3")  # 10/20 x 5, analysis too
    assert {r["case"] for r in recs if r["suite"] == "eqbench3"} >= {"402"} and "offline proxy" not in p.stdout
    assert "| EQ-Bench 3 (this project's judge prompt, not comparable with EQ-Bench 3) |" in p.stdout
    assert calls["opening"] == 1 and {r["case"]: r["opening"] for r in recs if r["suite"] == "sage"} == {
        "sage-en-1": "first_talk",
        "sage-zh-1": "first_talk",
        "sage-zh-2": "user model",
        "sage-en-2": "first_talk",
    }
    opened = [json.loads(x) for x in (only_run(tmp_path / "ok") / "transcripts.jsonl").read_text().splitlines()]
    assert [t["turns"][0]["user"] for t in opened if t["case"] == "sage-zh-2"] == ["我儿子今年又不回家过年了。"]
    sage_cases = [r for r in recs if r["suite"] == "sage"]
    assert len(sage_cases) == 4 and all(r["emotions"] == [40, 50, 60] for r in sage_cases)  # +15 clipped to +10
    for f in only_run(tmp_path / "ok").rglob("*"):
        assert "sk-test-secret-42" not in f.read_bytes().decode(errors="ignore"), f
    assert "sk-test-secret-42" not in p.stdout + p.stderr

    with socket.socket() as s:  # a port on which nothing listens
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    q = run_script(
        "05_eval.py",
        *flags,
        "--api-base",
        f"http://127.0.0.1:{port}/v1",
        "--api-retries",
        "0",
        "--api-timeout",
        "2",
        "--out-dir",
        tmp_path / "down",
    )
    assert q.returncode == 2, q.stderr[-2000:]
    assert "eqbench3 judge api:judge: no usable answer for any of 3 cases" in q.stderr
    assert "continue with --resume" in q.stderr and "Traceback" not in q.stderr
    assert (only_run(tmp_path / "down") / "results.md").exists()


def test_naturalness_is_each_replys_mean_log_likelihood_under_the_base(tiny_model):
    """nat_t = the mean log pi_base of reply t's tokens in its dialogue's context, by hand from a full forward;
    with an adapter applied (and moving the logits) the value is still the base's; an empty reply is None."""
    import argparse

    import torch
    from peft import LoraConfig, get_peft_model

    env = importlib.import_module("03_rollout")
    args = argparse.Namespace(
        model=tiny_model, adapter=None, load_in_4bit="off", trust_remote_code=False, gradient_checkpointing=False
    )
    model, tok = common.load_policy(args, trainable=False)
    trajs = [
        env.Trajectory(
            scenario={}, k=0, ids=[(3 * j) % 200 + 5 for j in range(30)], messages=[], spans=[(4, 9), (15, 22)]
        ),
        env.Trajectory(
            scenario={}, k=1, ids=[(7 * j) % 200 + 5 for j in range(12)], messages=[], spans=[(3, 8), (10, 10)]
        ),
    ]  # its second reply is empty
    with torch.no_grad():
        want = []
        for tr in trajs:
            logp = torch.log_softmax(model(input_ids=torch.tensor([tr.ids])).logits[0].float(), -1)
            want.append(
                [
                    float(torch.stack([logp[i - 1, tr.ids[i]] for i in range(s, e)]).mean()) if e > s else None
                    for s, e in tr.spans
                ]
            )
    got = ev.naturalness(model, tok, trajs, batch_size=1)
    assert got[0] == pytest.approx(want[0], abs=1e-4) and got[1][0] == pytest.approx(want[1][0], abs=1e-4)
    assert got[1][1] is None
    adapted = get_peft_model(
        model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    with torch.no_grad():
        moved = adapted(input_ids=torch.tensor([trajs[0].ids])).logits
        with adapted.disable_adapter():
            assert not torch.allclose(moved, adapted(input_ids=torch.tensor([trajs[0].ids])).logits)
    assert ev.naturalness(adapted, tok, trajs, batch_size=2)[0] == pytest.approx(want[0], abs=1e-4)


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_one_rule_labels_the_official_checkout_of_every_benchmark(tmp_path):
    import benchmarks

    def git(folder, *argv):
        cmd = ["git", "-C", str(folder), "-c", "user.name=t", "-c", "user.email=t@t", *argv]
        return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()

    root, files = tmp_path / "official", ["a.txt", "sub/b.txt"]
    (root / "sub" / "deep").mkdir(parents=True)
    for name in ("a.txt", "sub/b.txt", "sub/deep/d.txt", "notes.txt"):
        (root / name).write_text(name, encoding="utf-8")
    assert benchmarks.checkout(root, files) is None  # no repository
    git(root, "init", "-q")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "x")
    head = git(root, "rev-parse", "HEAD")
    assert benchmarks.checkout(root, files) == (head, False) and len(head) == 40  # clean: the commit
    (root / "notes.txt").write_text("changed", encoding="utf-8")  # a file the protocol does not read
    assert benchmarks.checkout(root, files) == (head, False)
    (root / "sub" / "b.txt").write_text("changed", encoding="utf-8")  # one it reads: + local changes
    assert benchmarks.checkout(root, files) == (head, True)
    git(root, "checkout", "--", "sub/b.txt")
    (root / "a.txt").unlink()  # deleted counts as changed
    assert benchmarks.checkout(root, files) == (head, True)
    git(root, "checkout", "--", "a.txt")
    (root / "c.txt").write_text("new", encoding="utf-8")  # an untracked protocol file: no commit holds it
    assert benchmarks.checkout(root, [*files, "c.txt"]) is None
    # a folder below the top: only with outer, one level down (SAGE in Tencent/digitalhuman), never deeper
    assert benchmarks.checkout(root / "sub", ["b.txt"]) is None
    assert benchmarks.checkout(root / "sub", ["b.txt"], outer=True) == (head, False)
    assert benchmarks.checkout(root / "sub" / "deep", ["d.txt"], outer=True) is None
    # the three benchmarks label by it: each fixture committed with one protocol file left untracked
    for name, untracked in (
        ("eqbench3", "data/debrief_prompt.txt"),
        ("emobench", "src/utils.py"),
        ("sage", "SAGE/npc_response.py"),
    ):
        shutil.copytree(ROOT / "tests" / "fixtures" / name, tmp_path / name)
        git(tmp_path / name, "init", "-q")
        git(tmp_path / name, "add", "-A")
        git(tmp_path / name, "rm", "-q", "--cached", untracked)
        git(tmp_path / name, "commit", "-qm", "x")
    assert eqbench3.git_commit(tmp_path / "eqbench3") == "no commit (not a git checkout)"
    assert (
        emobench.protocol_label(tmp_path / "emobench")
        == f"official protocol ({tmp_path / 'emobench'}, not a git checkout)"
    )
    assert sage.git_commit(tmp_path / "sage" / "SAGE") == f"{tmp_path / 'sage' / 'SAGE'} (not a git checkout)"
    git(tmp_path / "sage", "add", "-A")
    git(tmp_path / "sage", "commit", "-qm", "y")
    assert sage.git_commit(tmp_path / "sage" / "SAGE") == git(tmp_path / "sage", "rev-parse", "HEAD")[:12]


@pytest.mark.parametrize(
    "diffs, verdict",
    [
        ([0.5, 0.5], "too few scenarios to tell (2)"),  # 2 scenarios: no verdict
        ([0.5, 0.7], "too few scenarios to tell (2)"),  # a spread, but 2 scenarios
        ([0.5, 0.5, 0.5], "no spread over 3 scenarios: every scenario's difference is +0.500"),  # identical
        # equal differences whose float mean is off in the last bit (sd 1.7e-17): still no spread, not "ahead"
        ([0.1, 0.1, 0.1], "no spread over 3 scenarios: every scenario's difference is +0.100"),
        ([1.0, 1.1, 0.9], "ahead beyond the spread"),  # mean 1, half 4.303 * 0.1 / sqrt 3 = 0.248: [0.752, 1.248]
        ([1.0, -1.0, 0.3], "not separated"),
    ],
)
def test_a_verdict_needs_three_scenarios_and_a_spread(diffs, verdict):
    records = []
    for i, d in enumerate(diffs):
        for model, x in (("base", 0.0), ("A", d)):
            records.append(
                {
                    "model": model,
                    "suite": "empa",
                    "case": f"s{i}#0",
                    "idr_return": x,
                    "collapse": 0.0,
                    "cut_off": 0.0,
                    "naturalness": -2.0,
                }
            )
    lines, out = ev.compare_with_base(records, ["A"])
    assert out["A"]["idr_return"]["verdict"] == verdict and lines[1].endswith(f"]: {verdict}")
    if len(diffs) == 3 and verdict == "ahead beyond the spread":
        assert out["A"]["idr_return"]["ci"] == pytest.approx(
            [1 - 4.303 * 0.1 / 3**0.5, 1 + 4.303 * 0.1 / 3**0.5], abs=2e-3
        )
    if verdict.startswith("no spread"):  # the interval is the point itself
        assert out["A"]["idr_return"]["ci"] == [out["A"]["idr_return"]["diff"]] * 2
    n = len(diffs)  # naturalness is equal in both models: a difference of 0 in every scenario
    same = (
        f"too few scenarios to tell ({n})"
        if n < 3
        else f"no spread over {n} scenarios: every scenario's difference is +0.000"
    )
    assert out["A"]["naturalness"]["verdict"] == same and out["A"]["naturalness"]["ci"] == [0.0, 0.0]


def test_a_suite_whose_every_case_failed_writes_its_row():
    """Every EMPA case failed (the judge never gave a verdict: SmolLM2 judging itself, as make rehearsal found): the
    table's row says how many failed, with no measure, and the adapter's row beside it is unharmed."""
    failed = [{"case": f"s{i}#0", "failed": True} for i in range(3)]
    done = [{"case": "s0#0", "EPM": 1.0, "outcome": "success", **{k: 1.0 for k in ev.EPM_KEYS}}]
    summary = {"base": {"empa": ev.summarize(failed, "empa")}, "a": {"empa": ev.summarize(done + failed[1:], "empa")}}
    lines = ev.results_table(summary, ["empa"]).splitlines()
    assert lines[2] == "| base | - (3 failed) | - |"
    assert lines[3].startswith("| a | 1.00 (1 scenarios, 1 dialogues); 2 failed | 100.00 |")
