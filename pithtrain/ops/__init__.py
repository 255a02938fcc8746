"""PithTrain ops package."""
