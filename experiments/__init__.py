"""The lab: the controlled study and the spatial study (study.py, spatial.py, their documents
study.md and research_log.md and figures/), probes of a base (probes.py), the comparison on spatial
relations (relation_study.py), what the lab adds to train.py (lab.py, raft.py), and bases/ of
earlier worlds. Run as modules from the repository's root: `python -m experiments.study ...`."""
