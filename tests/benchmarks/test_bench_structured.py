"""The structured-output benchmark: its pure parts (per-round ratios, the decode-step filter, the
table), the mask-cost figures on a real tiny tokenizer's masks, and (slow lane) a tiny run for real
over a paged worker process per stage of the tiny model."""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import numpy as np
import pytest

from tests.benchmarks import structured as bench


def _round(users: int, mode: str, tok_s: float, step_ms: float, warmup: bool = False) -> dict:
    return {"users": users, "mode": mode, "warmup": warmup, "aggregate_tok_s": tok_s, "per_user_tok_s": tok_s / users,
            "ttft_ms": 100.0, "step_ms": step_ms, "last_stage_ms": step_ms / 2, "interval_ms": step_ms + 1,
            "finish": ["length"], "tokens": 64 * users, "wall_s": 1.0, "decode_steps": 60, "answers": []}


def test_ratios_are_per_round_medians_and_warmups_do_not_count():
    rounds = [_round(1, "plain", 1.0, 1.0, warmup=True), _round(1, "schema", 100.0, 1.0, warmup=True),
              _round(1, "plain", 30.0, 30.0), _round(1, "schema", 27.0, 33.0),
              _round(1, "schema", 20.0, 40.0), _round(1, "plain", 20.0, 40.0),  # alternated order
              _round(1, "plain", 40.0, 25.0), _round(1, "schema", 40.0, 25.0)]
    cell = bench.summarise(rounds)["1"]
    assert cell["plain"]["aggregate_tok_s"] == 30.0 and cell["schema"]["aggregate_tok_s"] == 27.0
    assert cell["tok_s_ratio"] == pytest.approx(1.0)  # ratios 0.9, 1.0, 1.0
    assert cell["interval_ratio"] == pytest.approx(1.0)  # 34/31, 41/41, 26/26


def test_only_decode_steps_of_all_users_sent_after_the_round_started_count():
    def step(seq, sent, answered, rows, tokens, failed=False):
        return SimpleNamespace(seq=seq, sent_at=sent, answered_at=answered, answered=rows, tokens=tokens,
                               stage_ms=(1.0, 3.0), failed=failed)

    log = [step(1, 0.5, 0.6, 8, 8), step(2, 1.0, 1.010, 8, 8), step(3, 1.1, 1.130, 8, 8), step(4, 1.2, 1.5, 8, 200),
           step(5, 1.6, 1.62, 7, 7), step(6, 1.7, 1.9, 8, 8, failed=True)]
    got = bench.decode_steps(log, 1.0, 8)
    assert got["decode_steps"] == 2 and got["step_ms"] == pytest.approx(20.0) and got["last_stage_ms"] == 3.0
    assert got["interval_ms"] == pytest.approx(100.0)  # seq 2 -> 3 only: 4 is a prefill


@pytest.fixture(scope="module")
def tiny_vocabulary(tiny_checkpoint):
    """The tiny llama's tokenizer (the session's checkpoint: no tokenizer trained here) over 512 logits."""
    from engine.paged.constraints import GrammarVocabulary
    from tests.support.tiny_models import SPECIAL_TOKENS

    checkpoint = tiny_checkpoint("llama")
    assert json.loads((checkpoint / "config.json").read_text())["vocab_size"] == 512
    return GrammarVocabulary(checkpoint / "tokenizer.json", 512, (SPECIAL_TOKENS.index("<|im_end|>"),))


