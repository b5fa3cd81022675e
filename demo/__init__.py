"""The demo's world: shapes images with prompts and an exact verifier (shapes.py, verifier.py), the
shipped base models and the script that pretrains them (pretrain.py, whose docstring has the
commands that made each file)."""

import os

HERE = os.path.dirname(os.path.abspath(__file__))
BASE = os.path.join(HERE, "base.pt")  # `python train.py` starts from it
BASE_SHA256 = "3e0bf98753f1390403dd5216ec6c6267ab074af9138f8c7a5b2b18aef4b4f472"
SMOKE_BASE = os.path.join(HERE, "smoke.pt")  # `python train.py --preset smoke` starts from it
SMOKE_BASE_SHA256 = "4bed76a9faf7cfd4133a854492d533af0f45e5cc4cf7ef1043e5399daf56b596"
