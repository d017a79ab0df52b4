"""Answers from a CPLM: prompts, one decoding step, the decoding rules, and the decoders built on them."""
