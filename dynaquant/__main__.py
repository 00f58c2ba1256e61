"""``python -m dynaquant ...``: the same as the ``dynaquant`` command (``torchrun -m dynaquant`` too)."""

from dynaquant.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
