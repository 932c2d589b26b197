"""Where the repository and its test fixtures are, for tests in any layer folder of ``tests/``."""

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository
REPO = str(ROOT)
FIXTURES = os.path.join(REPO, "tests", "fixtures")
