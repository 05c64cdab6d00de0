"""The vLLM server as a supervised process: start, health, graceful stop. Used by the lab and the
restart actuator alike, so one code path starts every engine spectuner manages."""
