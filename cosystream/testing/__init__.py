"""Test helpers that ship with the package (random model directories)."""
