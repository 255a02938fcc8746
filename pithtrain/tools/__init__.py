"""PithTrain tools package."""
