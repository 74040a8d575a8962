"""`python -m tracediff` is the `tracediff` command."""

from tracediff.cli import run

if __name__ == "__main__":
    run()
