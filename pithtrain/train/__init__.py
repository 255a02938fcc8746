"""PithTrain train package."""
