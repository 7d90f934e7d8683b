"""The device-work census (benchmarks/device_work_census.py) inside the processes of a launch: with this folder on
PYTHONPATH and RANK_CENSUS=PREFIX set, every Python process records the runtime call sites it reaches on the
simulated device and writes them, one per line, to PREFIX-<pid>.txt at exit. The expert-parallel re-run
(tests/test_simulated_device.py) was chosen from these files:

    HF_MOE_OFFLOAD_RUNTIME=simulated RANK_CENSUS=/tmp/census/pp2 PYTHONPATH=benchmarks/rank_census:. \
        ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 ... tests/scripts/dist_equivalence.py \
        OUT --work-dir DIR --modes ...

(docs/development.md has the whole command.)
"""

import atexit
import os
import sys

if os.environ.get("RANK_CENSUS"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import device_work_census as _census

    _census.pytest_configure(None)  # wraps the simulated runtime's operations; the config is not used

    def _write() -> None:
        with open(f"{os.environ['RANK_CENSUS']}-{os.getpid()}.txt", "w", encoding="utf-8") as f:
            f.write("\n".join(sorted(_census._sites)))

    atexit.register(_write)
