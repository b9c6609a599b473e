"""dbsync's Prometheus series, on the registry vLLM's ``/metrics`` serves.

    dbsync_served_version              gauge    version served (0: the model's own checkpoint)
    dbsync_published_version           gauge    newest version seen in the store
    dbsync_version_lag                 gauge    published - served (versions behind)
    dbsync_swaps_total{outcome}        counter  applied | refused | failed | superseded |
                                                 rolled_back
    dbsync_pause_seconds               histogram generation paused per applied swap
    dbsync_read_verify_seconds         histogram fit check + checksum verification per swap
    dbsync_applied_bytes_total         counter  bytes of every version applied
    dbsync_source{source}              gauge    1 for where the last version came from
                                                (broadcast | filesystem | mixed | unknown)
    dbsync_store_ok                    gauge    0 while the store is missing or this server's
                                                lease cannot be written (read at scrape time)
    dbsync_healthy                     gauge    0 while the engine may hold a mix of versions
                                                (an apply failed midway; /health answers 503)
    dbsync_paused                      gauge    1 while generation is paused for an apply

Hazards: the series are process-wide (``default_metrics``): several controllers in one process
(several attached engines) add into the same counters and overwrite the same gauges. vLLM's
``/metrics`` serves ``prometheus_client``'s default registry unless ``PROMETHEUS_MULTIPROC_DIR``
is set (several API servers, which ``serve-vllm`` refuses); these series are in that default
registry.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

OUTCOMES = ("applied", "refused", "failed", "superseded", "rolled_back")
SOURCES = ("broadcast", "filesystem", "mixed", "unknown")
_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0, 30.0, 60.0, 120.0, 300.0)


class SwapMetrics:
    """The dbsync series on ``registry`` (None: ``prometheus_client``'s default registry).
    Register each name once per registry: use ``default_metrics()`` for the default one."""

    def __init__(self, registry: Any = None):
        from prometheus_client import REGISTRY, Counter, Gauge, Histogram

        reg = REGISTRY if registry is None else registry
        self.served = Gauge("dbsync_served_version",
                            "dbsync version served (0: the model's own checkpoint)",
                            registry=reg)
        self.published = Gauge("dbsync_published_version",
                               "Newest dbsync version seen in the store", registry=reg)
        self.lag = Gauge("dbsync_version_lag",
                         "Versions the served weights are behind the newest published one",
                         registry=reg)
        self.swaps = Counter("dbsync_swaps", "Swaps by outcome", ["outcome"], registry=reg)
        self.pause = Histogram("dbsync_pause_seconds",
                               "Seconds generation was paused for an applied swap",
                               buckets=_SECONDS_BUCKETS, registry=reg)
        self.read_verify = Histogram("dbsync_read_verify_seconds",
                                     "Seconds spent checking fit and checksums before a swap",
                                     buckets=_SECONDS_BUCKETS, registry=reg)
        self.applied_bytes = Counter("dbsync_applied_bytes", "Bytes of the versions applied",
                                     registry=reg)
        self.source = Gauge("dbsync_source", "1 for the source of the last applied version",
                            ["source"], registry=reg)
        self.store_ok = Gauge("dbsync_store_ok",
                              "0 while the store is missing or this server's lease cannot be "
                              "written", registry=reg)
        self.store_ok.set(1)
        self.healthy = Gauge("dbsync_healthy",
                             "0 while the engine may hold a mix of versions (an apply failed "
                             "midway; /health answers 503)", registry=reg)
        self.healthy.set(1)
        self.paused = Gauge("dbsync_paused", "1 while generation is paused for an apply",
                            registry=reg)
        self.paused.set(0)
        for outcome in OUTCOMES:
            self.swaps.labels(outcome=outcome)
        for source in SOURCES:
            self.source.labels(source=source).set(0)

    def watch_store(self, problem: Any) -> None:
        """``dbsync_store_ok`` from the bound method ``problem()`` (a description, or None),
        at each scrape; held weakly (the series outlive a stopped controller: 1 then)."""
        ref = weakref.WeakMethod(problem)

        def ok() -> float:
            method = ref()
            return 0.0 if method is not None and method() else 1.0

        self.store_ok.set_function(ok)

    def watch_engine(self, state: Any) -> None:
        """``dbsync_healthy`` and ``dbsync_paused`` from ``state`` (an object with ``healthy``
        and ``paused``), at each scrape; held weakly (1 and 0 once it is gone)."""
        ref = weakref.ref(state)

        def healthy() -> float:
            held = ref()
            return 1.0 if held is None or held.healthy else 0.0

        def paused() -> float:
            held = ref()
            return 1.0 if held is not None and held.paused else 0.0

        self.healthy.set_function(healthy)
        self.paused.set_function(paused)

    def versions(self, served: int | None, published: int | None,
                 other_run: bool = False) -> None:
        """Record the served and newest published version (None: none yet). ``other_run``:
        the published version belongs to another training run than the served one (a new run
        at the same path); every version of it is then unserved, so the lag is the published
        number. A published number below the served one can only be another run's."""
        self.served.set(served or 0)
        if published is not None:
            self.published.set(published)
            served_n = served or 0
            self.lag.set(published if other_run or published < served_n
                         else published - served_n)

    def outcome(self, outcome: str) -> None:
        self.swaps.labels(outcome=outcome).inc()

    def applied(self, *, pause_s: float, read_verify_s: float, nbytes: int,
                source: str | None) -> None:
        """Record one applied swap."""
        self.outcome("applied")
        self.pause.observe(pause_s)
        self.read_verify.observe(read_verify_s)
        self.applied_bytes.inc(nbytes)
        current = source if source in SOURCES else "unknown"
        for name in SOURCES:
            self.source.labels(source=name).set(1 if name == current else 0)


@functools.cache
def default_metrics() -> SwapMetrics:
    """The process's series on ``prometheus_client``'s default registry (created once)."""
    return SwapMetrics()
