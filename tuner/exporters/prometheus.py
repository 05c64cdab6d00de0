"""The Prometheus endpoint: a custom collector over the last computed samples, on its own registry.

The collector yields fresh metric families on every scrape from the samples the refresh job computed
last (a scrape never touches the database), and every metric family of ``METRICS`` is always
described, even with no samples, so ``# HELP``/``# TYPE`` lines are stable.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from tuner.exporters.values import METRICS, Sample, by_name

log = logging.getLogger(__name__)


class SamplesCollector:
    """prometheus-client collector protocol: ``collect() -> Iterable[Metric]``."""

    def __init__(self, samples: Callable[[], Sequence[Sample]]) -> None:
        self._samples = samples

    def collect(self) -> Iterator[Metric]:
        grouped = by_name(self._samples())
        for name, spec in METRICS.items():
            family: GaugeMetricFamily | CounterMetricFamily
            if spec.kind == "counter":
                family = CounterMetricFamily(name, spec.help, labels=list(spec.labels))
            else:
                family = GaugeMetricFamily(name, spec.help, labels=list(spec.labels))
            for s in grouped.get(name, []):
                family.add_metric([v for _, v in s.labels], s.value)
            yield family

    def describe(self) -> Iterator[Metric]:
        return iter(())  # registration must not compute values


class PrometheusExporter:
    """Serves ``/metrics`` on ``host:port`` (``port=0``: a free port, see :attr:`port`)."""

    def __init__(self, samples: Callable[[], Sequence[Sample]], host: str = "127.0.0.1", port: int = 9464) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(SamplesCollector(samples))
        self.host = host
        self.port = port
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        server, thread = start_http_server(self.port, addr=self.host, registry=self.registry)
        self._server, self._thread = server, thread
        self.port = int(server.server_address[1])
        log.info("prometheus exporter: serving http://%s:%d/metrics", self.host, self.port)

    def stop(self) -> None:
        server = self._server
        if server is not None:
            server.shutdown()
            server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
