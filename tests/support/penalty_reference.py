"""An independent reference for penalised greedy decoding on a tiny export: HF's
``RepetitionPenaltyLogitsProcessor`` and OpenAI's frequency/presence formula applied in torch to
the logits of one plain forward pass per token (no KV reuse, no Deskfleet sampling code)."""

from __future__ import annotations

import numpy as np
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from engine.generation.request import SamplingParams
from engine.shards.kv_layout import KVLayout
from engine.shards.stage import LocalChain, StepInputs


def reference(chain: LocalChain, prompt, n: int, params: SamplingParams) -> tuple[list[int], list[float]]:
    """Greedy tokens under ``params``' penalties, each chosen from one plain forward pass of prompt +
    tokens so far (no KV reuse), penalised by HF's processor and OpenAI's formula in torch; and each
    chosen token's raw log-softmax (what ``logprobs`` reports)."""
    tokens: list[int] = []
    logprobs: list[float] = []
    for _ in range(n):
        fed = np.asarray([list(prompt) + tokens], dtype=np.int64)
        mask, positions = KVLayout(fed.shape[1]).plan(fed.shape[1])
        raw = torch.tensor(chain.forward(chain.new_streams(), StepInputs(fed, mask, positions, 0))[0][-1:])
        x = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(torch.tensor(fed), raw.clone())[0]
        for j in set(tokens):
            x[j] -= tokens.count(j) * params.frequency_penalty + params.presence_penalty
        for j, bias in params.logit_bias:
            x[j] += bias
        token = int(torch.argmax(x))
        logprobs.append(float(torch.log_softmax(raw[0].double(), -1)[token]))
        tokens.append(token)
    return tokens, logprobs
