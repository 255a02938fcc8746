"""Allows `python -m pithtrain ...`."""

from pithtrain.cli import main

main()
