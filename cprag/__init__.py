"""cprag: answer questions from documents the language model never reads, through Copy-Paste LM keys.

Importing cprag loads no model: everything heavy happens inside the functions that need it.

    import cprag
    index = cprag.Index("indexes/demo")
    print(index.ask("When was the lighthouse at Varna Point built?").answer)
"""

__version__ = "0.1.0"
__all__ = ["Index", "ask", "build_index", "index_info"]


def __getattr__(name):
    # lazy, so `import cprag` stays cheap (torch, transformers and lancedb load on first use)
    if name in {"Index", "ask", "index_info"}:
        from cprag import api

        return getattr(api, name)
    if name == "build_index":
        from cprag.index.build import build_index

        return build_index
    raise AttributeError(f"module 'cprag' has no attribute {name!r}")
