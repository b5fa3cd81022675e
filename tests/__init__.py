"""The test suite (with test_margrpo.py at the root): `pytest -q` from the repository's root."""
