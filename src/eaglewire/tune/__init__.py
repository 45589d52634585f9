"""`eaglewire tune`: which speculation shape pays in a given engine, or plain decoding and why.

trace (the draft along an engine's own text) -> simulate (rounds of any chain shape) ->
costs (an engine's measured or stated round costs) -> recommend (predicted tokens/s, ranked).
"""
