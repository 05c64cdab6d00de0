"""spectuner's controller side: config, store, controller, actuators, exporters, CLI, lab."""

__version__ = "0.1.0"
