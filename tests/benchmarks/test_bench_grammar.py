"""The grammar benchmark, run for real on the tiny test tokenizer (a second or two): every grammar
follows its canned answer to the end, the JSON has every figure, the section has both tables."""

from __future__ import annotations

import argparse
import json

from tests.benchmarks import grammar as bench
from tests.support.tiny_models import SPECIAL_TOKENS, build_tiny_tokenizer


def test_a_tiny_run_records_json_and_section(tmp_path):
    tokenizer = build_tiny_tokenizer(tmp_path / "tok") / "tokenizer.json"
    parser = argparse.ArgumentParser()
    bench.configure(parser)
    eos = SPECIAL_TOKENS.index("<|im_end|>")
    args = parser.parse_args(["--tokenizer", str(tokenizer), "--eos", str(eos), "--runs", "1",
                              "--attackers", "3", "--big-properties", "200",
                              "--json", str(tmp_path / "grammar.json"), "--doc", str(tmp_path / "B.md")])
    assert bench.run(args) == 0
    result = json.loads((tmp_path / "grammar.json").read_text())
    assert result["vocab"] < 512 and result["mask_bytes"] == 4 * -(-result["vocab"] // 32) and result["users"] == 8
    assert set(result["grammars"]) == set(bench.CASES)
    for figures in result["grammars"].values():
        assert figures["samples"]["mask"] == figures["answer_tokens"] + 1  # every position, then EOS
        assert figures["mask_us_median"] > 0 and figures["executor_us_median"] > 0
    contention = result["contention"]
    assert set(contention["builds"]) == {"one thread", "pool"} and set(contention["masks"]) == {"on the loop",
                                                                                                  "mask thread"}
    pool = contention["builds"]["pool"][0]
    assert pool["attacker_refused"] >= 1  # 3 at once: the key's share of the default pool is 2
    assert pool["attacker_built"] + pool["attacker_refused"] == 3
    doc = (tmp_path / "B.md").read_text()
    assert "<!-- grammar:start -->" in doc and "| json_schema |" in doc and "Once per request:" in doc
    assert "victim under attack" in doc
