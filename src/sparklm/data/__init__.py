"""Text → tokens: reading, cleaning, tokenizing and packing, as Spark jobs (or an Apache Beam pipeline) over pure
functions."""
