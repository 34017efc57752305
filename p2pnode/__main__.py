"""The `p2pnode` command (and `python -m p2pnode`): the CLI's import is covered too, so that
Ctrl-C in the first few tenths of a second exits 130 with one line, as it does later."""
import os
import sys


def main() -> None:
    try:
        from p2pnode.cli.main import run
    except KeyboardInterrupt:
        sys.stderr.write("p2pnode: interrupted\n")
        sys.stderr.flush()
        os._exit(130)  # errors.EXIT_INTERRUPTED: an import is what Ctrl-C stopped
    run()


if __name__ == "__main__":
    main()
