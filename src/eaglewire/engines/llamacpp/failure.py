"""The one error of the llama.cpp package (its own file, so the installer, the server and the
smoke run share it without importing each other), and a llama-server's exit in words."""

import signal


class LlamaCppError(RuntimeError):
    """llama.cpp is missing, failed to build, or a llama-server did not start or answer."""


def exit_cause(returncode: int | None) -> str:
    """A process's return code in words: a negative one is the signal that killed it."""
    if returncode is None:
        return "still running"
    if returncode >= 0:
        return f"exit status {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"
    if name == "SIGILL":
        return (f"{name} (an instruction this CPU or kernel refuses: a build for another CPU, or ggml's AMX "
                "kernels, which trap in worker threads, llama.cpp PR #26954)")
    return name
