"""The independent reference for benchmarks: ``openvino_genai.LLMPipeline`` on an optimum-intel
export of the same checkpoint our shards come from.

optimum-intel 2.2.0 is the monolithic exporter, but it needs transformers < 5.6 and
huggingface-hub < 1.22 (we convert GGUFs with transformers >= 5.24) and it declares an unpinned
torchvision whose only wheel on these machines is a CUDA build that breaks transformers imports.
So it lives in its own virtual environment under the cache root (``<cache>/optimum-env``), built
once by :func:`ensure_reference_env` and only ever run as a subprocess. torch is installed first,
pinned, so pip takes the CPU wheel; optimum-intel is installed with ``--no-deps`` after its real
dependencies (:data:`REFERENCE_PINS`), which leaves torchvision out. Text-generation export does
not import torchvision.

Building the environment takes 2-4 minutes on a 2-core office PC (measured: 110 s on a quiet
machine, 214 s while other jobs ran; torch from the local wheel is about half of it). Exporting
SmolLM2-135M takes about 2 minutes per weight format. Both are cached: the environment by its
pins, an export by (checkpoint fingerprint, weight format, group size).

The pipeline itself runs in the main environment (``openvino-genai`` is part of the export
extra) on pre-tokenized ids, so tokenization is byte-for-byte the one our own path uses.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple

from engine.errors import DeskfleetError, GenerationError
from export.sources import default_cache_root, model_fingerprint
from tests.support.pins import pinned

log = logging.getLogger(__name__)

ENV_SUBDIR = "optimum-env"
EXPORTS_SUBDIR = "reference"
ENV_RECORD = "deskfleet-env.json"
EXPORT_RECORD = "deskfleet-reference.json"
EXPORT_LOG = "optimum-export.log"

# Installed first, alone, so that nothing later can pull a CUDA build of torch. The product's own
# pins (torch, openvino) come from pyproject.toml, the one place they are written.
TORCH_PIN = pinned("torch")
# optimum-intel's real dependencies, resolved together. Found by trying on Python 3.11.
REFERENCE_PINS: tuple[str, ...] = (
    "optimum==2.3.0",
    "transformers==5.5.4",
    "huggingface-hub==1.21.0",
    pinned("nncf"),
    pinned("openvino"),
    pinned("openvino-tokenizers"),
    "requests>=2.33,<3",
    "setuptools",
)
# Installed last with --no-deps: its metadata asks for torchvision, which export never imports.
NO_DEPS_PINS: tuple[str, ...] = ("optimum-intel==2.2.0",)

WeightFormat = Literal["int4", "int8", "fp16", "fp32"]
# int4: symmetric, every eligible matmul (ratio 1.0), group size from the caller; optimum keeps
# the embedding and the head at int8 as it does by default. The rest use optimum's defaults.
_WEIGHT_ARGS: dict[str, tuple[str, ...]] = {
    "int4": ("--weight-format", "int4", "--sym", "--ratio", "1.0"),
    "int8": ("--weight-format", "int8"),
    "fp16": ("--weight-format", "fp16"),
    "fp32": ("--weight-format", "fp32"),
}
REQUIRED_EXPORT_FILES = (
    "openvino_model.xml",
    "openvino_model.bin",
    "openvino_tokenizer.xml",
    "openvino_detokenizer.xml",
)

_ENV_STEP_TIMEOUT_S = 30 * 60
_EXPORT_TIMEOUT_S = 60 * 60
_HEARTBEAT_S = 30.0


class ReferenceToolError(DeskfleetError):
    """Base of the reference-pipeline errors."""


class ReferenceEnvError(ReferenceToolError):
    """The isolated optimum-intel environment could not be created or a package in it failed
    to install."""


class ReferenceExportError(ReferenceToolError):
    """optimum-cli failed, timed out, or did not write the model and tokenizer files."""


class ReferenceRun(NamedTuple):
    """What one reference generation measured; unpacks as ``tokens, ttft_s, rate``."""

    tokens: list[int]
    ttft_s: float
    decode_tok_per_s: float


@dataclass(frozen=True)
class _Step:
    what: str
    argv: tuple[str, ...]
    timeout_s: float


# -- the isolated environment ----------------------------------------------------------------


def _env_python(env_dir: Path) -> Path:
    if os.name == "nt":
        return env_dir / "Scripts" / "python.exe"
    return env_dir / "bin" / "python"


def _env_spec() -> dict[str, Any]:
    return {
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "torch": TORCH_PIN,
        "pins": list(REFERENCE_PINS),
        "no_deps": list(NO_DEPS_PINS),
    }


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def ensure_reference_env(root: Path | None = None) -> Path:
    """Create (once) the optimum-intel virtual environment under ``root``; return its directory.

    ``root`` defaults to the cache root. The environment is built in a temporary directory
    beside its final place and moved there when every package installed, so an interrupted
    build is never mistaken for a finished one. An environment built with other pins is
    replaced. Everything is invoked as ``<env python> -m ...``, which keeps working after the
    move. Takes 2-4 minutes the first time.
    """
    root = Path(root) if root is not None else default_cache_root()
    final = root / ENV_SUBDIR
    spec = _env_spec()
    if _read_json(final / ENV_RECORD) == spec and _env_python(final).exists():
        return final

    root.mkdir(parents=True, exist_ok=True)
    log.info("Creating the optimum-intel reference environment at %s (2-4 minutes)...", final)
    started = time.monotonic()
    partial = Path(tempfile.mkdtemp(prefix=f".{ENV_SUBDIR}.partial-", dir=root))
    build_log = root / f"{ENV_SUBDIR}-build.log"
    try:
        python = str(_env_python(partial))
        pip = (python, "-m", "pip", "install", "--disable-pip-version-check", "--no-input")
        steps = (
            _Step(
                "create the virtual environment", (sys.executable, "-m", "venv", str(partial)), 300
            ),
            _Step(f"install {TORCH_PIN}", (*pip, TORCH_PIN), _ENV_STEP_TIMEOUT_S),
            _Step(
                "install optimum-intel's dependencies", (*pip, *REFERENCE_PINS), _ENV_STEP_TIMEOUT_S
            ),
            _Step("install optimum-intel", (*pip, "--no-deps", *NO_DEPS_PINS), _ENV_STEP_TIMEOUT_S),
        )
        with build_log.open("w", encoding="utf-8") as out:
            for step in steps:
                _run_logged(step, out, build_log, ReferenceEnvError)
        _write_json(partial / ENV_RECORD, spec)
        _open_permissions(partial)
        if final.exists() and _read_json(final / ENV_RECORD) != spec:
            shutil.rmtree(final)  # built with other pins
        try:
            os.replace(partial, final)
        except OSError:
            if _read_json(final / ENV_RECORD) != spec:
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    log.info("Reference environment ready in %.0f s.", time.monotonic() - started)
    return final


def _run_logged(step: _Step, out: Any, log_path: Path, error: type[ReferenceToolError]) -> None:
    """Run one subprocess with its output in ``out``; log a heartbeat while it runs."""
    log.info("Reference: %s...", step.what)
    out.write(f"$ {' '.join(step.argv)}\n")
    out.flush()
    started = time.monotonic()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # Never let the main environment's packages leak into the isolated one.
    env.pop("PYTHONPATH", None)
    env.pop("PYTHONHOME", None)
    with subprocess.Popen(
        step.argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
    ) as proc:
        while True:
            try:
                code = proc.wait(timeout=_HEARTBEAT_S)
                break
            except subprocess.TimeoutExpired:
                elapsed = time.monotonic() - started
                if elapsed > step.timeout_s:
                    proc.kill()
                    proc.wait()
                    raise error(
                        f"Reference: '{step.what}' did not finish within {step.timeout_s:.0f} s; "
                        f"it was stopped. See {log_path}."
                    ) from None
                log.info("Reference: still working on '%s' (%.0f s)...", step.what, elapsed)
    if code != 0:
        raise error(
            f"Reference: '{step.what}' failed (exit code {code}). The last lines of {log_path}:\n"
            f"{_tail(log_path)}"
        )
    log.info("Reference: %s done in %.0f s.", step.what, time.monotonic() - started)


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "(log not readable)"
    return "\n".join(text.replace("\r", "\n").splitlines()[-lines:])


def _open_permissions(directory: Path) -> None:
    """mkdtemp creates owner-only directories; give a finished one the usual mode."""
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)


def _write_json(path: Path, data: object) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


# -- export ----------------------------------------------------------------------------------


def reference_export_name(fingerprint: str, weights: str, group_size: int) -> str:
    suffix = f"-g{group_size}" if weights == "int4" else ""
    return f"{fingerprint[:16]}-{weights}{suffix}"


def export_reference(
    checkpoint_dir: Path,
    weights: WeightFormat,
    out_dir: Path | None = None,
    group_size: int = 64,
    *,
    env_root: Path | None = None,
) -> Path:
    """Export ``checkpoint_dir`` with ``optimum-cli export openvino``; return the model directory.

    ``out_dir`` holds one subdirectory per (checkpoint fingerprint, weights, group size) and
    defaults to ``<cache>/reference``; an existing complete export is returned at once. The
    result holds ``openvino_model.xml/.bin`` and ``openvino_tokenizer.xml`` /
    ``openvino_detokenizer.xml``. ``group_size`` applies to int4 only; the hidden size must be
    divisible by it (SmolLM2-135M's 576 needs 64).
    """
    if weights not in _WEIGHT_ARGS:
        raise ReferenceExportError(
            f"Unknown weight format {weights!r}; use one of {', '.join(_WEIGHT_ARGS)}."
        )
    checkpoint_dir = Path(checkpoint_dir).resolve()
    out_dir = Path(out_dir) if out_dir is not None else default_cache_root() / EXPORTS_SUBDIR
    fingerprint = model_fingerprint(checkpoint_dir)
    final = out_dir / reference_export_name(fingerprint, weights, group_size)
    if _is_complete_export(final):
        return final

    env_dir = ensure_reference_env(env_root)
    out_dir.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{final.name}.partial-", dir=out_dir))
    export_log = partial / EXPORT_LOG
    argv = (
        str(_env_python(env_dir)),
        "-m",
        "optimum.commands.optimum_cli",
        "export",
        "openvino",
        "--model",
        str(checkpoint_dir),
        "--task",
        "text-generation-with-past",
        *_WEIGHT_ARGS[weights],
        *(("--group-size", str(group_size)) if weights == "int4" else ()),
        str(partial),
    )
    started = time.monotonic()
    log.info("Exporting the %s reference of %s (a few minutes)...", weights, checkpoint_dir.name)
    try:
        with export_log.open("w", encoding="utf-8") as out:
            step = _Step(f"optimum-cli export ({weights})", argv, _EXPORT_TIMEOUT_S)
            try:
                _run_logged(step, out, export_log, ReferenceExportError)
            except ReferenceExportError as exc:
                raise ReferenceExportError(f"{exc}{_export_hint(export_log, group_size)}") from None
        if not (partial / "openvino_tokenizer.xml").is_file():
            _convert_tokenizer(checkpoint_dir, partial)
        missing = [name for name in REQUIRED_EXPORT_FILES if not (partial / name).is_file()]
        if missing:
            raise ReferenceExportError(
                f"optimum-cli finished but did not write {', '.join(missing)}. See the log "
                f"excerpt:\n{_tail(export_log)}"
            )
        _write_json(
            partial / EXPORT_RECORD,
            {
                "checkpoint": str(checkpoint_dir),
                "fingerprint": fingerprint,
                "weights": weights,
                "group_size": group_size if weights == "int4" else None,
                "command": list(argv[1:]),
                "pins": [TORCH_PIN, *REFERENCE_PINS, *NO_DEPS_PINS],
                "seconds": round(time.monotonic() - started, 1),
            },
        )
        _open_permissions(partial)
        try:
            os.replace(partial, final)
        except OSError:
            if not _is_complete_export(final):
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    log.info("Reference export ready in %.0f s: %s", time.monotonic() - started, final)
    return final


def _is_complete_export(directory: Path) -> bool:
    return (directory / EXPORT_RECORD).is_file() and all(
        (directory / name).is_file() for name in REQUIRED_EXPORT_FILES
    )


def _export_hint(export_log: Path, group_size: int) -> str:
    text = _tail(export_log, 200)
    if "InvalidGroupSizeError" in text or "group size" in text.lower():
        return (
            f"\nThe hidden size is probably not divisible by the group size {group_size}; "
            "try group_size=64 (SmolLM2-135M needs it) or 32."
        )
    return ""


def _convert_tokenizer(checkpoint_dir: Path, out_dir: Path) -> None:
    """Fallback when optimum did not convert the tokenizer: do it here, in the main env."""
    import openvino as ov
    from openvino_tokenizers import convert_tokenizer
    from transformers import AutoTokenizer

    log.info("Converting the tokenizer to OpenVINO in the main environment...")
    hf_tokenizer = AutoTokenizer.from_pretrained(str(checkpoint_dir))
    tokenizer, detokenizer = convert_tokenizer(hf_tokenizer, with_detokenizer=True)
    ov.save_model(tokenizer, str(out_dir / "openvino_tokenizer.xml"))
    ov.save_model(detokenizer, str(out_dir / "openvino_detokenizer.xml"))


# -- running ---------------------------------------------------------------------------------

AttentionBackend = Literal["sdpa", "pa"]


def pipeline_properties(properties: Mapping[str, Any] | None, backend: AttentionBackend | None) -> dict[str, Any]:
    """LLMPipeline properties for one attention path.

    On x86 genai's default is PagedAttention with continuous batching and prefix caching on,
    so a benchmark repeating a prompt would time cache hits. ``"sdpa"`` asks for the stateful
    path (``ATTENTION_BACKEND="SDPA"``, the one our shards use); ``"pa"`` keeps PagedAttention
    with a scheduler whose prefix caching is off.
    """
    import openvino_genai as genai

    props = dict(properties or {})
    if backend == "sdpa":
        props["ATTENTION_BACKEND"] = "SDPA"
    elif backend == "pa":
        scheduler = genai.SchedulerConfig()  # 2026.4.1: no keyword constructor
        scheduler.enable_prefix_caching = False
        props["scheduler_config"] = scheduler
    elif backend is not None:
        raise ReferenceToolError(f"Unknown attention backend {backend!r}; use 'sdpa' or 'pa'.")
    return props


def pipeline_dir_from_export(export_dir: Path, out_dir: Path, checkpoint_dir: Path | None = None) -> Path:
    """Our own 1-stage export as a directory ``LLMPipeline`` loads: the same graph and weights.

    The stage's ``logits_last`` input (how many trailing positions get logits) becomes the
    constant 1, which is what genai samples from; nothing else changes (weights are saved as
    they are: ``compress_to_fp16=False``). No tokenizer IRs: the pipeline is fed token ids.
    ``config.json`` comes from ``checkpoint_dir`` when given (genai reads it if present).
    """
    import numpy as np
    import openvino as ov

    from engine.shards.manifest import load_manifest

    manifest = load_manifest(export_dir)
    if len(manifest.stages) != 1:
        raise ReferenceToolError(f"{export_dir} has {len(manifest.stages)} stages; LLMPipeline needs a 1-stage export.")
    model = ov.Core().read_model(str(Path(export_dir) / manifest.stages[0].xml))
    for param in model.get_parameters():
        if param.get_friendly_name() == "logits_last":
            param.output(0).replace(ov.opset13.constant(np.array(1, dtype=np.int64)).output(0))
            model.remove_parameter(param)
    model.validate_nodes_and_infer_types()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ov.save_model(model, str(out_dir / "openvino_model.xml"), compress_to_fp16=False)
    tokenizer_dir = Path(export_dir) / "tokenizer"
    for name in ("config.json", "generation_config.json"):
        for where in (tokenizer_dir, *([Path(checkpoint_dir)] if checkpoint_dir else [])):
            if (where / name).is_file():
                shutil.copy(where / name, out_dir / name)
                break
    if not (out_dir / "config.json").is_file():
        _write_json(out_dir / "config.json", {"model_type": manifest.model.architecture,
                                              "max_position_embeddings": manifest.model.max_position_embeddings})
    return out_dir



class ReferencePipeline:
    """One compiled ``openvino_genai.LLMPipeline``, reused across timed generations.

    Compiling takes seconds, so benchmarks build this once and call :meth:`generate` per round
    (the first call includes one-off setup: run a warm-up round first). ``properties`` go to
    the device plugin, e.g. ``{"KV_CACHE_PRECISION": "f32"}``; ``backend`` chooses the attention
    path (:func:`pipeline_properties`), None leaves genai's default.
    """

    def __init__(
        self,
        model_dir: Path,
        properties: Mapping[str, Any] | None = None,
        *,
        device: str = "CPU",
        backend: AttentionBackend | None = None,
    ) -> None:
        import openvino_genai as genai

        self.model_dir = Path(model_dir)
        self.backend = backend
        self._pipe = genai.LLMPipeline(str(self.model_dir), device, **pipeline_properties(properties, backend))

    def generate(
        self, input_ids: Sequence[int], max_new_tokens: int = 128, ignore_eos: bool = True
    ) -> ReferenceRun:
        """Greedy-generate from pre-tokenized ids; times come from genai's perf metrics: TTFT
        is prompt to first token, the decode rate is 1 / mean time per token after the first."""
        import numpy as np
        import openvino as ov
        import openvino_genai as genai

        if len(input_ids) == 0:
            raise GenerationError("The reference pipeline needs at least one input token.")
        if max_new_tokens < 2:
            raise GenerationError("max_new_tokens must be at least 2 to measure a decode rate.")
        config = self._pipe.get_generation_config()
        config.max_new_tokens = max_new_tokens
        config.ignore_eos = ignore_eos
        config.do_sample = False
        config.num_beams = 1
        config.repetition_penalty = 1.0

        ids = np.asarray([list(input_ids)], dtype=np.int64)  # [1, prompt_len]
        inputs = genai.TokenizedInputs(ov.Tensor(ids), ov.Tensor(np.ones_like(ids)))
        result = self._pipe.generate(inputs, config)
        metrics = result.perf_metrics
        ttft_ms = metrics.get_ttft().mean
        tpot_ms = metrics.get_tpot().mean
        tokens = [int(t) for t in result.tokens[0]]
        return ReferenceRun(tokens, ttft_ms / 1000.0, 1000.0 / tpot_ms if tpot_ms > 0 else 0.0)


def run_llmpipeline(
    model_dir: Path,
    input_ids: Sequence[int],
    max_new_tokens: int = 128,
    ignore_eos: bool = True,
    properties: Mapping[str, Any] | None = None,
    *,
    device: str = "CPU",
    warmup: bool = True,
) -> ReferenceRun:
    """Compile ``model_dir`` and greedy-generate once from pre-tokenized ``input_ids``.

    A short warm-up generation runs first unless ``warmup`` is false, so the timed run
    measures steady state rather than first-inference setup. For several rounds, build a
    :class:`ReferencePipeline` once instead.
    """
    pipe = ReferencePipeline(model_dir, properties, device=device)
    if warmup:
        pipe.generate(input_ids, 4, ignore_eos=True)
    return pipe.generate(input_ids, max_new_tokens, ignore_eos)
