"""Exporters: spectuner's own metrics over Prometheus and OTLP, and decision/apply spans.

One concept per module: ``values`` (pure snapshot → samples), ``source`` (store → snapshots),
``prometheus``, ``otel``, ``tracing``, ``service`` (what the daemon starts), ``settings`` (config).
Nothing is imported here, so ``tuner.config`` can import the settings without the OTel SDK.
See docs/exporters.md.
"""
