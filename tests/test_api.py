"""Index and ask end to end on a tiny GGUF-based CPLM, with the real LanceDB, FAISS and MiniLM retriever."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from cprag.api import Index
from cprag.cli import app
from cprag.decoding.generate import generate
from cprag.errors import ConfigError, IndexCorrupt, IndexLocked, ModelMismatch, QuestionTooLong, TooFewPassages
from cprag.index.build import IndexConfig, build_index
from cprag.model.checkpoint import load_model, model_fingerprint
from tests.index_helpers import index_corpus, stored_rows, wait_for, writer_script
from tests.tiny_models import (  # noqa: F401
    DOCS,
    tiny_checkpoint,
    tiny_tokenizer,
    with_extra_docs,
    write_jsonl,
    write_tiny_gguf,
)


def test_index_builds_manifest_rows_and_faiss(tmp_path, checkpoint, embedder):
    report = index_corpus(write_jsonl(tmp_path / "c.jsonl", DOCS), tmp_path / "idx", checkpoint, embedder)
    manifest = report.manifest
    assert report.encoded == 5 and manifest["status"] == "complete" and manifest["format_version"] == 2
    assert manifest["key_dim"] == 8 and manifest["retriever"]["name"] == "all-MiniLM-L6-v2"
    assert manifest["counts"]["passages"] == 5 and manifest["counts"]["tokens"] > 5 * 20
    assert manifest["bytes_per_token"] == 2 * 8 + 4  # fp16 key + int32 token id
    assert len(manifest["model_fingerprint"]) == 64
    version = manifest["table_version"]  # the FAISS files are named by the table version they were built from
    assert manifest["faiss"] == {"index": f"faiss-v{version}.index", "ids": f"faiss-v{version}.ids.json"}
    assert sorted(p.name for p in (tmp_path / "idx").glob("faiss*")) == sorted(manifest["faiss"].values())


def test_rerun_upserts_only_new_or_changed_documents_and_drops_stale_passages(tmp_path, checkpoint, embedder):
    corpus, index_dir = tmp_path / "c.jsonl", tmp_path / "idx"
    index_corpus(write_jsonl(corpus, DOCS[:3]), index_dir, checkpoint, embedder)
    long_text = " ".join(f"Long sentence {i} is here." for i in range(30))
    grown = DOCS[:2] + [{"id": "clock", "title": "River Clock", "text": long_text}] + DOCS[3:]
    report = index_corpus(write_jsonl(corpus, grown), index_dir, checkpoint, embedder)
    assert report.encoded == report.passages - 2 and report.unchanged == 2  # new docs + the changed one
    ids = [row["passage_id"] for row in stored_rows(index_dir)]
    assert len(ids) == len(set(ids)) and "clock" not in ids and "clock@0" in ids
    again = index_corpus(corpus, index_dir, checkpoint, embedder)
    assert again.encoded == 0 and again.unchanged == again.passages
    shrunk = DOCS[:2] + [{"id": "clock", "title": "River Clock", "text": "Short again."}] + DOCS[3:]
    index_corpus(write_jsonl(corpus, shrunk), index_dir, checkpoint, embedder)
    ids = [row["passage_id"] for row in stored_rows(index_dir)]
    assert sorted(ids) == sorted(d["id"] for d in DOCS)


def test_interrupted_build_resumes_without_losing_or_duplicating(tmp_path, checkpoint, embedder):
    corpus = write_jsonl(tmp_path / "c.jsonl", DOCS)
    clean_dir, broken_dir = tmp_path / "clean", tmp_path / "broken"
    index_corpus(corpus, clean_dir, checkpoint, embedder, chunk_passages=2)

    def interrupt(stage, done, total):
        if done >= 2:
            raise KeyboardInterrupt

    model, tokenizer = load_model(checkpoint)
    with pytest.raises(KeyboardInterrupt):
        build_index(corpus, broken_dir, model, tokenizer, embedder, IndexConfig(120, chunk_passages=2),
                    on_progress=interrupt)
    assert json.loads((broken_dir / "manifest.json").read_text())["status"] == "building"
    with pytest.raises(IndexCorrupt, match="did not finish"):
        Index(broken_dir, checkpoint=checkpoint)
    resumed = index_corpus(corpus, broken_dir, checkpoint, embedder, chunk_passages=2)
    assert resumed.unchanged == 2 and resumed.encoded == 3
    assert stored_rows(broken_dir) == stored_rows(clean_dir)


def test_a_killed_index_process_resumes_cleanly(tmp_path, checkpoint, embedder):
    corpus = write_jsonl(tmp_path / "c.jsonl", DOCS)
    script = f"""
