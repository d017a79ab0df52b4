"""`cprag index --ray`: the encoding stage of `cprag index` on a Ray cluster, writing Lance fragments.

The driver does everything `cprag index` does around the encoding (read and split the corpus, decide what is new or
changed, delete stale rows, build FAISS, write the manifest) and hands the passages to Ray Data in the same chunks
the single-process path encodes (`IndexConfig.chunk_passages`). Actors load the checkpoint once each and encode a
chunk the way `build_index` does, so on CPU the rows are bit for bit the single-process ones; lance-ray's fragment
writer writes them as Lance fragments straight into the index's table directory, and the driver commits them as
they arrive, one `Append` per `commit_passages`. That commit cadence is the resume granularity: a run killed
anywhere leaves the committed chunks, and the rerun encodes the rest. Fragments written but not committed are
never read. Rows of changed passages are deleted before the first append, so an append never duplicates a passage.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cprag.errors import CheckpointError, ClusterError, ConfigError

INSTALL = 'pip install "cprag[cluster]"  (ray[data] and lance-ray)'


@dataclass
class RayIndexSettings:
    """Where and how `cprag index --ray` encodes. `address` None starts a local cluster in this process;
    "auto" joins the cluster `ray start` runs on this machine; otherwise "HOST:PORT" or a ray:// URL."""

    address: str | None = None
    workers: int | None = None  # encoding actors (default: one per GPU, else one per `cpus_per_worker` CPUs)
    cpus_per_worker: int = 1
    checkpoint: str | None = None  # what every actor loads (None: the shipped default)
    device: str | None = None  # None: cuda on GPU actors when the cluster has GPUs, else cpu
    dtype: str | None = None  # encoding dtype name, as --dtype
    commit_passages: int = 1024  # passages per Lance commit: the resume granularity

    def __post_init__(self):
        if self.checkpoint is not None and Path(self.checkpoint).exists():  # actors have their own working folders
            self.checkpoint = str(Path(self.checkpoint).resolve())
        if self.workers is not None and self.workers < 1:
            raise ConfigError("--ray-workers", self.workers, "must be at least 1")
        if self.cpus_per_worker < 1:
            raise ConfigError("--ray-cpus-per-worker", self.cpus_per_worker, "must be at least 1")
        if self.commit_passages < 1:
            raise ConfigError("--ray-commit", self.commit_passages, "must be at least 1")


class PassageEncoder:
    """A Ray Data actor: loads the checkpoint and the retriever once, then turns chunks of passages into rows of the
    passages table (`cprag.index.store.passage_schema`)."""

    def __init__(self, checkpoint: str | None, device: str, dtype: str | None, fingerprint: str, key_codec: str,
                 threads: int, encode: Callable):
        import torch

        from cprag.index.retrieve import MiniLMEmbedder
        from cprag.model.checkpoint import load_model, model_fingerprint
        from cprag.model.runtime import place, resolve_dtype

        torch.set_num_threads(threads)  # the CPUs Ray reserved for this actor, not every core of the node
        model, self.tokenizer = load_model(checkpoint)
        found = model_fingerprint(model)
        if found != fingerprint:  # a node with another checkpoint at the same path would write foreign keys
            raise CheckpointError(checkpoint or "default", f"on a Ray worker its fingerprint is {found[:16]}…, on "
                                  f"the driver {fingerprint[:16]}…: every node needs the same checkpoint files")
        self.model = place(model, device, resolve_dtype(device, dtype))
        self.embedder = MiniLMEmbedder(device=device)
        self.key_codec = key_codec
        self.encode = encode  # the single-process path's chunk encoder, so both write the same rows

    def __call__(self, batch: dict) -> dict:
        import pyarrow as pa

        from cprag.index.corpus import Passage
        from cprag.index.store import passage_schema

        rows = []
        for chunk_json in batch["chunk"]:
            chunk = json.loads(chunk_json)
            passages = [Passage(**p["passage"]) for p in chunk]
            metadata = {p["passage"]["doc_id"]: p["metadata"] for p in chunk}
            chunk_rows, _ = self.encode(passages, metadata, self.model, self.tokenizer, self.embedder,
                                         self.key_codec)
            rows.extend(chunk_rows)
        return pa.Table.from_pylist(rows, schema=passage_schema(self.embedder.dim))


