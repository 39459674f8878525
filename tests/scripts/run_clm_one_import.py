"""run_clm.py with the one import line that runs it on zeroio outside ``zeroio launch``."""

import runpy
from pathlib import Path

import zeroio.integrations.transformers  # noqa: F401  (the one line)

runpy.run_path(str(Path(__file__).with_name("run_clm.py")), run_name="__main__")
