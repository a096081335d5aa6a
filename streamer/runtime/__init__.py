"""Executing the step on a device: the executor, the store <-> device transport, unit residency, the AdamW
chunk update, data parallel, and what this machine is (compute dtype)."""
