"""The machinery train.py calls: reading and the library, synthetic data, strategies, checkpoints and the stop
protocol, the planner and the dry run, the model file, evaluation and its figures, distributed setup, the CLI
wrapper, progress of long work. It may import model.py, data.py, ring_attention.py and configurator.py, never
train.py."""
