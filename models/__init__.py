"""The model adapters behind the policy interface of mar.py: Harmon (Qwen2 + MAR), NOVA and its
heads, the image codecs (raw pixels, the KL-16 VAE, NOVA's VAE), and `loading`, the one place that
builds a policy, its codec and its prompts from a run's flags."""
