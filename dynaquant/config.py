"""Run configuration: the frozen dataclasses both the CLI and the Python API build (filled in by the pipeline work)."""
