import pathlib
import sys

# Let tests import helpers that live next to them (tests/ops/brute_force.py and friends).
sys.path.insert(0, str(pathlib.Path(__file__).parent / "ops"))
