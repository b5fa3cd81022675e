"""A run's plumbing: flags and presets, processes (ranks, devices, seeds, one-line failures),
checkpoint files, LoRA and FSDP for models that do not fit, prompt files and the released prompt
records."""
