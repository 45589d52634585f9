"""`eaglewire serve`: the OpenAI-compatible app and its request models."""
