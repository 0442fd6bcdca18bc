"""The KV cache one token costs at the bench's model shapes: the config rule against the measurement.

For each preset shape of mira.bench.synthetic, the values per token that the budget's reserve holds,
as mira.models.base works them out from the config and as mira.models.kvcache measures them (the
growth of transformers' own cache in a forward on the meta device). Counts, not timings: one run.

    python benchmarks/kv_reserve.py [--out benchmarks/results/kv-reserve.json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import transformers

from mira.bench.provenance import result_header
from mira.bench.synthetic import PRESETS, preset_config
from mira.models.base import kv_values_per_token as config_rule
from mira.models.kvcache import kv_values_per_token as measured
from mira.store.files import write_json_atomic

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "kv-reserve.json",
                        help="the JSON result to write (default: %(default)s)")
    args = parser.parse_args()
    shapes = {}
    print(f"{'shape':18} {'config rule':>12} {'measured':>10} {'rule / measured':>16}")
    for name in PRESETS:
        config = preset_config(name)
        rule, cached = config_rule(config), measured(config)
        shapes[name] = {"config_rule_values_per_token": rule, "measured_values_per_token": cached,
                        "rule_over_measured": rule / cached}
        print(f"{name:18} {rule:12,} {cached:10,} {rule / cached:16.2f}")
    command = " ".join(["python benchmarks/kv_reserve.py", *sys.argv[1:]])
    write_json_atomic(args.out, {**result_header(command), "transformers": transformers.__version__,
                                 "unit": "K and V values one token adds to the cache, all layers", "shapes": shapes})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
