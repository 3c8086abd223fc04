"""The server's Prometheus metrics (`GET /metrics`), in a registry of their own so several servers can live in one
process (the tests). Latencies are seconds, measured at the server with vLLM's definitions: TTFT from the request's
arrival at the server (queueing included) to its first token leaving the engine loop, ITL the gaps between
tokens, E2E arrival to the last token."""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# Bucket edges in seconds: a CPU toy model's ITL is a few ms, a loaded server's TTFT seconds.
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ServerMetrics:
    CONTENT_TYPE = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str):
        r = self.registry = CollectorRegistry()
        ProcessCollector(registry=r)  # process_resident_memory_bytes and friends: memory over a long run
        labels = ["model_name"]
        self._labels = {"model_name": model_name}

        def gauge(name, doc):
            return Gauge(name, doc, labels, registry=r).labels(**self._labels)

        def hist(name, doc):
            return Histogram(name, doc, labels, buckets=_LATENCY_BUCKETS, registry=r).labels(**self._labels)

        self.running = gauge("cbjax_num_requests_running", "Requests in the engine's running batch.")
        self.waiting = gauge("cbjax_num_requests_waiting", "Requests accepted and not running (queued or preempted).")
        self.pages_used = gauge("cbjax_kv_pages_used", "KV cache pages in use (idle value: 0 without prefix caching).")
        self.pages_total = gauge("cbjax_kv_pages_total", "KV cache pages in the pool.")
        self.preemptions = gauge("cbjax_num_preemptions", "Preemptions since the engine started.")
        self.steps = gauge("cbjax_engine_steps", "Engine steps dispatched since start.")
        # Speculative decoding (0 while off): vLLM's acceptance rate is accepted / draft tokens.
        self.spec_draft_tokens = gauge("cbjax_spec_draft_tokens", "Draft tokens verified since start.")
        self.spec_accepted_tokens = gauge("cbjax_spec_accepted_tokens", "Draft tokens accepted since start.")
        self.ttft = hist("cbjax_time_to_first_token_seconds", "Arrival at the server to first token.")
        self.itl = hist("cbjax_inter_token_latency_seconds", "Gap between consecutive tokens of a request.")
        self.e2e = hist("cbjax_e2e_request_latency_seconds", "Arrival at the server to the last token.")
        self._finished = Counter(
            "cbjax_requests_finished", "Requests finished, by reason.", [*labels, "finish_reason"], registry=r
        )
        self._rejected = Counter(
            "cbjax_requests_rejected", "Requests refused, by reason.", [*labels, "reason"], registry=r
        )
        self.prompt_tokens = Counter("cbjax_prompt_tokens", "Prompt tokens of accepted requests.", labels, registry=r)
        self.prompt_tokens = self.prompt_tokens.labels(**self._labels)
        self.generation_tokens = Counter("cbjax_generation_tokens", "Tokens generated.", labels, registry=r)
        self.generation_tokens = self.generation_tokens.labels(**self._labels)

    def finished(self, reason: str) -> None:
        self._finished.labels(finish_reason=reason, **self._labels).inc()

    def rejected(self, reason: str) -> None:
        self._rejected.labels(reason=reason, **self._labels).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
