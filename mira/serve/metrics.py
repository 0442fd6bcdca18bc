"""The server's counters, rendered in Prometheus' text format for `GET /metrics`."""

from __future__ import annotations

import math
import threading
from collections import Counter

from mira.runtime.generate import GenerationReport

TTFT_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    """Requests by endpoint and status, tokens, time to first token (queueing included), decode speed,
    and from the model's own statistics the routed tokens served by tier and the bytes sent over PCIe."""

    def __init__(self):
        self._lock = threading.Lock()
        self._requests: Counter[tuple[str, int]] = Counter()
        self._cancelled = 0
        self._prompt_tokens = 0
        self._completion_tokens = 0
        self._ttft_counts = [0] * len(TTFT_BUCKETS_S)
        self._ttft_sum = 0.0
        self._ttft_count = 0
        self._decode_tokens = 0
        self._decode_seconds = 0.0
        self._last_decode_rate = math.nan
        self._tiers: dict[str, int] = {}
        self._pcie: dict[str, int] = {}

    def request(self, endpoint: str, status: int) -> None:
        with self._lock:
            self._requests[endpoint, status] += 1

    def cancelled(self) -> None:
        with self._lock:
            self._cancelled += 1

    def generated(self, report: GenerationReport, waited_s: float, stats: dict) -> None:
        """One generation's figures; `stats` is the model's `stats()` after it (cumulative)."""
        with self._lock:
            self._cancelled += report.finish_reason == "cancelled"
            self._prompt_tokens += report.prompt_tokens
            self._completion_tokens += report.new_tokens
            if not math.isnan(report.ttft_s):
                ttft = waited_s + report.ttft_s
                self._ttft_sum += ttft
                self._ttft_count += 1
                for i, bound in enumerate(TTFT_BUCKETS_S):
                    self._ttft_counts[i] += ttft <= bound
            if report.new_tokens > 1 and report.decode_tokens_per_s > 0:
                self._decode_tokens += report.new_tokens - 1
                self._decode_seconds += (report.new_tokens - 1) / report.decode_tokens_per_s
                self._last_decode_rate = report.decode_tokens_per_s
            cache = stats["cache"]
            self._tiers = dict(cache["tokens_served"])
            self._pcie = {"demand": cache["bytes_to_device"], "prefetch": cache["prefetch_bytes"]}

    def render(self, waiting: int, running: int) -> str:
        """The metrics in Prometheus' text exposition format."""
        with self._lock:
            lines: list[str] = []

            def metric(name: str, kind: str, text: str, samples: list[tuple[str, float]]) -> None:
                lines.extend([f"# HELP {name} {text}", f"# TYPE {name} {kind}"])
                lines.extend(f"{name}{labels} {_number(value)}" for labels, value in samples)

            metric("mira_requests_total", "counter", "HTTP requests answered, by endpoint and status code",
                   [(f'{{endpoint="{endpoint}",status="{status}"}}', n)
                    for (endpoint, status), n in sorted(self._requests.items())])
            metric("mira_requests_cancelled_total", "counter", "generations cancelled because their client left",
                   [("", self._cancelled)])
            metric("mira_prompt_tokens_total", "counter", "prompt tokens processed", [("", self._prompt_tokens)])
            metric("mira_completion_tokens_total", "counter", "tokens generated", [("", self._completion_tokens)])
            buckets = [(f'_bucket{{le="{bound}"}}', n) for bound, n in zip(TTFT_BUCKETS_S, self._ttft_counts)]
            lines.extend(["# HELP mira_time_to_first_token_seconds request arrival to first token, queueing included",
                          "# TYPE mira_time_to_first_token_seconds histogram"])
            lines.extend(f"mira_time_to_first_token_seconds{suffix} {n}" for suffix, n in
                         [*buckets, ('_bucket{le="+Inf"}', self._ttft_count), ("_sum", self._ttft_sum),
                          ("_count", self._ttft_count)])
            metric("mira_decode_tokens_total", "counter", "tokens generated after each generation's first",
                   [("", self._decode_tokens)])
            metric("mira_decode_seconds_total", "counter", "time spent generating them", [("", self._decode_seconds)])
            metric("mira_decode_tokens_per_second", "gauge", "decode speed of the last generation",
                   [("", self._last_decode_rate)])
            metric("mira_expert_tokens_total", "counter", "routed tokens by where their expert was served from",
                   [(f'{{tier="{tier}"}}', n) for tier, n in sorted(self._tiers.items())])
            metric("mira_pcie_bytes_total", "counter", "expert bytes copied host to device, on demand and prefetched",
                   [(f'{{kind="{kind}"}}', n) for kind, n in sorted(self._pcie.items())])
            metric("mira_queue_waiting", "gauge", "requests waiting for the device", [("", waiting)])
            metric("mira_generation_running", "gauge", "generations running on the device", [("", running)])
        return "\n".join(lines) + "\n"


def _number(value: float) -> str:
    if isinstance(value, float) and math.isnan(value):
        return "NaN"
    return repr(value) if isinstance(value, float) else str(value)
