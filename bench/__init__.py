"""Measurements: python -m bench SUBCOMMAND (bench/__main__.py lists them)."""
