"""PithTrain parallel package."""
