"""The reward models behind rewards.py's one interface: the CLIP family (CLIP score, HPS v2,
PickScore, aesthetic), ImageReward, GroundingDINO and GIT-VQA for the compositional rewards, and
T2I-CompBench's evaluators. registry.py builds them by name; weights are always local files."""
