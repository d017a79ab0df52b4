"""Evaluation: the needle generator, and the squad/needle/bench commands end to end on tiny models."""

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from cprag.cli import app
from cprag.evaluation.needle import NEEDLE, build_haystack
from cprag.index.reader import open_snapshot
from cprag.model.backbone import gguf_reference
from cprag.model.checkpoint import load_model
from cprag.model.cpu_features import cpu_name
from cprag.model.reader_checkpoint import new_reader, save_reader
from tests.tiny_models import DOCS, tiny_checkpoint, verifier_beside, write_jsonl, write_tiny_gguf
from tests.tiny_squad import tiny_squad


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    return load_model(checkpoint)[1]


@pytest.mark.parametrize("length", [300, 1000, 5000, 20000])
@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.9, 1.0])
def test_needle_sits_at_the_requested_depth_in_a_haystack_of_the_requested_length(tokenizer, length, depth):
    haystack = build_haystack(tokenizer, length, depth, "4829173", block_tokens=256)
    assert abs(haystack.length - length) <= 0.01 * length
    assert abs(haystack.depth - depth) <= 0.015  # at most 1% away, to start a sentence
    ids = [t for block in haystack.blocks for t in block]
    text = tokenizer.decode(ids)
    assert text.count("4829173") == 1 and NEEDLE.format(number="4829173") in text
    assert tokenizer.decode(ids[haystack.needle_token:]).lstrip().startswith("The magic number is 4829173.")
    filler = [b for i, b in enumerate(haystack.blocks) if i != haystack.needle_block]
    assert len({tuple(b) for b in filler if len(b) == 256}) <= 1  # full filler passages repeat exactly


