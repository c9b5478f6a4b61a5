"""`python -m trainctl.runtime RUN_DIR` (see trainctl.runtime.entry)."""

import os
import sys

from trainctl.runtime.train import faults

if __name__ == "__main__":
    if len(sys.argv) == 2:  # the crash fault's clock runs through start-up too (before torch's import)
        faults.arm_crashes(sys.argv[1], int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")))
    from trainctl.runtime.entry import main

    main()
