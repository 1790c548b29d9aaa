"""The `qcore` command."""
