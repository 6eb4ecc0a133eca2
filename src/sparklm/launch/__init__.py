"""The stages' drivers: ``sparklm prepare`` (prepare.py: checks, the engine, the tokenizer, the manifest and the
atomic commit) and ``sparklm train`` (train.py: checks, the run plan, config.json, the sinks, the strategy, the
summary and report). They run on the driver and know nothing of the math: that is data/, train/ and strategies/."""
