"""qcore's version, in the base room so that any module (the command line's `--version`) can
read it without importing the `qcore` facade. pyproject.toml's `version` is the same text."""

__version__ = "0.1.0"