import os, signal, sys
sys.path.insert(0, {str(tmp_path)!r})
from cprag.model.checkpoint import load_model
from cprag.index.build import IndexConfig, build_index
from cprag.index.retrieve import MiniLMEmbedder
model, tokenizer = load_model({str(checkpoint)!r})
def kill(stage, done, total):
    if done >= 3:
        os.kill(os.getpid(), signal.SIGKILL)
build_index({str(corpus)!r}, {str(tmp_path / 'idx')!r}, model, tokenizer, MiniLMEmbedder(),
            IndexConfig(120, chunk_passages=1), on_progress=kill)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == -9
    assert len(stored_rows(tmp_path / "idx")) == 3
    resumed = index_corpus(corpus, tmp_path / "idx", checkpoint, embedder)
    assert resumed.encoded == 2 and len(stored_rows(tmp_path / "idx")) == 5


def test_a_second_writer_is_refused_at_once_and_the_first_finishes_clean(tmp_path, checkpoint, embedder):
    corpus = write_jsonl(tmp_path / "c.jsonl", DOCS)
    index_corpus(corpus, tmp_path / "clean", checkpoint, embedder)
    index_dir, marker = tmp_path / "idx", tmp_path / "started"
    first = subprocess.Popen([sys.executable, "-c", writer_script(checkpoint, corpus, index_dir, marker, 0.5)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(marker, first)
    with pytest.raises(IndexLocked) as refused:
        index_corpus(corpus, index_dir, checkpoint, embedder)
    assert refused.value.pid == first.pid and refused.value.lock_path.endswith(".write.lock")
    result = CliRunner().invoke(app, ["index", str(corpus), "--index", str(index_dir), "--max-passage-tokens",
                                      "120", "--checkpoint", str(checkpoint)])
    assert result.exit_code == 1 and f"process {first.pid}" in result.output and ".write.lock" in result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    assert first.wait(timeout=120) == 0, first.communicate()
    assert stored_rows(index_dir) == stored_rows(tmp_path / "clean")  # the refused writer changed nothing
    again = index_corpus(corpus, index_dir, checkpoint, embedder)  # the lock was released at the end
    assert again.encoded == 0


def test_the_lock_of_a_killed_writer_is_taken_over(tmp_path, checkpoint, embedder):
    corpus = write_jsonl(tmp_path / "c.jsonl", DOCS)
    index_dir, marker = tmp_path / "idx", tmp_path / "started"
    writer = subprocess.Popen([sys.executable, "-c", writer_script(checkpoint, corpus, index_dir, marker, 30)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(marker, writer)
    writer.kill()
    writer.wait()
    assert json.loads((index_dir / ".write.lock").read_text())["pid"] == writer.pid  # stale file left behind
    resumed = index_corpus(corpus, index_dir, checkpoint, embedder)
    assert resumed.unchanged == 1 and resumed.encoded == 4
    assert json.loads((index_dir / "manifest.json").read_text())["status"] == "complete"


def test_an_index_built_by_another_model_is_refused_and_left_intact(tmp_path, checkpoint, embedder):
    corpus = write_jsonl(tmp_path / "c.jsonl", DOCS)
    index_corpus(corpus, tmp_path / "idx", checkpoint, embedder)
    before = stored_rows(tmp_path / "idx")
    other = tiny_checkpoint(tmp_path / "other", seed=1)
    with pytest.raises(ModelMismatch):
        Index(tmp_path / "idx", checkpoint=other)
    with pytest.raises(ModelMismatch):
        index_corpus(corpus, tmp_path / "idx", other, embedder)
    result = CliRunner().invoke(app, ["ask", "When?", "--index", str(tmp_path / "idx"), "--checkpoint", str(other)])
    assert result.exit_code != 0 and "built with model" in result.output
    assert stored_rows(tmp_path / "idx") == before


def test_a_checkpoint_that_differs_only_in_its_adapters_is_another_model(tmp_path, checkpoint, embedder):
    index_corpus(write_jsonl(tmp_path / "c.jsonl", DOCS), tmp_path / "idx", checkpoint, embedder)
    adapted = tiny_checkpoint(tmp_path / "adapted", adapter_layers=[1], adapter_rank=2)
    model, _ = load_model(adapted)
    plain, _ = load_model(checkpoint)
    assert model_fingerprint(model) != model_fingerprint(plain)
    with pytest.raises(ModelMismatch):  # keys from a backbone the adapters changed
        Index(tmp_path / "idx", checkpoint=adapted)
    described = json.loads(CliRunner().invoke(app, ["model", "--checkpoint", str(adapted), "--json"]).stdout)
    assert described["adapters"]["layers"] == [1] and described["adapters"]["parameters"] > 0
    assert described["fingerprint"] == model_fingerprint(model)
    index_corpus(write_jsonl(tmp_path / "c.jsonl", DOCS), tmp_path / "adapted-idx", adapted, embedder)
    assert Index(tmp_path / "adapted-idx", checkpoint=adapted).ask("When did the bridge open?", k=2).passages
    with torch.no_grad():  # training moved one adapter: another fingerprint, other keys
        moved = AutoModelForCausalLM.from_pretrained(adapted)
        moved.adapters["layer1_v_proj"].lora_B.fill_(0.05)
    moved.save_pretrained(tmp_path / "moved")
    again, _ = load_model(tmp_path / "moved")
    assert model_fingerprint(again) != model_fingerprint(model)
    ids = torch.tensor([[5, 6, 7, 8]])
    assert not torch.allclose(again.document_keys(ids).keys, model.document_keys(ids).keys)


def test_a_bf16_encoded_index_belongs_to_the_checkpoint_and_opens_in_fp32(tmp_path, checkpoint, embedder):
    corpus = write_jsonl(tmp_path / "c.jsonl", DOCS)
    index_corpus(corpus, tmp_path / "fp32", checkpoint, embedder)
    result = CliRunner().invoke(app, ["index", str(corpus), "--index", str(tmp_path / "bf16"), "--checkpoint",
                                      str(checkpoint), "--dtype", "bfloat16", "--max-passage-tokens", "120",
                                      "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["dtype"] == "bfloat16"
    manifest = json.loads((tmp_path / "bf16" / "manifest.json").read_text())
    reference = json.loads((tmp_path / "fp32" / "manifest.json").read_text())
    assert manifest["encode_dtype"] == "bfloat16" and reference["encode_dtype"] == "float32"
    assert manifest["model_fingerprint"] == reference["model_fingerprint"]  # the stored weights', not the cast's
    opened = Index(tmp_path / "bf16", checkpoint=checkpoint, dtype="float32")
    assert opened.ask("When did the bridge open?", k=2).passages
    low, full = stored_rows(tmp_path / "bf16"), stored_rows(tmp_path / "fp32")
    assert [r["token_ids"] for r in low] == [r["token_ids"] for r in full]
    low_keys, full_keys = (torch.from_numpy(np.frombuffer(b"".join(r["keys"] for r in rows), dtype=np.float16)
                                            .astype(np.float32)) for rows in (low, full))
    assert not torch.equal(low_keys, full_keys)  # really encoded in bf16, and close to fp32
    assert torch.nn.functional.cosine_similarity(low_keys, full_keys, dim=0) > 0.99
    bad = CliRunner().invoke(app, ["index", str(corpus), "--index", str(tmp_path / "x"), "--dtype", "fp8"])
    assert bad.exit_code != 0 and "--dtype" in bad.output and not (tmp_path / "x").exists()


def test_int8_keys_take_14_of_20_bytes_per_token_and_a_codec_change_needs_rebuild(tmp_path, checkpoint, embedder):
    corpus = write_jsonl(tmp_path / "c.jsonl", DOCS)
    index_corpus(corpus, tmp_path / "fp16", checkpoint, embedder)
    report = index_corpus(corpus, tmp_path / "int8", checkpoint, embedder, key_codec="int8")
    assert report.manifest["key_dtype"] == "int8"
    assert report.manifest["bytes_per_token"] == 8 + 2 + 4  # int8 key (dim 8), its fp16 scale, int32 token id
    full, small = Index(tmp_path / "fp16", checkpoint=checkpoint), Index(tmp_path / "int8", checkpoint=checkpoint)
    ids = [row["passage_id"] for row in stored_rows(tmp_path / "fp16")]
    wide, narrow = full.store.fetch(ids), small.store.fetch(ids)
    for pid in ids:
        a, b = wide[pid].keys.keys.astype(np.float32), narrow[pid].keys.keys
        assert np.array_equal(wide[pid].keys.ids, narrow[pid].keys.ids)
        assert np.abs(a - b).max() <= np.abs(a).max() / 127  # within a level of each key's scale
    assert small.ask("When did the bridge open?", k=2).passages
    before = stored_rows(tmp_path / "int8")
    with pytest.raises(ConfigError, match="--keys.*stores int8 keys.*--rebuild"):
        index_corpus(corpus, tmp_path / "int8", checkpoint, embedder)  # fp16 rows into an int8 table: refused
    assert stored_rows(tmp_path / "int8") == before
    result = CliRunner().invoke(app, ["index", str(corpus), "--index", str(tmp_path / "int8"), "--checkpoint",
                                      str(checkpoint), "--max-passage-tokens", "120", "--keys", "fp16"])
    assert result.exit_code == 2 and "--rebuild" in result.output
    result = CliRunner().invoke(app, ["index", str(corpus), "--index", str(tmp_path / "int8"), "--checkpoint",
                                      str(checkpoint), "--max-passage-tokens", "120", "--keys", "fp16",
                                      "--rebuild", "--json"])
    assert result.exit_code == 0 and json.loads(result.stdout)["keys"] == "float16"
    info = json.loads(CliRunner().invoke(app, ["info", "--index", str(tmp_path / "int8"), "--json"]).stdout)
    assert info["key_dtype"] == "float16" and info["bytes_per_token"] == 2 * 8 + 4


def test_pq_keys_learn_a_codebook_from_the_first_chunks_and_store_one_byte_per_subvector(tmp_path, checkpoint,
                                                                                        embedder):
    docs = with_extra_docs()
    corpus = write_jsonl(tmp_path / "c.jsonl", docs)
    index_corpus(corpus, tmp_path / "fp16", checkpoint, embedder, chunk_passages=4)
    report = index_corpus(corpus, tmp_path / "pq", checkpoint, embedder, key_codec="pq", chunk_passages=4)
    manifest = report.manifest
    assert manifest["key_dtype"] == "pq" and manifest["key_pq"]["subvectors"] == 8  # key_dim 8: 1 dim each
    assert manifest["bytes_per_token"] == 8 + 4 and (tmp_path / "pq" / manifest["key_pq"]["file"]).is_file()
    assert report.encoded == len(docs) and manifest["counts"]["tokens"] >= 256
    full, small = Index(tmp_path / "fp16", checkpoint=checkpoint), Index(tmp_path / "pq", checkpoint=checkpoint)
    ids = [row["passage_id"] for row in stored_rows(tmp_path / "fp16")]
    assert ids == [row["passage_id"] for row in stored_rows(tmp_path / "pq")]
    wide, narrow = full.store.fetch(ids), small.store.fetch(ids)
    a = np.concatenate([wide[pid].keys.keys.astype(np.float32) for pid in ids])
    b = np.concatenate([narrow[pid].keys.keys for pid in ids])
    assert ((a - b) ** 2).sum() / (a**2).sum() < 0.01  # 256 centroids per dimension: close to the fp16 keys
    assert small.ask("When did the bridge open?", k=2).passages
    before = stored_rows(tmp_path / "pq")
    again = index_corpus(corpus, tmp_path / "pq", checkpoint, embedder, key_codec="pq", chunk_passages=4)
    assert again.encoded == 0 and stored_rows(tmp_path / "pq") == before  # the codebook is kept, not relearned
    (tmp_path / "pq" / manifest["key_pq"]["file"]).unlink()
    with pytest.raises(IndexCorrupt, match="codebook"):
        Index(tmp_path / "pq", checkpoint=checkpoint)
    with pytest.raises(ConfigError, match="at least 256 keys"):
        index_corpus(write_jsonl(tmp_path / "small.jsonl", DOCS[:2]), tmp_path / "tiny", checkpoint, embedder,
                     key_codec="pq")


def test_no_answer_is_said_plainly_with_the_passages_read(tmp_path, checkpoint, embedder):
    index_corpus(write_jsonl(tmp_path / "c.jsonl", DOCS), tmp_path / "idx", checkpoint, embedder)
    base = ["--index", str(tmp_path / "idx"), "--checkpoint", str(checkpoint), "-k", "2", "--max-new-tokens", "4",
            "--min-retrieval-score", "-1"]  # the confidence path alone (the retrieval floor: the next test)
    answered = json.loads(CliRunner().invoke(app, ["ask", "When was it built?", "--json", *base]).stdout)
    assert 0.0 <= answered["confidence"] <= 1.0 and not answered["no_answer"]
    withheld = CliRunner().invoke(app, ["ask", "When was it built?", "--json", "--min-confidence", "1", *base])
    line = json.loads(withheld.stdout)
    assert line["no_answer"] and line["answer"] == "" and line["citations"] == []
    assert len(line["passages"]) == 2 and line["confidence"] == answered["confidence"]
    shown = CliRunner().invoke(app, ["ask", "When was it built?", "--min-confidence", "1", *base])
    assert shown.exit_code == 0 and "hold no answer" in shown.stdout and "read " in shown.stdout
    closed = json.loads(CliRunner().invoke(app, ["ask", "When?", "--closed", "--json", *base]).stdout)
    assert closed["confidence"] is None and not closed["no_answer"]  # nothing to copy from, nothing withheld
    bad = CliRunner().invoke(app, ["ask", "When?", "--min-confidence", "2", *base])
    assert bad.exit_code != 0 and "--min-confidence" in bad.output


def test_a_question_no_passage_is_about_is_withheld_before_decoding(tmp_path, checkpoint, embedder):
    from cprag.api import MIN_RETRIEVAL_SCORE

    index_corpus(write_jsonl(tmp_path / "c.jsonl", DOCS), tmp_path / "idx", checkpoint, embedder)
    index = Index(tmp_path / "idx", checkpoint=checkpoint)
    question = "What is the capital of France?"
    best = index.retrieve([question], 1)[0][0].score
    assert best < MIN_RETRIEVAL_SCORE < index.retrieve(["When was the lighthouse at Varna Point built?"], 1)[0][0].score
    withheld = index.ask(question, k=2, min_retrieval_score=best + 0.01)
    assert withheld.no_answer and withheld.no_answer_reason == "retrieval" and withheld.answer == ""
    assert "generate" not in withheld.timings_ms and len(withheld.passages) == 2  # not decoded, still listed
    decoded = index.ask(question, k=2, min_retrieval_score=best - 0.01, min_confidence=0.0)
    assert not decoded.no_answer and decoded.no_answer_reason is None and "generate" in decoded.timings_ms
    base = ["--index", str(tmp_path / "idx"), "--checkpoint", str(checkpoint), "-k", "2"]
    shown = CliRunner().invoke(app, ["ask", question, *base])  # the default floor
    assert shown.exit_code == 0 and "none of them is about it" in shown.stdout and "read " in shown.stdout
    line = json.loads(CliRunner().invoke(app, ["ask", question, "--json", *base]).stdout)
    assert line["no_answer_reason"] == "retrieval" and line["confidence"] is None
    bad = CliRunner().invoke(app, ["ask", question, "--min-retrieval-score", "3", *base])
    assert bad.exit_code != 0 and "--min-retrieval-score" in bad.output


@pytest.mark.parametrize("mode", ["hidden", "visible"])
def test_citation_spans_equal_the_copied_text(tmp_path, copying_checkpoint, embedder, mode):
    """Hidden mode copies from stored keys; visible mode from keys of the passages in its prompt. Both cite."""
    index_corpus(write_jsonl(tmp_path / "c.jsonl", DOCS), tmp_path / "idx", copying_checkpoint, embedder)
    index = Index(tmp_path / "idx", checkpoint=copying_checkpoint)
    hits = index.retrieve(["When was the lighthouse built?"], 2)[0]
    passages = index.cache.get([h.passage_id for h in hits], index.store.fetch)
    generation = generate(index.model, index.tokenizer, "When was the lighthouse built?", passages, mode,
                          max_new_tokens=12)
    if mode == "visible":  # without prompt keys only own-context entries remain, and they cite nothing
        plain = generate(index.model, index.tokenizer, "When was the lighthouse built?", passages, mode,
                         max_new_tokens=12, visible_keys=False)
        assert not plain.citations and not any(plain.sources)
    copied = [(t, s) for t, s in zip(generation.token_ids, generation.sources, strict=True) if s is not None]
    assert copied and generation.citations
    # the head copies everything, so ending at once can only come from the "end here" twins' share
    assert 0.0 <= generation.stop_probability < 1.0
    for token, (passage, position) in copied:  # every copied token is the stored token it points at
        assert passages[passage].passage.keys.ids[position] == token
    runs = []  # rebuild the runs of consecutive copies and compare each with its citation
    for token, source in zip(generation.token_ids, generation.sources, strict=True):
        if source is None:
            continue
        if runs and runs[-1][0] == source[0] and runs[-1][2] + 1 == source[1]:
            runs[-1] = (source[0], runs[-1][1] + [token], source[1])
        else:
            runs.append((source[0], [token], source[1]))
    assert len(runs) == len(generation.citations)
    for (_, tokens, _), citation in zip(runs, generation.citations, strict=True):
        document = next(d for d in DOCS if d["id"] == citation.doc_id)
        assert citation.text == document["text"][citation.start : citation.end]
        assert index.tokenizer.decode(tokens).strip() == citation.text.strip()


def test_the_visible_prompt_holds_each_passage_at_its_span_and_fits_its_budget(tmp_path):
    from cprag.decoding.prompt import prompt_ids, visible_prompt_layout

    tokenizer = tiny_tokenizer(tmp_path)
    bodies = [tokenizer(d["text"], add_special_tokens=False)["input_ids"] for d in DOCS[:3]]
    prompt, spans = visible_prompt_layout(tokenizer, "When?", bodies, budget=10_000)
    assert len(spans) == 3
    for (start, kept), body in zip(spans, bodies, strict=True):
        assert kept == len(body) and prompt[start : start + kept] == body
    text = tokenizer.decode(prompt)
    assert text.index("Passage 1:") < text.index("Passage 3:") < text.index("Question: When?")
    assert prompt[:3] == prompt_ids(tokenizer, "When?")[:3]  # the same chat template around it
    question_only = len(visible_prompt_layout(tokenizer, "When?", [], 10_000)[0])
    for budget in (len(prompt) - 1, question_only + len(bodies[0]) // 2):
        cut, cut_spans = visible_prompt_layout(tokenizer, "When?", bodies, budget)
        assert len(cut) <= budget and cut_spans
        start, kept = cut_spans[-1]
        assert cut[start : start + kept] == bodies[len(cut_spans) - 1][:kept]
    assert visible_prompt_layout(tokenizer, "When?", bodies, question_only)[1] == []


def test_key_shards_are_reused_across_questions_and_evicted_lru(tmp_path, checkpoint, embedder):
    index_corpus(write_jsonl(tmp_path / "c.jsonl", DOCS), tmp_path / "idx", checkpoint, embedder)
    index = Index(tmp_path / "idx", checkpoint=checkpoint)
    loads = []
    fetch = index.store.fetch
    index.store.fetch = lambda ids: loads.append(list(ids)) or fetch(ids)
    index.ask("When did the glass bridge open?", k=2, max_new_tokens=2)
    index.ask("When did the glass bridge open?", k=2, max_new_tokens=2)
    assert len(loads) == 1 and index.cache.hits == 2 and index.cache.misses == 2
    sizes = {pid: p.n_tokens for pid, p in index.store.fetch(["ferry", "geese"]).items()}
    index.cache.max_bytes = sum(n * (8 * 2 + 8) for n in sizes.values())  # fp16 keys (D=8) + int64 ids
    index.ask("What time does the night ferry leave?", k=1, max_new_tokens=2)
    index.ask("When do the geese arrive?", k=1, max_new_tokens=2)
    assert len(index.cache.entries) == 2 and index.cache.bytes <= index.cache.max_bytes


def test_ask_json_schema_and_batch_questions(tmp_path, checkpoint, embedder):
    index_corpus(write_jsonl(tmp_path / "c.jsonl", DOCS), tmp_path / "idx", checkpoint, embedder)
    questions = tmp_path / "q.jsonl"
    questions.write_text('{"question": "When was the lighthouse built?"}\n{"question": "When do geese arrive?"}\n')
    base = ["--index", str(tmp_path / "idx"), "--checkpoint", str(checkpoint), "-k", "2", "--max-new-tokens", "4"]
    result = CliRunner().invoke(app, ["ask", "--questions", str(questions), "--json", *base])
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.stdout.strip().splitlines()]
    assert len(lines) == 2
    for line in lines:
        assert {"question", "answer", "citations", "passages", "timings_ms"} <= set(line)
        assert all(set(c) >= {"doc_id", "title", "start", "end", "text"} for c in line["citations"])
        assert [set(p) >= {"doc_id", "score"} for p in line["passages"]] == [True, True]
        assert all(p["doc_id"] in {d["id"] for d in DOCS} for p in line["passages"])
        assert set(line["timings_ms"]) >= {"retrieve", "load_keys", "generate", "total"}
    visible = CliRunner().invoke(app, ["ask", "When?", "--visible", "--json", *base])
    assert visible.exit_code == 0 and json.loads(visible.stdout)["mode"] == "visible"
    info = CliRunner().invoke(app, ["info", "--index", str(tmp_path / "idx"), "--json"])
    assert json.loads(info.stdout)["bytes_per_token"] == 20


def test_bad_input_gets_one_line_errors_and_keeps_the_index(tmp_path, checkpoint, embedder):
    index_dir = tmp_path / "idx"
    index_corpus(write_jsonl(tmp_path / "c.jsonl", DOCS), index_dir, checkpoint, embedder)
    before = stored_rows(index_dir)
    runner = CliRunner()
    base = ["--checkpoint", str(checkpoint)]
    cases = [
        (["ask", "When?", "--index", str(tmp_path / "nowhere"), *base], "no cprag index"),
        (["ask", "When?", "--index", str(index_dir), "-k", "9", *base], "more passages than the index holds"),
        (["ask", "why " * 200, "--index", str(index_dir), *base], "window"),
        (["index", str(tmp_path / "empty.jsonl"), "--index", str(index_dir), "--max-passage-tokens", "120", *base],
         "empty"),
        (["info", "--index", str(tmp_path / "nowhere")], "no cprag index"),
        (["ask", "  ", "--index", str(index_dir), *base], "is empty"),
        (["ask", "\x01\x02\x1b", "--index", str(index_dir), *base], "is empty"),
        (["index", str(tmp_path / "twice.jsonl"), "--index", str(index_dir), "--max-passage-tokens", "120", *base],
         "is used twice"),
        (["index", str(tmp_path / "deep.json"), "--index", str(index_dir), "--max-passage-tokens", "120", *base],
         "nested too deeply"),
    ]
    (tmp_path / "empty.jsonl").write_text("")
    write_jsonl(tmp_path / "twice.jsonl", DOCS + DOCS[:1])
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    for args, message in cases:
        result = runner.invoke(app, args)
        assert result.exit_code != 0, args
        assert message in result.output and len(result.output.strip().splitlines()) == 1, result.output
    assert stored_rows(index_dir) == before
    index = Index(index_dir, checkpoint=checkpoint)
    with pytest.raises(TooFewPassages):
        index.ask("When?", k=6)
    with pytest.raises(QuestionTooLong):
        index.ask("why " * 200, k=1)


def test_python_api_mirrors_the_cli(tmp_path, checkpoint, embedder):
    import cprag

    index_corpus(write_jsonl(tmp_path / "c.jsonl", DOCS), tmp_path / "idx", checkpoint, embedder)
    answer = cprag.ask("When did the glass bridge open?", index=tmp_path / "idx", k=1, checkpoint=checkpoint)
    assert answer.passages[0]["doc_id"] == "bridge" and isinstance(answer.answer, str)
    assert 0.0 <= answer.copy_rate <= 1.0 and answer.timings_ms["total"] > 0
    assert cprag.index_info(tmp_path / "idx")["counts"]["documents"] == 5


@pytest.mark.parametrize("head,choose", [({}, "entry"), ({}, "token"), (dict(
    query_refine_layers=1, query_refine_dim=16, query_refine_window=6, lexical_prior=True, end_entries=True), "entry")],
    ids=["entry", "token", "refined-lexical"])
def test_drafted_copies_give_exactly_the_greedy_answer_in_fewer_passes(tmp_path, embedder, head, choose):
    checkpoint = tiny_checkpoint(tmp_path / "model", copy_everything=True, successor=(6.0, 0.0), **head)
    index_corpus(write_jsonl(tmp_path / "c.jsonl", DOCS), tmp_path / "idx", checkpoint, embedder)
    index = Index(tmp_path / "idx", checkpoint=checkpoint)
    passes = []
    forward = index.model.forward
    index.model.forward = lambda *args, **kwargs: passes.append(1) or forward(*args, **kwargs)
    counts = {}
    for question in ["When was the lighthouse built?", "Who designed the bridge?", "Where do geese go?"]:
        hits = index.retrieve([question], 3)[0]
        passages = index.cache.get([h.passage_id for h in hits], index.store.fetch)
        for draft in (0, 8):
            passes.clear()
            generation = generate(index.model, index.tokenizer, question, passages, max_new_tokens=16,
                                  draft_tokens=draft, stop_at_end=False, choose=choose)
            counts.setdefault(question, []).append((generation.token_ids, generation.sources, len(passes)))
    for (plain, plain_sources, plain_passes), (drafted, drafted_sources, drafted_passes) in counts.values():
        assert drafted == plain and drafted_sources == plain_sources
        assert drafted_passes <= plain_passes
    assert sum(c[1][2] for c in counts.values()) < sum(c[0][2] for c in counts.values())


def test_entry_choice_follows_the_surest_entry_where_the_mixture_sums_a_spread_token():
    from cprag.decoding.step import Step, best_derivation
    from cprag.model.copy_head import CopyMemory

    vocab, spread, single = 12, 3, 7
    memory = CopyMemory(keys=torch.zeros(1, 5, 2), ids=torch.tensor([[spread, spread, spread, single, 9]]))
    attention = torch.tensor([0.2, 0.2, 0.2, 0.3, 0.05, 0.05])  # 5 external entries, 1 own-context entry
    entry_ids = torch.tensor([spread, spread, spread, single, 9, 4])
    gate = 0.9
    generator = torch.full((vocab,), 0.1 / vocab)
    mixture = generator.clone().index_add_(0, entry_ids, gate * attention)
    step = Step(log_probs=mixture.log(), log_gate=torch.tensor(gate).log(), copy_log_attention=attention.log())
    assert int(mixture.argmax()) == spread  # the marginal favours the token spread over three entries
    assert best_derivation(step, entry_ids, memory.size) == (single, 3)
    shut = Step(log_probs=generator.log(), log_gate=torch.tensor(1e-6).log(), copy_log_attention=attention.log())
    token, entry = best_derivation(shut, entry_ids, memory.size)
    assert entry is None and 0 <= token < vocab  # a shut gate leaves the generator's token


def test_whole_words_finish_every_copied_word(tmp_path, embedder):
    # entries pasting the question's number get +30; a successor bias of -20 never continues a span by itself, so
    # the head hops between digits, and every continuation below is the whole-word rule's
    checkpoint = tiny_checkpoint(tmp_path / "model", copy_everything=True, successor=(-20.0, 0.0), lexical_prior=True)
    index_corpus(write_jsonl(tmp_path / "c.jsonl", DOCS), tmp_path / "idx", checkpoint, embedder)
    index = Index(tmp_path / "idx", checkpoint=checkpoint)
    with torch.no_grad():
        index.model.cp_head.lexical.copy_(torch.tensor([0.0, 30.0]))  # (overlap, the pasted word is asked about)
    from cprag.model.lexical import inside_word

    question = "Was it 1871 or 2009?"
    passages = index.cache.get([h.passage_id for h in index.retrieve([question], 5)[0]], index.store.fetch)
    finished = {}
    for whole_words in (True, False):
        generation = generate(index.model, index.tokenizer, question, passages, max_new_tokens=16,
                              stop_at_end=False, whole_words=whole_words)
        finished[whole_words] = 0
        for source, following in zip(generation.sources, generation.sources[1:], strict=False):
            ids = passages[source[0]].ids
            if source[1] + 1 < len(ids) and bool(inside_word(index.tokenizer, ids)[source[1] + 1]):
                assert not whole_words or following == (source[0], source[1] + 1)
                finished[whole_words] += following == (source[0], source[1] + 1)
    assert finished[True] > 0 and finished[False] == 0
