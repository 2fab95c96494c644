"""`python -m kvfit ...`: the same command line as `kvfit ...`."""

from kvfit.cli import run_main

if __name__ == "__main__":
    run_main()
