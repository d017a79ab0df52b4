"""What the training recipe costs on this CPU for backbones of other sizes: seconds per step, measured on 20
steps, and the activation cache's tokens per second.

    python eval/scripts/backbone_cost.py --out eval/backbones/cost.json

Each backbone is trained with the default recipe (`cprag train`'s settings: 32 questions a step, gold + 4
distractors, adapters on the top 40% of blocks) on `examples/squad-train-sample.json`. The default backbone is the
shipped GGUF; the others are random weights in the shapes of public checkpoints (SmolLM2-360M, Qwen2.5-0.5B),
written as model folders with the default backbone's tokenizer: step time does not depend on the weights' values,
and nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

# public configs' sizes (config.json of each model on the Hugging Face Hub), vocabulary set to the tokenizer's
SHAPES = {
    "SmolLM2-360M": dict(model_type="llama", hidden_size=960, intermediate_size=2560, num_hidden_layers=32,
                         num_attention_heads=15, num_key_value_heads=5, tie_word_embeddings=True,
                         rope_theta=100000.0),
    "Qwen2.5-0.5B": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
                         rope_theta=1000000.0),
}


def shaped_folder(name: str, directory: Path, tokenizer) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = dict(SHAPES[name])
    config = AutoConfig.for_model(shape.pop("model_type"), vocab_size=len(tokenizer), max_position_embeddings=8192,
                                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                  pad_token_id=tokenizer.eos_token_id, **shape)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def measure(base, data: Path, steps: int) -> dict:
    from cprag.training.config import TrainConfig
    from cprag.training.recipe import prepare
    from cprag.training.train import train_model

    config = replace(TrainConfig(), epochs=10.0, max_steps=steps, visible_every=0)
    started = time.perf_counter()
    ready = prepare(data, config, base=base)
    prepared_s = time.perf_counter() - started
    report = train_model(ready.model, ready.tokenizer, ready.train, ready.config)
    backbone = ready.model.backbone.config
    adapted = ready.config.head["adapter_layers"]
    return {
        "layers": backbone.num_hidden_layers, "hidden": backbone.hidden_size,
        "backbone_parameters": sum(p.numel() for p in ready.model.backbone.parameters()),
        "adapter_layers": f"{min(adapted)}-{max(adapted)}", "cp_layers": ready.config.head["cp_layers"],
        "dtype": ready.config.dtype, "steps": report.steps, "seconds_per_step": round(report.seconds / report.steps, 2),
        "hours_per_1000_steps": round(report.seconds / report.steps * 1000 / 3600, 2),
        "cache_tokens": ready.figures.get("cache/tokens_built"), "prepare_seconds": round(prepared_s, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="examples/squad-train-sample.json")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--shapes", default="default," + ",".join(SHAPES))
    parser.add_argument("--out")
    args = parser.parse_args(argv)

    from cprag.model.backbone import default_reference, folder_reference, load_backbone
    from cprag.model.cpu_features import cpu_name

    figures = {"cpu": cpu_name(), "questions_per_step": 32, "data": Path(args.data).name, "backbones": {}}
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.shapes.split(","):
            if name == "default":
                base = default_reference()
            else:
                _, tokenizer = load_backbone(default_reference())
                base = folder_reference(shaped_folder(name, Path(scratch) / name, tokenizer))
            figures["backbones"][name if name != "default" else "SmolLM2-135M (default)"] = measure(
                base, Path(args.data), args.steps)
            print(json.dumps(figures["backbones"]), file=sys.stderr, flush=True)
    text = json.dumps(figures, indent=2)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
