"""A deterministic, seeded simulator of a speculative-decoding engine that drives the real controller.

``scenario`` (the TOML format), ``engine`` (the engine model), ``actuator`` (the simulated restart
actuator and clock), ``baselines`` (the comparison policies), ``run`` (the loop and the comparison).
See docs/simulator.md.
"""
