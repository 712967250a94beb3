import os
import sys

# Tests import their helpers (cluster.py, models.py) as top-level modules.
sys.path.insert(0, os.path.dirname(__file__))
