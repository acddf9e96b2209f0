"""Test support shared by the suites."""
