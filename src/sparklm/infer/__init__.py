"""Inference: sampling, generation (one process or over a Spark DataFrame), evaluation, export."""
