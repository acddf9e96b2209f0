"""Offline tools behind `specstream` subcommands."""
