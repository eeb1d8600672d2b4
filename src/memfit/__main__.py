"""``python -m memfit`` and the ``memfit`` command: the front page (``--help``, ``--version``) without importing
torch (:mod:`memfit.verbs`), every verb through :func:`memfit.cli.main`."""

import sys

from memfit import lifeline, verbs

lifeline.stop_with_launcher()  # under torchrun: first, before the seconds of importing torch (memfit/lifeline.py)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``memfit`` command. Returns the process exit status."""
    argv = sys.argv[1:] if argv is None else argv
    verbs.front_page(argv)  # exits after printing it, where asked for
    from memfit.cli import main as run

    return run(argv)


if __name__ == "__main__":
    raise SystemExit(main())
