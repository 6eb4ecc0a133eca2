"""How ranks run on Spark: one module per strategy."""
