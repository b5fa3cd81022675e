"""Performance and memory figures, as ratios measured in one run (`python -m benchmarks.bench`),
and a comparison against the official MAR code (`python -m benchmarks.official`)."""
