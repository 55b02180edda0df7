"""The names of a stage graph's input and output tensors: the contract between the exporter that
builds the graphs (export.builder) and the stages that feed them (engine.shards, engine.static).

Stateful (CPU/GPU) stage graphs, per stage::

    stage 0       INPUT_IDS            [B, S]      i64
    later stages  INPUTS_EMBEDS        [B, S, H]   f32
    every stage   ATTENTION_MASK       [B, P + S]  i64
                  POSITION_IDS         [B, S]      i64
    last stage    LOGITS_LAST          []          i64
    with beam_idx BEAM_IDX             [B]         i32
    outputs       LOGITS [B, n, V] or HIDDEN_STATES_OUT [B, S, H]
    state         past_key(i), past_value(i) per layer i

Static (NPU) graphs take HIDDEN_STATES instead of INPUTS_EMBEDS on later stages, ATTENTION_MASK
("2d") or ATTENTION_BIAS ("4d"), the host's past_key(i)/past_value(i) as inputs, and return
new_key(i)/new_value(i) beside LOGITS or HIDDEN_STATES_OUT. The paged conversion of a stateful
graph (engine.paged.stage) adds its metadata inputs and ``key_cache.L``/``value_cache.L``.
"""

from __future__ import annotations

from collections.abc import Iterable

INPUT_IDS = "input_ids"
INPUTS_EMBEDS = "inputs_embeds"  # a later stateful stage's first input
HIDDEN_STATES = "hidden_states"  # a later static stage's first input
ATTENTION_MASK = "attention_mask"
ATTENTION_BIAS = "attention_bias"  # the packed static graph's per-row additive mask
POSITION_IDS = "position_ids"
LOGITS_LAST = "logits_last"
BEAM_IDX = "beam_idx"

LOGITS = "logits"
HIDDEN_STATES_OUT = "hidden_states_out"

# The paged graph's (engine.paged.stage) metadata inputs and KV cache ports
PAST_LENS = "past_lens"
SUBSEQUENCE_BEGINS = "subsequence_begins"
BLOCK_INDICES = "block_indices"
BLOCK_INDICES_BEGINS = "block_indices_begins"
KEY_CACHE_PREFIX = "key_cache."
VALUE_CACHE_PREFIX = "value_cache."
# A stateful stage's model rt_info: the sliding window of each of its attentions in graph (layer)
# order, "w0,w1,..." with 0 for none (Gemma 4); the paged conversion (engine.paged.stage) gives each
# PagedAttention its window.
SLIDING_WINDOW_RT_INFO = "deskfleet_sliding_window"


def first_input(has_embedding: bool, *, static: bool = False) -> str:
    """The stage's first input: token ids on stage 0, activations on the later ones."""
    if has_embedding:
        return INPUT_IDS
    return HIDDEN_STATES if static else INPUTS_EMBEDS


def stage_output(has_head: bool) -> str:
    """The stage's main output: logits on the last stage, activations on the others."""
    return LOGITS if has_head else HIDDEN_STATES_OUT


def past_key(layer: int) -> str:
    return f"past_key_{layer}"


def past_value(layer: int) -> str:
    return f"past_value_{layer}"


def new_key(layer: int) -> str:
    return f"new_key_{layer}"


def new_value(layer: int) -> str:
    return f"new_value_{layer}"


def past_kv_names(layers: Iterable[int]) -> list[str]:
    """``past_key_{i}``, ``past_value_{i}`` for every layer, in the graph's input order."""
    return [name for i in layers for name in (past_key(i), past_value(i))]
