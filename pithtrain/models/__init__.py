"""PithTrain models package."""
