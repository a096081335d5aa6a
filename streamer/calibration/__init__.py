"""Measuring the runtime, above the trainer it measures: this machine's `local` device (calibrate.py), the costs
of the runtime itself (host_costs.py), a preset on its accelerator (calibrate_device.py), and the real step on
`meta` tensors (dryrun.py)."""
