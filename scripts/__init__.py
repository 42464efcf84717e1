"""Commands a user runs with a trained model or a library: python -m scripts.NAME (README.md lists them)."""
