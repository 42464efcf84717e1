"""Research questions the code answers, on synthetic data: python -m experiments.NAME; their dated log is LOG.md."""
