"""tools/ on the import path: the suite's CI test reads the fault kinds from tools/chaos.py itself."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
