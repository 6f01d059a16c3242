"""`python -m switchhead ...`: the same command-line tool as `switchhead ...`."""

from switchhead.cli import main

if __name__ == "__main__":
    main(prog_name="switchhead")
