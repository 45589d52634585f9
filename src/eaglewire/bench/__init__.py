"""`eaglewire bench`: the runner and its report."""
