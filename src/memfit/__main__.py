from memfit import lifeline

lifeline.stop_with_launcher()  # under torchrun: first, before the seconds of importing torch (memfit/lifeline.py)

from memfit.cli import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
