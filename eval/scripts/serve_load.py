"""Load test of `cprag serve`: 16 concurrent clients against one client, on 127.0.0.1, in one run.

    python eval/scripts/serve_load.py [--index indexes/demo] [--clients 16] [--questions 320] [--single 64]
        [--out eval/serve]

Starts `cprag serve` on a free loopback port (the shipped checkpoint, the demo index that `make demo` builds),
then: `--questions` questions about the demo corpus's documents from `--clients` concurrent clients (each
request's latency, errors, dropped requests); the first `--single` of them from one client; and `--streamed`
streamed requests one at a time for the time to the first token against the whole answer. Writes summary.json,
report.md, latency.png and the page's screenshot (page.png, when Chromium is installed) to OUT.

Report: `eval/serve/` (summary.json, report.md, latency.png, page.png).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np

from cprag.evaluation.bench import bench_questions
from cprag.index.corpus import read_corpus

ROOT = Path(__file__).resolve().parents[2]  # the repository root: eval/scripts/x.py


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(index: Path, port: int, extra: list[str]) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-m", "cprag.cli", "serve", "--index", str(index), "--port",
                                str(port), *extra], env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                # the model loads before uvicorn starts: the first /v1/info answers once it is ready
                httpx.get(f"http://127.0.0.1:{port}/v1/info", timeout=300)
                return process
        except httpx.HTTPError:
            time.sleep(0.5)
        if process.poll() is not None:
            raise SystemExit("cprag serve exited before it answered")
    raise SystemExit("cprag serve did not answer within 300 s")


def run_clients(url: str, questions: list[str], clients: int) -> dict:
    """Every question once, from `clients` threads each taking the next question; latency per request."""
    latencies, errors, answered = [], [], [0]
    position, lock = [0], threading.Lock()

    def client():
        with httpx.Client(timeout=300) as session:
            while True:
                with lock:
                    if position[0] >= len(questions):
                        return
                    question, position[0] = questions[position[0]], position[0] + 1
                tick = time.perf_counter()
                try:
                    response = session.post(url + "/v1/ask", json={"question": question, "k": 5})
                    if response.status_code != 200:
                        errors.append(f"{response.status_code}: {response.text[:200]}")
                        continue
                    response.json()["answer"]
                except httpx.HTTPError as error:
                    errors.append(repr(error))
                    continue
                with lock:
                    latencies.append(time.perf_counter() - tick)
                    answered[0] += 1

    started = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - started
    return {"requests": len(questions), "answered": answered[0], "errors": len(errors),
            "dropped": len(questions) - answered[0] - len(errors), "seconds": round(seconds, 1),
            "qps": round(answered[0] / seconds, 3),
            "p50_ms": round(float(np.percentile(latencies, 50)) * 1000, 1) if latencies else None,
            "p99_ms": round(float(np.percentile(latencies, 99)) * 1000, 1) if latencies else None,
            "first_errors": errors[:3], "latencies": latencies}


def time_to_first_token(url: str, questions: list[str]) -> dict:
    first, total = [], []
    with httpx.Client(timeout=300) as session:
        for question in questions:
            tick, seen = time.perf_counter(), None
            with session.stream("POST", url + "/v1/ask?stream=true", json={"question": question, "k": 5}) as stream:
                for line in stream.iter_lines():
                    if line.startswith("event: token") and seen is None:
                        seen = time.perf_counter() - tick
            if seen is not None:
                first.append(seen)
                total.append(time.perf_counter() - tick)
    return {"streamed": len(first), "ttft_p50_ms": round(float(np.median(first)) * 1000, 1) if first else None,
            "total_p50_ms": round(float(np.median(total)) * 1000, 1) if total else None}


def screenshot(url: str, question: str, path: Path) -> bool:
    browser_path = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser_path is None:
        return False
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=browser_path, headless=True,
                                             args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 900, "height": 700})
        page.goto(url + "/")
        page.fill("#question", question)
        page.fill("#k", "3")
        page.click("#go")
        page.wait_for_selector(".passage", timeout=120_000)
        page.screenshot(path=str(path), full_page=True)
        browser.close()
    return True


def plot(path: Path, many: list[float], one: list[float], clients: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    bins = np.linspace(0, max(many + one) * 1000, 40)
    ax.hist(np.array(one) * 1000, bins=bins, alpha=0.6, label="1 client")
    ax.hist(np.array(many) * 1000, bins=bins, alpha=0.6, label=f"{clients} clients")
    ax.set_xlabel("request latency (ms)")
    ax.set_ylabel("requests")
    ax.set_title("cprag serve on 127.0.0.1 (one run)", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--index", type=Path, default=Path("indexes/demo"))
    parser.add_argument("--corpus", type=Path, default=Path("examples/corpus.jsonl"))
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--questions", type=int, default=320)
    parser.add_argument("--single", type=int, default=64, help="questions the one-client run asks")
    parser.add_argument("--streamed", type=int, default=16)
    parser.add_argument("--out", type=Path, default=ROOT / "eval" / "serve")
    parser.add_argument("--serve-args", default="", help="extra `cprag serve` flags, space separated")
    parser.add_argument("--page-question", default="When was the lighthouse at Varna Point built?",
                        help="the question in the page's screenshot")
    args = parser.parse_args(argv)
    titles = [d.title or d.id for d in read_corpus(args.corpus).documents]
    questions = bench_questions(titles, args.questions)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_server(args.index, port, args.serve_args.split())
    try:
        run_clients(url, questions[: args.clients], args.clients)  # warm-up: every op traced, shards cached
        many = run_clients(url, questions, args.clients)
        one = run_clients(url, questions[: args.single], 1)
        streamed = time_to_first_token(url, questions[: args.streamed])
        info = httpx.get(url + "/v1/info", timeout=60).json()
        args.out.mkdir(parents=True, exist_ok=True)
        shot = screenshot(url, args.page_question, args.out / "page.png")
    finally:
        server.terminate()
        server.wait(timeout=60)
    summary = {f"serve/{args.clients}/{k}": v for k, v in many.items() if k != "latencies"}
    summary.update({f"serve/1/{k}": v for k, v in one.items() if k != "latencies"})
    summary.update({f"serve/stream/{k}": v for k, v in streamed.items()})
    summary[f"serve/qps@{args.clients}_over_qps@1"] = round(many["qps"] / one["qps"], 2) if one["qps"] else None
    summary["serve/batches"] = info["batches"]
    summary["serve/device"] = info["model"]["device"]
    summary["serve/dtype"] = info["model"]["dtype"]
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    plot(args.out / "latency.png", many["latencies"], one["latencies"], args.clients)
    rows = "\n".join(f"| `{k}` | {v} |" for k, v in summary.items())
    (args.out / "report.md").write_text(
        f"# cprag serve load test (one run)\n\n`python eval/scripts/serve_load.py --clients {args.clients} --questions "
        f"{args.questions} --single {args.single}`: `cprag serve --index {args.index}` on 127.0.0.1, "
        f"{len(set(questions))} distinct questions about `{args.corpus}` cycled to {args.questions}, k = 5.\n\n"
        f"| figure | value |\n|---|---|\n{rows}\n\n![latency](latency.png)\n"
        + ("\n![the page](page.png)\n" if shot else ""))
    print(json.dumps(summary, indent=2))
    return 0 if many["errors"] == 0 and many["dropped"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