def test_the_mask_costs_follow_a_real_answer_and_count_the_masks_bytes(tiny_vocabulary):
    tok = tiny_vocabulary.load()
    text = '{"people": [{"name": "Ada", "age": 36, "city": "London"}, {"name": "Bo", "age": 4'
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(tiny_vocabulary.tokenizer)).encode(text).ids
    fill_us, masks = bench.mask_fill_us(tiny_vocabulary, [ids, ids[:10]], 3)
    assert fill_us > 0 and len(masks) == 3 and masks[0].shape == (tok.mask_width,)
    wire = bench.wire_figures(3, 512, 64, masks, 3)
    assert wire["bytes_per_row"] == 4 * 16 and wire["masked_bytes"] == wire["plain_bytes"] + 3 * 64
    answer = bench.answer_figures(3, 512, masks, 3)
    assert answer["plain_us"] > 0 and answer["masked_us"] > 0
    with pytest.raises(Exception, match="not allowed"):  # a token off the grammar is refused, not timed
        bench.mask_fill_us(tiny_vocabulary, [[ids[0], *Tokenizer.from_file(str(tiny_vocabulary.tokenizer))
                                              .encode("]]]").ids]], 1)


def test_only_an_answer_valid_for_the_closed_schema_counts():
    assert bench.schema_valid('{"name": "Ada", "age": 36, "city": "London"}')
    assert not bench.schema_valid('{"name": "Ada", "age": -1, "city": "London"}')
    assert not bench.schema_valid('{"name": "Ada", "age": 36')


def test_the_table_names_every_row_and_the_mask_costs():
    rounds = [_round(u, m, 30.0, 30.0) for u in (1, 8) for m in bench.MODES]
    costs = {u: {"fill_consume_us": 30.0, "wire_plain_bytes": 2468, "wire_masked_bytes": 8612,
                 "wire_bytes_per_row": 6144.0, "wire_plain_codec_us": 90.0, "wire_masked_codec_us": 97.0,
                 "answer_plain_us": 60.0, "answer_masked_us": 130.0} for u in ("1", "8")}
    summary = bench.summarise(rounds)
    bench.add_predictions(costs, summary, 2)
    assert costs["1"]["added_ms"] == pytest.approx((30 + 2 * 7 + 70) / 1000)
    assert costs["1"]["added_share"] == pytest.approx(costs["1"]["added_ms"] / 31.0)  # the plain interval
    result = {"command": bench.COMMAND_LINE, "machine": {"date": "now", "cores": 2, "load_average": [1, 1, 1]},
              "load_average_end": [1, 1, 1], "seconds": 10.0, "model": "m", "stages": 2, "threads": 1,
              "new_tokens": 64, "warmups": 1, "repeats": 3, "vocab": 49152, "summary": summary,
              "mask_costs": costs, "validity": {"users": 4, "valid": 4, "finish": ["stop"] * 4}}
    text = bench.render(result, bench.DEFAULT_JSON_DIR / "structured.json")
    assert "| 8 | schema |" in text and "| 1 | plain |" in text and "2,468 → 8,612 (+6,144/row)" in text
    assert "4/4 answers parse and validate" in text and "| 0.11 | +0.4% |" in text


@pytest.mark.slow  # worker processes for two stages, a tokenizer for masks, a few rounds
def test_a_tiny_run_records_json_and_section(tiny_export, tmp_path):
    parser = argparse.ArgumentParser()
    bench.configure(parser)
    args = parser.parse_args(["--export", str(tiny_export("llama", 2)), "--users", "1,2", "--new-tokens", "6",
                              "--repeats", "1", "--warmups", "0", "--valid-users", "2", "--micro-reps", "2",
                              "--json", str(tmp_path / "s.json"), "--doc", str(tmp_path / "B.md")])
    assert bench.run(args) == 0
    result = json.loads((tmp_path / "s.json").read_text())
    assert set(result["summary"]) == {"1", "2"} and set(result["mask_costs"]) == {"1", "2"}
    schema_rounds = [r for r in result["rounds"] if r["mode"] == "schema"]
    assert schema_rounds and all(len(a) == 6 for r in schema_rounds for a in r["answers"])
    assert np.isfinite(result["summary"]["2"]["tok_s_ratio"])
    assert "<!-- structured:start -->" in (tmp_path / "B.md").read_text()
