"""Shared fixtures: a tiny random Qwen2 model with a locally trained BPE tokenizer and a ChatML chat
template (built once per session in seconds), and the repo root on sys.path."""
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
          "+ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
          "{% endif %}")


def _corpus():
    lines = []
    for name in ("scenarios_train.jsonl", "scenarios_test.jsonl"):
        path = ROOT / "data" / name
        if path.exists():
            lines += [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
    lines += ["I feel so alone since my dad died. That sounds really painful. What happened next?"] * 20
    return lines


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """Path of a saved tiny random Qwen2ForCausalLM (2 layers, hidden 32) + its tokenizer."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"))


def build_tiny_model(out) -> str:
    """Save the tiny random model and its tokenizer into folder `out` (scripts import this too:
    `sys.path.insert(0, "tests"); from conftest import build_tiny_model`)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    Path(out).mkdir(parents=True, exist_ok=True)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(_corpus(), trainers.BpeTrainer(
        vocab_size=600, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    fast.save_pretrained(out)
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(fast), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id, tie_word_embeddings=True)
    model = Qwen2ForCausalLM(cfg)
    model.generation_config.eos_token_id = fast.eos_token_id
    model.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="session")
def env():
    return importlib.import_module("03_rollout")


@pytest.fixture(scope="session")
def trainer():
    return importlib.import_module("04_mica_train")


def run_script(script, *args, cwd=None, timeout=900, env_extra=None):
    """Run one of the stage scripts as a user would; returns the CompletedProcess."""
    e = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    e.update(env_extra or {})
    return subprocess.run([sys.executable, str(ROOT / script), *map(str, args)], cwd=cwd, env=e,
                          capture_output=True, text=True, timeout=timeout)


def write_jsonl(path, records):
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


JUDGE_OK = ('{"C": {"progress": 1, "negative": 0}, "A": {"progress": 1, "negative": 0}, '
            '"P": {"progress": 0, "negative": 0}}')
USER_OK = "I am not sure. It still hurts when I think about it."
FAULTS = ("http_500", "http_429", "hang", "truncated_json", "not_json", "empty_choices", "missing_fields")


class FaultServer:
    """An OpenAI-compatible /chat/completions server on 127.0.0.1 that injects faults.

    Every request gets a good answer (judge JSON for MDEP-PR prompts, a user line otherwise) except
    a `rate` share of them, spread evenly and deterministically, which get the next fault of FAULTS
    in turn: HTTP 500, 429 with Retry-After: 1, a hang of `hang_s` seconds (past the client's
    timeout), a body cut mid-JSON, a non-JSON body, empty choices, and a reply without the expected
    fields (no content, or judge JSON with its levels missing). `down=True` answers 500 to all.
    `answers`: (marker, answer) pairs for other prompts (05's EQ-Bench and SAGE judges).
    Every answer waits `delay_s` first; `max_active` is the most judge / user requests in flight at once."""

    def __init__(self, rate=0.3, hang_s=2.5, judge_answer=JUDGE_OK, user_answer=USER_OK, answers=(), delay_s=0.0):
        import http.server
        import threading

        self.rate, self.hang_s, self.down = rate, hang_s, False
        self.judge_answer, self.user_answer = judge_answer, user_answer
        self.answers = list(answers)    # (marker, answer): a prompt holding the marker gets the answer
        self.requests, self.faults, self.auth = 0, {k: 0 for k in FAULTS}, set()
        self.delay_s, self.active, self.max_active = delay_s, {"judge": 0, "user": 0}, {"judge": 0, "user": 0}
        self.lock = threading.Lock()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def send(self, code, body: bytes, headers=(), declared=None):
                self.send_response(code)
                for k, v in headers:
                    self.send_header(k, v)
                self.send_header("Content-Length", str(declared if declared is not None else len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self):
                import time as _time

                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                judge = "MDEP-PR" in json.dumps(body["messages"])
                kind = "judge" if judge else "user"
                with server.lock:
                    server.active[kind] += 1
                    server.max_active[kind] = max(server.max_active[kind], server.active[kind])
                _time.sleep(server.delay_s)
                with server.lock:            # counted down before answering: the client can't overlap it
                    server.active[kind] -= 1
                    server.requests += 1
                    n = server.requests
                    server.auth.add(self.headers.get("Authorization"))
                    fault = None
                    if server.down:
                        fault = "http_500"
                    elif int(n * server.rate) != int((n - 1) * server.rate):   # rate share, evenly
                        fault = FAULTS[sum(server.faults.values()) % len(FAULTS)]
                    if fault:
                        server.faults[fault] += 1
                text = json.dumps(body["messages"], ensure_ascii=False)
                answer = next((a for marker, a in server.answers if marker in text),
                              server.judge_answer if judge else server.user_answer)
                good = json.dumps({"choices": [{"message": {"role": "assistant", "content": answer}}]}).encode()
                try:
                    if fault == "http_500":
                        self.send(500, b'{"error": "internal"}')
                    elif fault == "http_429":
                        self.send(429, b'{"error": "rate limited"}', [("Retry-After", "1")])
                    elif fault == "hang":
                        _time.sleep(server.hang_s)
                        self.send(200, good)
                    elif fault == "truncated_json":
                        self.send(200, good[: len(good) // 2], declared=len(good))
                        self.close_connection = True
                    elif fault == "not_json":
                        self.send(200, b"<html>502 Bad Gateway</html>")
                    elif fault == "empty_choices":
                        self.send(200, b'{"choices": []}')
                    elif fault == "missing_fields":
                        bad = '{"C": {"progress": 1}}' if judge else None
                        msg = {"role": "assistant", **({"content": bad} if bad else {})}
                        self.send(200, json.dumps({"choices": [{"message": msg}]}).encode())
                    else:
                        self.send(200, good)
                except (BrokenPipeError, ConnectionResetError):
                    pass                                   # the client gave up (timeout): fine

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.base = f"http://127.0.0.1:{self.httpd.server_port}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fault_server():
    servers = []

    def start(**kw):
        servers.append(FaultServer(**kw))
        return servers[-1]

    yield start
    for s in servers:
        s.close()
