"""Text → tokens: reading, cleaning, tokenizing and packing, as Spark jobs over pure functions."""
