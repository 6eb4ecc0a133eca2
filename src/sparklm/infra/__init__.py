"""Infrastructure every layer uses: the one user-facing error type (errors.py), storage on local paths and object
stores (fs.py), per-host and per-process caches (cache.py), the run directory's lock (runlock.py), masking of
secrets (redact.py) and progress on the console (progress.py). Nothing here knows Spark, torch or training."""
