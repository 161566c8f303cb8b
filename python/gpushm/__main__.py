"""python -m gpushm ARGS runs the gpushm binary installed with the package."""

import os
import sys

from ._binary import binary


def main():
    try:
        path = binary()
    except FileNotFoundError as e:
        print(f"gpushm: {e}", file=sys.stderr)
        sys.exit(1)
    os.execv(path, [path] + sys.argv[1:])


if __name__ == "__main__":
    main()
