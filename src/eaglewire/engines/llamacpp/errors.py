"""The one error of the llama.cpp package (its own file, so the installer, the server and the
smoke run share it without importing each other)."""


class LlamaCppError(RuntimeError):
    """llama.cpp is missing, failed to build, or a llama-server did not start or answer."""
