"""Alert hooks: stored events → webhook (HMAC-signed), Slack, Alertmanager, a command.

``events`` (categories, dedup key, payloads; pure), ``sinks`` (one attempt), ``dispatcher`` (cursor,
retries, dedup, rate limit, delivery log), ``settings`` (config). Nothing is imported here, so
``tuner.config`` can import the settings cheaply. See docs/alerts.md.
"""
