"""What a draft's acceptance is worth in an engine: the library the commands share (tune, doctor, bench).

trace (the draft along an engine's own text) -> simulate (rounds of any chain shape; replay: a
greedy chain's rounds from the unroll) -> costs (an engine's measured or stated round costs;
engine_timing times them) -> recommend (predicted tokens/s, ranked) -> speed (all of it for one engine and draft). At a load of many
requests, ``eaglewire.concurrency`` builds on these.
"""
