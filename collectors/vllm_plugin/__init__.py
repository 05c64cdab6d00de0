"""spectuner's vLLM plugin: it runs INSIDE vLLM's processes, so it imports only the stdlib and vLLM.

Two entry points, both inert unless their environment variables are set (see ``docs/plugin.md``):

- ``vllm.stat_logger_plugins`` → :class:`collectors.vllm_plugin.stat_logger.SpectunerStatLogger`
  (API-server process): ships every engine step's ``SpecDecodingStats`` with batch size and step
  time to the sidecar's ingest endpoint (``SPECTUNER_INGEST_URL``) — batched, non-blocking, bounded
  queue, drops counted.
- ``vllm.general_plugins`` → :func:`collectors.vllm_plugin.control.register` (every vLLM process;
  acts only where a scheduler is built, i.e. the engine core): a token-authenticated control channel
  on loopback or a Unix socket (``SPECTUNER_CONTROL_ADDR``) that replaces the per-batch-size K table
  of the running scheduler ("live K"), gated by feature detection (``features``), answering
  "unsupported" with the reason otherwise.

This ``__init__`` imports nothing from vLLM: the sidecar imports the protocol and client modules.
"""
