"""``python -m tasks.profile``: see :mod:`tasks.profile.standalone`."""

from tasks.profile.standalone import main

if __name__ == "__main__":
    raise SystemExit(main())
