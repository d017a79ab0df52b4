"""The options several commands share, declared once so their flags, defaults and help read the same everywhere."""

from __future__ import annotations

from pathlib import Path

import typer

CHECKPOINT_OPTION = typer.Option(None, "--checkpoint", help="CPLM checkpoint directory (default: the shipped one).")
JSON_OPTION = typer.Option(False, "--json", help="Write one JSON object to stdout instead of tables.")
INDEX_OPTION = typer.Option(Path("indexes/default"), "--index", "-i", help="Index directory.")
DEVICE_OPTION = typer.Option(None, "--device", help="cpu or cuda (default: cuda when present).")
DTYPE_OPTION = typer.Option(None, "--dtype", help="float32 or bfloat16 (default: CPRAG_DTYPE, else bfloat16 on "
                            "CUDA and on CPUs with bf16 units, float32 on others; see cprag.model.runtime).")

# decoding policy: the checkpoint's own settings unless a flag overrides them
START_BEAM_OPTION = typer.Option(None, "--start-beam", help="Decode from this many most probable first tokens and "
                                 "answer with the one the checkpoint's start reranker picks (the likeliest without "
                                 "one). Default: the beam the reranker was fitted for (4 for the shipped checkpoint: "
                                 "+4.5 F1 on SQuAD dev over greedy); 1 is greedy, the fastest.")
PASSAGE_PRIOR_OPTION = typer.Option(None, "--passage-prior", help="Weight of each passage's retrieval score in the "
                                    "copy scores (hidden mode): passages less similar to the question are pushed "
                                    "down by this many nats per unit of cosine (default: the checkpoint's; 0: off).")
END_BIAS_OPTION = typer.Option(None, "--end-bias", help="Nats added to the log-probability of ending an answer at "
                               "every choice after the first; below 0 answers run on where the model is unsure they "
                               "are over (default: the checkpoint's end_bias; 0: off).")
VERIFY_OPTION = typer.Option(None, "--verify/--no-verify", help="Read the question beside the sentence the answer "
                             "was copied from and withhold answers the checkpoint's verifier doubts (default: on "
                             "when the checkpoint ships a verifier; the confidence threshold then defaults to 0).")