def test_eval_squad_oracle_writes_results_summary_report_and_plots(tmp_path, checkpoint):
    data = tiny_squad(tmp_path / "tiny.json", missing_answer=False)
    result = CliRunner().invoke(app, ["eval", "squad", str(data), "--oracle", "--limit", "3", "--out",
                                      str(tmp_path / "out"), "--checkpoint", str(checkpoint), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    for key in ("qa/hidden/f1", "qa/hidden/em", "qa/visible/f1", "qa/closed/f1", "latency/hidden/p50_ms"):
        assert key in summary
    assert summary["qa/hidden/n"] == 3 and summary["eval/source"] == "oracle"
    lines = (tmp_path / "out" / "results.jsonl").read_text().splitlines()
    assert len(lines) == 9 and {json.loads(line)["mode"] for line in lines} == {"hidden", "visible", "closed"}
    for name in ("summary.json", "report.md", "f1_by_mode.png", "latency_by_mode.png"):
        assert (tmp_path / "out" / name).stat().st_size > 100
    batched = CliRunner().invoke(app, ["eval", "squad", str(data), "--oracle", "--limit", "3", "--batch-size", "2",
                                       "--out", str(tmp_path / "batched"), "--checkpoint", str(checkpoint), "--json"])
    assert batched.exit_code == 0, batched.output

    def answers(folder):
        rows = [json.loads(line) for line in (tmp_path / folder / "results.jsonl").read_text().splitlines()]
        return [(r["qid"], r["mode"], r["prediction"], r["passages"]) for r in rows]

    assert answers("batched") == answers("out")  # same memories, same answers, in the same order
    bf16 = CliRunner().invoke(app, ["eval", "squad", str(data), "--oracle", "--limit", "3", "--modes", "hidden",
                                    "--dtype", "bfloat16", "--out", str(tmp_path / "bf16"), "--checkpoint",
                                    str(checkpoint), "--json"])
    assert bf16.exit_code == 0, bf16.output
    assert json.loads(bf16.stdout)["qa/hidden/n"] == 3


def test_eval_squad_oracle_weighs_in_the_passage_prior_of_the_checkpoint_or_the_flag(tmp_path, checkpoint):
    import shutil

    from cprag.decoding.passage_prior import PassagePrior

    data = tiny_squad(tmp_path / "tiny.json", missing_answer=False)
    with_prior = tmp_path / "checkpoint"
    shutil.copytree(checkpoint, with_prior)
    PassagePrior(weight=50.0).save(with_prior)

    def run(folder, *extra):
        result = CliRunner().invoke(app, ["eval", "squad", str(data), "--oracle", "--limit", "3", "--modes", "hidden",
                                          "--out", str(tmp_path / folder), "--json", *extra])
        assert result.exit_code == 0, result.output
        rows = [json.loads(line) for line in (tmp_path / folder / "results.jsonl").read_text().splitlines()]
        return json.loads(result.stdout)["eval/passage_prior"], [(r["qid"], r["prediction"]) for r in rows]

    default, answers = run("default", "--checkpoint", str(with_prior))
    assert default == 50.0  # the checkpoint's passage_prior.json
    assert run("batched", "--checkpoint", str(with_prior), "--batch-size", "2") == (50.0, answers)
    assert run("flag", "--checkpoint", str(checkpoint), "--passage-prior", "50") == (50.0, answers)
    assert run("off", "--checkpoint", str(with_prior), "--passage-prior", "0")[0] == 0.0


def test_eval_squad2_scores_abstention_with_the_official_rules(tmp_path, checkpoint):
    data = tiny_squad(tmp_path / "tiny2.json", missing_answer=False, unanswerable=True)
    args = ["eval", "squad2", str(data), "--oracle", "--modes", "hidden,closed", "--out", str(tmp_path / "out"),
            "--checkpoint", str(checkpoint), "--json"]
    always = json.loads(CliRunner().invoke(app, [*args, "--min-confidence", "0"]).stdout)
    assert always["eval/questions"] == 12 and always["eval/unanswerable"] == 4 and always["qa2/hidden/has_n"] == 8
    results = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    unanswerable = [r for r in results if r["mode"] == "hidden" and not r["references"]]
    # nothing withheld: an unanswerable question counts as right only where the answer decoded to nothing
    assert always["qa2/hidden/noans_acc"] == 100 * sum(r["prediction"] == "" for r in unanswerable) / 4
    assert not any(r["no_answer"] for r in results)
    assert always["qa2/hidden/has_f1"] == always["qa2/hidden/has_f1_always"]
    never = json.loads(CliRunner().invoke(app, [*args, "--min-confidence", "1"]).stdout)
    assert never["qa2/hidden/noans_acc"] == 100.0 and never["qa2/hidden/has_f1"] == 0.0
    assert never["qa2/hidden/f1"] == pytest.approx(100 * 4 / 12, abs=0.01)  # only the 4 unanswerable are right
    assert never["qa2/closed/threshold"] == 0.0  # closed mode has no confidence, so it never withholds
    assert 0 <= never["qa2/hidden/best_threshold"] <= 1 and never["qa2/hidden/best_f1"] >= never["qa2/hidden/f1"]
    results = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert all(r["confidence"] is not None for r in results if r["mode"] == "hidden")
    for name in ("summary.json", "report.md", "abstention.png"):
        assert (tmp_path / "out" / name).stat().st_size > 100


def test_eval_squad2_scores_the_span_reader_by_its_null_entry(tmp_path, checkpoint):
    reader, _ = new_reader(gguf_reference(checkpoint.parent / "base.gguf"), adapter_rank=4, lookahead=1)
    save_reader(reader, tmp_path / "reader")
    data = tiny_squad(tmp_path / "tiny2.json", missing_answer=False, unanswerable=True)
    out = tmp_path / "out"
    args = ["eval", "squad2", str(data), "--modes", "hidden,reader", "--no-verify", "--out", str(out),
            "--checkpoint", str(checkpoint)]
    shown = CliRunner().invoke(app, [*args, "--reader", str(tmp_path / "reader"), "--json"])
    assert shown.exit_code == 0, shown.output
    summary = json.loads(shown.stdout)
    assert summary["qa2/reader/n"] == 12 and summary["qa2/reader/has_n"] == 8
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    read = [r for r in rows if r["mode"] == "reader"]
    assert len(read) == 12 and all(r["stop_probability"] is not None for r in read)
    # its own null entry withholds, whatever the confidence: an unanswerable question is right where it said so
    unanswerable = [r for r in read if not r["references"]]
    assert summary["qa2/reader/noans_acc"] == pytest.approx(100 * sum(r["prediction"] == "" for r in unanswerable)
                                                            / 4, abs=0.01)
    assert all(r["prediction"] == "" for r in read if r["no_answer"])
    # answering always gives back the spans it withheld, so HasAns can only gain
    assert summary["qa2/reader/has_f1_always"] >= summary["qa2/reader/has_f1"]
    assert 0 <= summary["qa2/reader/auc"] <= 1 and 0 <= summary["qa2/reader/rule_threshold"] <= 1
    assert summary["qa2/reader/rule_has_f1"] >= summary["qa2/reader/has_f1_always"] - 5
    assert summary["qa2/reader/best_f1"] >= max(summary["qa2/reader/f1"], summary["qa2/reader/rule_f1"]) - 0.01
    assert "1 - p(null)" in (out / "report.md").read_text()
    write_tiny_gguf(tmp_path / "other.gguf", seed=1)  # a reader of another backbone is refused in one line
    other, _ = new_reader(gguf_reference(tmp_path / "other.gguf"), adapter_rank=4, lookahead=1)
    save_reader(other, tmp_path / "other-reader")
    refused = CliRunner().invoke(app, [*args, "--reader", str(tmp_path / "other-reader")])
    assert refused.exit_code != 0 and len(refused.output.strip().splitlines()) == 1


def test_eval_squad_held_out_keeps_to_the_articles_training_held_out(tmp_path, checkpoint):
    import shutil

    data = tiny_squad(tmp_path / "tiny.json", missing_answer=False)
    runner = CliRunner()
    args = ["eval", "squad", str(data), "--oracle", "--held-out", "--modes", "hidden", "--out", str(tmp_path / "out")]
    untrained = runner.invoke(app, [*args, "--checkpoint", str(checkpoint)])
    assert untrained.exit_code != 0 and "validation articles" in untrained.output
    trained = tmp_path / "trained"
    shutil.copytree(checkpoint, trained)
    (trained / "train_config.json").write_text(json.dumps({"validation_articles": ["Geese"]}))
    result = runner.invoke(app, [*args, "--checkpoint", str(trained), "--json"])
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert sorted(line["qid"] for line in lines) == ["Geese0", "Geese1"]  # of 8 questions in 4 articles
    assert json.loads(result.stdout)["eval/articles"] == "held-out"


def test_eval_squad_with_an_index_reports_recall(tmp_path, checkpoint):
    data = tiny_squad(tmp_path / "tiny.json", missing_answer=False)
    runner = CliRunner()
    built = runner.invoke(app, ["index", str(data), "--index", str(tmp_path / "idx"), "--max-passage-tokens", "120",
                                "--checkpoint", str(checkpoint)])
    assert built.exit_code == 0, built.output
    result = runner.invoke(app, ["eval", "squad", str(data), "--index", str(tmp_path / "idx"), "--modes", "hidden",
                                 "-k", "2", "--out", str(tmp_path / "out"), "--checkpoint", str(checkpoint),
                                 "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert 0.0 <= summary["retrieval/recall@1"] <= summary["retrieval/recall@2"] <= 1.0
    assert summary["retrieval/recall@2"] >= 0.5  # MiniLM finds these short passages
    assert "reuse/cold_load_ms" in summary
    assert summary["retrieval/faiss"] == "flat" and "retrieval/recall@5_vs_exact" not in summary
    # the same corpus under an IVF index: the manifest says so, and eval measures it against exact search
    built = runner.invoke(app, ["index", str(data), "--index", str(tmp_path / "ivf"), "--max-passage-tokens", "120",
                                "--checkpoint", str(checkpoint), "--approximate-above", "2"])
    assert built.exit_code == 0, built.output
    info = json.loads(runner.invoke(app, ["info", "--index", str(tmp_path / "ivf"), "--json"]).stdout)
    assert info["faiss_layout"]["kind"] == "ivf" and info["faiss_layout"]["nlist"] >= 1
    result = runner.invoke(app, ["eval", "squad", str(data), "--index", str(tmp_path / "ivf"), "--modes", "none",
                                 "-k", "2", "--out", str(tmp_path / "out-ivf"), "--checkpoint", str(checkpoint),
                                 "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["retrieval/faiss"] == "ivf" and 0.0 <= summary["retrieval/recall@5_vs_exact"] <= 1.0


def test_eval_verifies_answers_and_scores_both_ways(tmp_path, checkpoint):
    data = tiny_squad(tmp_path / "tiny2.json", missing_answer=False, unanswerable=True)
    copying = tiny_checkpoint(tmp_path / "copying", copy_everything=True, successor=(6.0, 0.0))  # copies spans
    doubting = verifier_beside(copying, tmp_path / "ckpt", 1.0)  # withholds every verified answer
    args = ["eval", "squad2", str(data), "--modes", "hidden", "--out", str(tmp_path / "out"), "--checkpoint",
            str(doubting), "--min-confidence", "0", "--json"]
    verified = json.loads(CliRunner().invoke(app, args).stdout)
    results = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    checked = [r for r in results if r["answerable"] is not None]
    assert checked and all(0 < r["answerable"] < 1 for r in checked)
    assert all(r["answerable"] is None for r in results if not r["prediction"])  # nothing to verify
    assert verified["qa2/hidden+verifier/noans_acc"] == 100.0 and verified["qa2/hidden+verifier/threshold"] == 1.0
    assert verified["qa2/hidden+verifier/has_f1_always"] == verified["qa2/hidden/has_f1"]  # unverified row unmoved
    assert "qa2/hidden+verifier/auc" in verified and "hidden+verifier" in (tmp_path / "out" / "report.md").read_text()
    plain = json.loads(CliRunner().invoke(app, [*args, "--no-verify"]).stdout)
    assert not any("verif" in key for key in plain)
    squad = json.loads(CliRunner().invoke(app, ["eval", "squad", str(tiny_squad(tmp_path / "tiny.json")), "--oracle",
                                                "--modes", "hidden", "--out", str(tmp_path / "v1"), "--checkpoint",
                                                str(doubting), "--json"]).stdout)
    assert squad["verify/hidden/withheld"] == pytest.approx(squad["verify/hidden/verified"] / squad["qa/hidden/n"])
    assert squad["qa/hidden+verifier/f1"] <= squad["qa/hidden/f1"] and squad["latency/verify_ms"] > 0
    report = (tmp_path / "v1" / "report.md").read_text()  # the verified figures are a row of eval squad's table
    assert f"| hidden+verifier | {squad['qa/hidden/n']} | {squad['qa/hidden+verifier/em']:.1f} |" in report
    refused = CliRunner().invoke(app, [*args[:-4], str(checkpoint), "--verify"])
    assert refused.exit_code != 0 and "ships no verifier" in refused.output


def test_eval_needle_and_bench_run_end_to_end(tmp_path, checkpoint):
    runner = CliRunner()
    needle = runner.invoke(app, ["eval", "needle", "--lengths", "200,600", "--depths", "0,1", "--trials", "1",
                                 "--out", str(tmp_path / "needle"), "--checkpoint", str(checkpoint), "--json"])
    assert needle.exit_code == 0, needle.output
    summary = json.loads(needle.stdout)
    assert "needle/hidden/acc_min" in summary and "needle/visible/acc@600/1.0" in summary
    assert (tmp_path / "needle" / "needle_heatmap.png").stat().st_size > 1000
    corpus = write_jsonl(tmp_path / "c.jsonl", DOCS)
    bench = runner.invoke(app, ["eval", "bench", "--corpus", str(corpus), "--documents", str(len(DOCS)),
                                "--questions", "2", "--out", str(tmp_path / "bench"), "--checkpoint", str(checkpoint),
                                "--batch-questions", "6", "--json"])
    assert bench.exit_code == 0, bench.output
    figures = json.loads(bench.stdout)
    assert json.loads((tmp_path / "bench" / "summary.json").read_text()) == figures
    assert (tmp_path / "bench" / "latency_by_k.png").stat().st_size > 1000
    assert "latency/hidden_over_visible@k5" in (tmp_path / "bench" / "report.md").read_text()
    for key in ("memory/keys_bytes_per_token", "memory/kv_bytes_per_token", "latency/hidden_over_visible@k5",
                "index/throughput_over_forward", "reuse/warm_over_cold_qps", "batch/qps@1", "batch/qps@64",
                "batch/qps@16_over_qps@1"):
        assert figures[key] > 0
    assert figures["batch/answers_identical"] == 1 and figures["batch/questions"] == 6
    assert figures["batch/answers_agreeing"] == 6
    assert figures["batch/answers_identical_float32"] == 1 and figures["batch/answers_agreeing_float32"] == 6
    assert figures["latency/beam4_answers_identical"] == 1  # a start beam as rows answers as one start at a time
    assert figures["latency/beam4_rows@k5_ms"] > 0 and figures["latency/beam4_rows_over_greedy"] > 0
    assert figures["bench/dtype"] == "float32" and figures["bench/device"] == "cpu"
    assert figures["bench/processor"] == cpu_name()  # the CPU named beside its figures
    assert figures["memory/keys_bytes_per_token"] < figures["memory/kv_bytes_per_token"]
    assert 5 < figures["latency/passage_tokens_mean@k5"] < figures["latency/visible_prompt_tokens@k5"]


def test_eval_bench_in_bf16_checks_batching_in_fp32_too(tmp_path, checkpoint):
    """bf16's rounding depends on the batch's shape; the bench repeats the batch check on an fp32 copy."""
    corpus = write_jsonl(tmp_path / "c.jsonl", DOCS)
    bench = CliRunner().invoke(app, ["eval", "bench", "--corpus", str(corpus), "--questions", "1", "--dtype",
                                     "bfloat16", "--checkpoint", str(checkpoint), "--batch-questions", "6", "--json"])
    assert bench.exit_code == 0, bench.output
    figures = json.loads(bench.stdout)
    assert figures["bench/dtype"] == "bfloat16"
    assert figures["batch/answers_identical_float32"] == 1 and figures["batch/answers_agreeing_float32"] == 6
    assert 0 <= figures["batch/answers_agreeing"] <= 6


def test_eval_rejects_bad_flags_with_one_line(tmp_path, checkpoint):
    runner = CliRunner()
    both = runner.invoke(app, ["eval", "squad", "x.json", "--out", str(tmp_path), "--index", "i", "--oracle"])
    assert both.exit_code != 0 and "exactly one" in both.output
    dtype = runner.invoke(app, ["eval", "squad", "x.json", "--out", str(tmp_path), "--oracle", "--dtype", "fp8"])
    assert dtype.exit_code != 0 and "--dtype" in dtype.output and "float32 or bfloat16" in dtype.output
    depths = runner.invoke(app, ["eval", "needle", "--depths", "2", "--out", str(tmp_path)])
    assert depths.exit_code != 0 and "depths" in depths.output


def test_eval_scale_writes_a_synthetic_index_and_times_it(tmp_path):
    runner = CliRunner()
    result = runner.invoke(app, ["eval", "scale", "--passages", "3000", "--tokens", "16", "--queries", "50",
                                 "--keys", "int8", "--index", str(tmp_path / "idx"), "--out", str(tmp_path / "out"),
                                 "--json"])
    assert result.exit_code == 0, result.output
    figures = json.loads(result.stdout)
    assert figures["scale/passages"] == 3000 and figures["scale/tokens"] == 3000 * 16
    assert figures["scale/faiss"] == "flat" and figures["scale/recall@5_vs_exact"] == 1.0
    assert 0 < figures["scale/search_p50_ms"] <= figures["scale/search_p99_ms"]
    assert 0 < figures["scale/fetch_p50_ms@k5"] <= figures["scale/fetch_p99_ms@k5"]
    assert figures["scale/bytes_per_token"] == 64 + 2 + 4 and figures["scale/disk_bytes_per_token"] > 70
    opened = open_snapshot(tmp_path / "idx")  # the real schema: the store reads the synthetic rows back
    assert len(opened.passage_index) == 3000 and opened.store.count() == 3000
    assert any(i.columns == ["passage_id"] for i in opened.store.table.list_indices())  # fetches are lookups
    fetched = opened.store.fetch(["s000000007"])["s000000007"]
    assert fetched.keys.keys.shape == (16, 64) and len(fetched.keys.ids) == 16
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["scale/extrapolated"]["10000000"]["disk_gb"] > 0
    again = runner.invoke(app, ["eval", "scale", "--passages", "200", "--index", str(tmp_path / "idx"),
                                "--out", str(tmp_path / "out")])
    assert again.exit_code == 2 and "--index" in again.output and opened.store.count() == 3000


def test_eval_scale_with_pq_keys_reads_codes_back_through_the_stored_codebook(tmp_path):
    result = CliRunner().invoke(app, ["eval", "scale", "--passages", "300", "--tokens", "8", "--queries", "20",
                                      "--keys", "pq", "--index", str(tmp_path / "idx"), "--out", str(tmp_path / "out"),
                                      "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["scale/bytes_per_token"] == 16 + 4
    opened = open_snapshot(tmp_path / "idx")  # the manifest names the codebook; the snapshot decodes with it
    assert opened.manifest["key_pq"]["subvectors"] == 16
    keys = opened.store.fetch(["s000000003"])["s000000003"].keys.keys
    assert keys.shape == (8, 64) and np.isfinite(keys).all() and np.abs(keys).sum() > 0


def test_the_needle_scores_each_passage_as_the_retriever_would_and_weighs_them_in(checkpoint):
    from cprag.evaluation.needle import HaystackKeys, run_needle
    from cprag.index.retrieve import MiniLMEmbedder

    model, tokenizer = load_model(checkpoint)
    haystack = build_haystack(tokenizer, 3000, 0.5, "4829173", block_tokens=256)
    keys = HaystackKeys(model, tokenizer, MiniLMEmbedder())
    scores = keys.scores(haystack)
    assert len(scores) == len(haystack.blocks) and int(np.argmax(scores)) == haystack.needle_block
    full = {round(s, 6) for b, s in zip(haystack.blocks, scores, strict=True) if len(b) == 256}
    assert len(full - {round(scores[haystack.needle_block], 6)}) == 1  # identical filler, identical score
    with pytest.raises(ValueError, match="embedder"):
        run_needle(model, tokenizer, [600], [0.0], 1, ["hidden"], passage_prior=15.0)
    summary, results = run_needle(model, tokenizer, [600], [0.0, 1.0], 1, ["hidden"], passage_prior=15.0,
                                  embedder=keys.embedder, start_beam=2)
    assert summary["needle/hidden/passage_prior"] == 15.0 and summary["needle/hidden/start_beam"] == 2
    assert [(r["passage_prior"], r["start_beam"]) for r in results] == [(15.0, 2)] * 2
