"""sampling.py: what the policy samples and what the loss scores, side by side, so that a reader sees they agree.

  the sampler   generate_batch -> generate: left-padded contexts (left_pad), the shared prefix of identical rows
                prefilled once (prefill_distinct), softmax(logits / temperature) built from the caller's arguments
                alone (only_this_generation_config: nothing inherited from the model's generation_config.json),
                each drawn token's log-probability kept by SamplerLogprobs; a Reply per context, up to the first
                end-of-turn id (end_of_turn_ids)
  the scorer    token_logprobs: log pi(y_i) of the masked tokens of right-padded rows (right_pad), the LM head
                run in chunks of LOGIT_CHUNK logits, the logits transformed as the model's forward does
                (final_logits), divided by the same temperature; scoring_gap measures the two against each other
                at load (common.load_policy refuses a model whose gap is large)
02, 03, 04 and 05 sample and score through here; engine.py's vLLM client returns the same Reply.
Imports nothing of the project: common.py imports it (load_policy's check).
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch


def left_pad(rows: list[list[int]], pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    L = max(len(r) for r in rows)
    ids = torch.tensor([[pad] * (L - len(r)) + r for r in rows], device=device)
    return ids, torch.tensor([[0] * (L - len(r)) + [1] * len(r) for r in rows], device=device)


@torch.no_grad()
def prefill_distinct(model, input_ids, attn):
    """The KV cache of every row but its last token, each distinct row computed once (the K dialogues of a
    scenario, the G samples of a prompt, open alike); None when the rows all differ."""
    index, first, inverse = {}, [], []  # row -> its number; each number's first row; row -> number
    for b, row in enumerate(map(tuple, input_ids.tolist())):
        if row not in index:
            index[row] = len(first)
            first.append(b)
        inverse.append(index[row])
    if len(first) == len(inverse) or input_ids.shape[1] < 2:
        return None
    rows = torch.tensor(first, device=input_ids.device)
    ids, mask = input_ids[rows, :-1], attn[rows, :-1]
    position_ids = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)  # as generate computes them
    cache = model(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=True).past_key_values
    cache.batch_select_indices(torch.tensor(inverse, device=input_ids.device))
    return cache


class Reply(NamedTuple):
    """One sampled reply: its ids up to and with the first end-of-turn token, whether it ended so (False: cut
    off at the token cap), and each id's log-probability under the distribution the sampler drew it from
    (None where the model's own generation settings sampled: 05's benchmarks)."""

    ids: list[int]
    ended: bool
    logprobs: list[float] | None


class SamplerLogprobs:
    """The last link of the sampling chain (a transformers logits processor): it keeps each row's log-softmax of
    the final scores until the next call shows which token was drawn from it, so the sampler's own
    log-probability of every sampled token is kept one vocabulary row at a time (never every step's scores:
    64 rows x 256 tokens x a 152k vocabulary would be 10 GB)."""

    def __init__(self):
        self.held, self.kept = None, []  # the last call's log-softmax [B, V]; the sampled tokens' [B] so far

    def __call__(self, input_ids, scores):
        if self.held is not None:  # the previous call's row, at the token drawn from it (now input_ids' last)
            self.kept.append(self.held.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self.held = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def logprobs(self, new_tokens) -> torch.Tensor:
        """[B, n] for the n new columns of the output (a generate that ran one step further, and undid it,
        kept one more)."""
        kept = self.kept[: new_tokens.shape[1]]
        if len(kept) < new_tokens.shape[1]:
            kept.append(self.held.gather(-1, new_tokens[:, len(kept) :][:, :1]).squeeze(-1))
        return torch.stack(kept, 1) if kept else new_tokens.new_zeros((len(new_tokens), 0), dtype=torch.float)


def end_of_turn_ids(model, tokenizer) -> list[int]:
    """Every id that ends a turn: the tokenizer's eos and each of the model's generation config (Llama 3.1: three;
    Qwen2.5: <|im_end|> and <|endoftext|>)."""
    extra = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    return sorted({tokenizer.eos_token_id, *(extra if isinstance(extra, (list, tuple)) else [extra])} - {None})


@contextlib.contextmanager
def only_this_generation_config(model, config):
    """`config` is the model's whole generation configuration inside the block. transformers' generate fills
    every field a caller leaves unset from the model's generation_config.json (Qwen2.5-Instruct's sets
    repetition_penalty 1.05, top_k 20, top_p 0.8, temperature 0.7): with this one in its place nothing is
    inherited, whatever file the model ships."""
    owner = model.get_base_model() if hasattr(model, "get_base_model") else model
    saved = owner.generation_config
    owner.generation_config = config
    try:
        yield
    finally:
        owner.generation_config = saved


@torch.no_grad()
def generate(
    model,
    tokenizer,
    input_ids,
    attn,
    max_new_tokens: int,
    temperature=0.0,
    top_p=1.0,
    cache=None,
    min_p=None,
    model_settings=False,
):
    """One batched generate call on left-padded rows, from the KV cache of all but their last column when given
    -> (replies, output): output holds .sequences and .past_key_values.

    The sampler is built here from the arguments alone: softmax(logits / temperature), then top-p and min-p when
    given (greedy at temperature 0), and SamplerLogprobs last, so a Reply's logprobs are the distribution its
    tokens were drawn from; no field of the model's generation_config applies (only its end-of-turn ids are
    read). model_settings=True is for an evaluation protocol that asks for the model's own settings (05's
    benchmarks): temperature, top-p and min-p as given, every other field from the model's generation_config,
    top-k off; its replies carry no log-probabilities."""
    from transformers import (
        GenerationConfig,
        LogitsProcessorList,
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopPLogitsWarper,
    )

    eos = end_of_turn_ids(model, tokenizer)
    sampled = temperature > 0
    if model_settings:
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attn,
            past_key_values=cache,
            do_sample=sampled,
            temperature=temperature if sampled else None,
            top_p=top_p if sampled else None,
            top_k=None,
            min_p=min_p if sampled else None,
            max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=eos,
            return_dict_in_generate=True,
        )
        recorder = None
    else:
        # the sampler: scores = logits / temperature, then top-p and min-p when asked, then the recorder (last)
        chain = LogitsProcessorList()
        if sampled and temperature != 1.0:
            chain.append(TemperatureLogitsWarper(temperature))
        if sampled and top_p < 1.0:
            chain.append(TopPLogitsWarper(top_p))
        if sampled and min_p is not None:
            chain.append(MinPLogitsWarper(min_p))
        recorder = SamplerLogprobs()
        chain.append(recorder)
        # from scratch: top_k 0 (the library's own default is 50), every other field at its neutral default
        config = GenerationConfig(
            do_sample=sampled,
            top_k=0 if sampled else None,
            max_new_tokens=max_new_tokens,
            eos_token_id=eos,
            pad_token_id=tokenizer.pad_token_id,
            return_dict_in_generate=True,
        )
        with only_this_generation_config(model, config):
            out = model.generate(
                input_ids=input_ids, attention_mask=attn, past_key_values=cache, logits_processor=chain
            )
    new = out.sequences[:, input_ids.shape[1] :]
    logprobs = recorder.logprobs(new).tolist() if recorder else [None] * len(new)
    replies = []
    for row, lp in zip(new.tolist(), logprobs):
        cut = next((j for j, tok in enumerate(row) if tok in eos), None)
        n = len(row) if cut is None else cut + 1
        replies.append(Reply(row[:n], cut is not None, None if lp is None else lp[:n]))
    return replies, out


def generate_batch(
    model,
    tokenizer,
    contexts: list[list[int]],
    max_new_tokens: int,
    temperature=0.0,
    top_p=1.0,
    min_p=None,
    model_settings=False,
) -> list[Reply]:
    """One Reply per token-id context, in one batched generate call with identical contexts prefilled once."""
    input_ids, attn = left_pad(contexts, tokenizer.pad_token_id, next(model.parameters()).device)
    cache = prefill_distinct(model, input_ids, attn)
    return generate(
        model, tokenizer, input_ids, attn, max_new_tokens, temperature, top_p, cache, min_p, model_settings
    )[0]


LOGIT_CHUNK = 2**27  # logits per chunk of the LM head (0.5 GB in fp32)


def final_logits(config, logits):
    """What a model's own forward does to its LM head's output, which token_logprobs (it runs the head itself)
    must do too: Cohere multiplies by logit_scale, Granite divides by logits_scaling, Gemma 2 and 3 soft-cap
    (cap * tanh(logits / cap)). Others return the head's output as it is (load_policy checks it)."""
    if getattr(config, "logit_scale", None) is not None:
        logits = logits * config.logit_scale
    if getattr(config, "logits_scaling", None) is not None:
        logits = logits / config.logits_scaling
    cap = getattr(config, "final_logit_softcapping", None)
    if cap is not None:
        logits = cap * torch.tanh(logits / cap)
    return logits


