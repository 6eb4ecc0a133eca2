"""Tokens → gradients: the run loop (loop.py) and its two units' shared core (core.py: a worker's model, optimizer,
data and steps; the DDP rank's unit), collectives (collective.py), the schedule (schedule.py), checkpoints,
optimizers and the device seam; and the run plan made once on the driver (plan.py, from resolve.py's decisions,
budget.py's model size for a time budget and memory.py's micro-batch)."""
