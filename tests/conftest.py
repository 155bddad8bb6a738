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
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    out = tmp_path_factory.mktemp("tiny_qwen2")
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
