"""Performance and memory figures, as ratios measured in one run (`python -m benchmarks.bench`),
a comparison against the official MAR code (`python -m benchmarks.official`), a Harmon-1.5B-sized
memory run (harmon_lora_step.py), the first GPU's checks (gpu_check.py), and the random stand-ins
of released files that they and the tests load (stand_ins.py)."""
