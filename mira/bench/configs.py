"""The configurations `mira bench` compares, by name: data only, so that `mira bench --help` names
them without loading the machinery that runs them (mira.bench.run)."""

MIRA_CONFIGS = {  # name -> its settings (mira.runtime.config.RuntimeConfig.with_overrides)
    "mira+p": dict(policy="mira", prefetch="auto", residency="inline"),  # staging through STAGE slots
    "mira+p-lagged": dict(policy="mira", prefetch="auto", residency="lagged"),  # staging on the device
    "mira+gate": dict(policy="mira", prefetch="gate", residency="inline"),
    "mira": dict(policy="mira", prefetch="off", residency="auto"),  # what `mira generate` does
    "mira-gpu": dict(policy="mira", prefetch="off", residency="auto", cpu_experts="off"),  # no CPU share
    "mira-device-calibrated": dict(policy="mira", prefetch="off", residency="auto", device_pace=False),  # an A/B
    "mira-cpu-all": dict(policy="mira", prefetch="off", residency="auto", cpu_experts="all"),  # every miss on the CPU
    "mira-cpu-split": dict(policy="mira", prefetch="off", residency="auto", cpu_experts="split"),  # auto's rule ignored
    "mira-cpu-graph": dict(policy="mira", prefetch="off", residency="auto", cpu_experts="graph"),  # lanes, replayed
    "mira-cpu-graph-1": dict(policy="mira", prefetch="off", residency="auto", cpu_experts="graph", cpu_lanes=1),
    "mira-inline": dict(policy="mira", prefetch="off", residency="inline"),
    "mira-lagged": dict(policy="mira", prefetch="off", residency="lagged"),
    "mira-eager": dict(policy="mira", prefetch="off", residency="inline", cuda_graphs=False),  # every step eager
    "lru": dict(policy="lru", prefetch="off", residency="inline"),  # mixtral-offloading's way
    "lru-lagged": dict(policy="lru", prefetch="off", residency="lagged"),
    "lfu": dict(policy="lfu", prefetch="off", residency="inline"),
    "static": dict(policy="static", prefetch="off", residency="auto"),  # lagged: it never admits a miss
    "mira-settle-now": dict(policy="mira", prefetch="off", residency="auto", deferred_settle=False),  # an A/B
    "static-settle-now": dict(policy="static", prefetch="off", residency="auto", deferred_settle=False),  # an A/B
    "mira-token-first": dict(policy="mira", prefetch="off", residency="auto", decode_ahead=False),  # an A/B
    "static-token-first": dict(policy="static", prefetch="off", residency="auto", decode_ahead=False),  # an A/B
}
BASELINES = ("hf-gpu", "hf-offload")  # transformers' own runs (mira.bench.hf)
DEFAULT_CONFIGS = "mira,lru,lru-lagged,lfu,static,hf-gpu,hf-offload"  # what `mira generate` does, and the baselines
