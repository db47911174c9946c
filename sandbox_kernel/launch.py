"""``python -m sandbox_kernel.launch``: what installed kernelspecs' argv runs (now
:mod:`sandbox_kernel.cli.launch`)."""

import sys

from sandbox_kernel.cli.launch import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
