"""Where the tests find the repository and their data, wherever their folder lies."""
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
"""The repository's root."""
DATA = os.path.join(ROOT, "tests", "data")
"""The tests' data files (str)."""
