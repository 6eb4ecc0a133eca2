"""Tokens → gradients: the training loop, its distribution on Spark, checkpoints and metrics."""
