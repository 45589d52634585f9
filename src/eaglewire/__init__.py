"""eaglewire: train, prove and serve EAGLE-3 drafts through one hidden-state contract."""

__version__ = "0.1.0"
