"""``make bench``: every benchmark in this folder, one after the other, each printing its measured ratio."""

import subprocess
import sys
from pathlib import Path

BENCHES = ["overhead.py", "integrity_overhead.py", "driver_overhead.py", "suite_targets.py"]

if __name__ == "__main__":
    folder = Path(__file__).parent
    failed = 0
    for name in BENCHES:
        print(f"== {name}", flush=True)
        failed |= subprocess.call([sys.executable, str(folder / name)])
    sys.exit(failed)
