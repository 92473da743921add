"""The main job's memory soak, as `python benchmarks/run_soak.py --kernels torch jax --steps 2500 --every 10`.

The same as `python -m benchmarks soak ...`; the code is in benchmarks/soak.py.
"""

import os
import sys

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout, not benchmarks/
from benchmarks.soak import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
