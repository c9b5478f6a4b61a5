"""`python -m trainctl.runtime RUN_DIR` (see trainctl.runtime.entry)."""

from trainctl.runtime.entry import main

if __name__ == "__main__":
    main()