def token_logprobs(model, input_ids, attention_mask, loss_mask, temperature=1.0):
    """log pi(token) at every position where loss_mask is 1, flat [N] in row-major order. The LM head runs on
    those N positions only, in chunks of at most LOGIT_CHUNK logits recomputed in the backward pass instead
    of kept (with a 152k vocabulary, 7,680 tokens would hold ~12 GB of logits and their gradient)."""
    from torch.utils.checkpoint import checkpoint

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    hidden = base.get_decoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    pick = loss_mask[:, 1:].bool()  # position j predicts token j + 1
    h, targets = hidden[:, :-1][pick], input_ids[:, 1:][pick]  # [N, H], [N]
    head, config = base.get_output_embeddings(), base.config.get_text_config()

    def logp(h, targets):
        logits = final_logits(config, head(h)).float()  # [n, V], as the model's forward gives them
        if temperature > 0 and temperature != 1.0:
            logits = logits / temperature  # the distribution that sampled (top-p 1)
        # log softmax at the sampled token: logit - logsumexp(logits)
        return logits.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)

    rows = max(1, LOGIT_CHUNK // head.weight.shape[0])
    if len(h) <= rows:
        return logp(h, targets)
    if not torch.is_grad_enabled():
        return torch.cat([logp(h[j : j + rows], targets[j : j + rows]) for j in range(0, len(h), rows)])
    return torch.cat(
        [checkpoint(logp, h[j : j + rows], targets[j : j + rows], use_reentrant=False) for j in range(0, len(h), rows)]
    )


@torch.no_grad()
def scoring_gap(model) -> float:
    """How far token_logprobs is from what the model's own forward gives (the sampler's logits come from the
    forward): the largest difference in log-probability, in nats, on 16 tokens. bf16 rounding stays far below
    0.5; an unknown transform of the final logits does not (common.load_policy refuses it then)."""
    vocab = model.get_output_embeddings().weight.shape[0]
    device = next(model.parameters()).device
    ids = (torch.arange(16, device=device)[None] * 7919) % vocab  # any 16 ids
    ones = torch.ones_like(ids)
    by_forward = model(input_ids=ids, attention_mask=ones).logits[0, :-1].float().log_softmax(-1)
    by_forward = by_forward.gather(-1, ids[0, 1:, None]).squeeze(-1)
    return float((token_logprobs(model, ids, ones, ones) - by_forward).abs().max())


def right_pad(rows: list[list[int]], pad_id: int, spans=None, device="cpu"):
    """Right-padded ids [B, L], their attention mask, and a mask of each row's [start, end) spans (the
    tokens to score: a rubric, the replies, an answer option)."""
    ids = torch.full((len(rows), max(len(r) for r in rows)), pad_id, dtype=torch.long)
    attn, mask = torch.zeros_like(ids), torch.zeros_like(ids)
    for b, r in enumerate(rows):
        ids[b, : len(r)], attn[b, : len(r)] = torch.tensor(r, dtype=torch.long), 1
        for start, end in spans[b] if spans else []:
            mask[b, start:end] = 1
    return ids.to(device), attn.to(device), mask.to(device)
