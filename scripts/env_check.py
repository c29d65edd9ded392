"""The environment doctor (the same as ``python -m recipes.env``); see ``recipes/env.py``.

python scripts/env_check.py                  # report and advice
python scripts/env_check.py --json           # the same, machine-readable
python scripts/env_check.py --write-accelerate-config conf/accelerate/local.yaml [--force]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# As in recipes/env.py: keep ``import torch`` from loading (and dying on) a broken torch_musa.
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
# Run from a checkout without `pip install -e .`: put the repository root on the import path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from recipes.env import main

if __name__ == "__main__":
    sys.exit(main())