def encode_on_ray(store, todo: list, metadata: dict, chunk_passages: int, key_codec: str, fingerprint: str,
                  settings: RayIndexSettings, encode: Callable,
                  on_progress: Callable[[str, int, int], None] | None = None) -> tuple[int, float]:
    """Encode `todo` (passages) into `store` on a Ray cluster; returns (tokens encoded, seconds encoding).

    `encode(chunk, metadata, model, tokenizer, embedder, key_codec) -> (rows, seconds)` is the caller's chunk
    encoder (`cprag.index.build.encode_chunk`), handed to every actor: the launcher knows nothing of indexing."""
    if not todo:
        return 0, 0.0
    ray, data, fragment_writer = _ray_modules()
    started = time.perf_counter()
    _connect(ray, settings)
    try:
        device = settings.device or ("cuda" if ray.cluster_resources().get("GPU", 0) >= 1 else "cpu")
        gpus = 1 if device.startswith("cuda") else 0
        resources = ray.cluster_resources()
        workers = settings.workers or (max(1, int(resources.get("GPU", 1))) if gpus else  # one actor per GPU
                                       max(1, int(resources.get("CPU", 1)) // settings.cpus_per_worker))
        chunks = [todo[i : i + chunk_passages] for i in range(0, len(todo), chunk_passages)]
        items = [{"chunk": json.dumps([{"passage": vars(p), "metadata": metadata[p.doc_id]} for p in chunk],
                                      ensure_ascii=False)} for chunk in chunks]
        encoded = data.from_items(items, override_num_blocks=max(1, len(items))).map_batches(
            PassageEncoder, batch_size=1, compute=data.ActorPoolStrategy(size=min(workers, max(1, len(items)))),
            num_cpus=settings.cpus_per_worker, num_gpus=gpus,
            fn_constructor_kwargs=dict(checkpoint=settings.checkpoint, device=device, dtype=settings.dtype,
                                       fingerprint=fingerprint, key_codec=key_codec,
                                       threads=settings.cpus_per_worker, encode=encode),
        )
        from cprag.index.store import passage_schema

        writer = fragment_writer(store.uri, schema=passage_schema(store.embedding_dim), use_legacy_format=None,
                                 data_storage_version=store.data_storage_version)  # the table's own file format
        written = encoded.map_batches(writer, batch_size=None, batch_format="pyarrow")
        pending, pending_rows, done = [], 0, 0
        batches = written.iter_batches(batch_size=None, batch_format="pyarrow")
        for batch in _reraising(batches, settings.address):
            for blob in batch.column("fragment").to_pylist():
                fragment = pickle.loads(blob)
                pending.append(fragment)
                pending_rows += fragment.physical_rows
            if pending_rows >= settings.commit_passages:
                store.append_fragments(pending)
                done += pending_rows
                pending, pending_rows = [], 0
                if on_progress:
                    on_progress("encode", done, len(todo))
        if pending:
            store.append_fragments(pending)
            done += pending_rows
            if on_progress:
                on_progress("encode", done, len(todo))
    finally:
        ray.shutdown()  # stops the local cluster this call started; leaves a joined one running
    return store.tokens_of({p.passage_id for p in todo}), time.perf_counter() - started


def _reraising(batches, address: str | None):
    """The batches, with an actor's own cprag error (a foreign checkpoint, a missing backbone) raised as itself,
    and any other failure of the Ray job as one ClusterError line."""
    from cprag.errors import CpragError

    try:
        yield from batches
    except Exception as error:
        cause: BaseException | None = error
        while cause is not None:
            if isinstance(cause, CpragError):
                raise cause from None
            cause = getattr(cause, "cause", None) or cause.__cause__
        lines = [line for line in str(error).splitlines() if line.strip()]
        raise ClusterError(address, f"the Ray job failed: {lines[-1] if lines else type(error).__name__}") from error


def _check_reachable(address: str, seconds: float = 5.0) -> None:
    """Fail in seconds, not minutes: Ray retries an address that does not answer for a long time."""
    import socket

    host, _, port = address.split("://")[-1].rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError("--ray", address, "expected HOST:PORT, ray://HOST:PORT, auto or local")
    try:
        socket.create_connection((host, int(port)), timeout=seconds).close()
    except OSError as error:
        raise ClusterError(address, f"nothing answers there ({error.strerror or error})") from None


def _ray_modules():
    try:
        import ray
        import ray.data
        from lance_ray import LanceFragmentWriter
    except ImportError as error:
        raise ClusterError(None, f"{error.name or 'ray'} is not installed; run: {INSTALL}") from None
    return ray, ray.data, LanceFragmentWriter


def _connect(ray, settings: RayIndexSettings) -> None:
    """Join the cluster at `settings.address`, or start a local one; the driver's CPRAG_* settings (cache folder,
    dtype) and MKL's reproducibility mode travel to the workers, so they convert and encode as this process would
    (an actor reserves fewer threads than the driver has: only that mode keeps its keys equal)."""
    env = {name: value for name, value in os.environ.items() if name.startswith("CPRAG_") or name == "MKL_CBWR"}
    runtime_env = {"env_vars": env} if env else None
    if settings.address not in (None, "auto"):
        _check_reachable(settings.address)
    if ray.is_initialized():
        ray.shutdown()
    logging.getLogger("ray").setLevel(logging.WARNING)  # stderr is cprag's progress bar, not Ray's plan
    try:
        with warnings.catch_warnings():  # Ray forks its processes; lance and lancedb warn about forks in general
            warnings.filterwarnings("ignore", message=".*fork", category=RuntimeWarning)
            warnings.filterwarnings("ignore", message=".*fork", category=UserWarning)
            if settings.address is None:
                ray.init(address="local", include_dashboard=False, runtime_env=runtime_env, log_to_driver=False,
                         logging_level=logging.WARNING)
            else:
                ray.init(address=settings.address, runtime_env=runtime_env, log_to_driver=False,
                         logging_level=logging.WARNING)
    except (ConnectionError, RuntimeError, ValueError) as error:
        raise ClusterError(settings.address, str(error).strip().splitlines()[0]) from None
    for name in ("ray", "ray.data"):  # Ray configures its loggers in init; cprag's bar says how far it is
        logging.getLogger(name).setLevel(logging.ERROR)
    ray.data.DataContext.get_current().enable_progress_bars = False  # cprag draws its own bar on stderr
