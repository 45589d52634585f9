"""Speculative decoding: small pure tensor functions and the engine that drives them."""
