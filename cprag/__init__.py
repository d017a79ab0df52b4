"""cprag: answer questions from documents the language model never reads, through Copy-Paste LM keys.

Importing cprag loads no model: everything heavy happens inside the functions that need it.
"""

__version__ = "0.1.0"
