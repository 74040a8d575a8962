"""`python -m tracediff` is the `tracediff` command."""

from tracediff.cli import main

if __name__ == "__main__":
    main(prog_name="tracediff")
