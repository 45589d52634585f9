"""Third-party serving engines eaglewire installs, starts and measures (llama.cpp)."""
