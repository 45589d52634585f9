"""`eaglewire tune`: which speculation shape pays in a given engine, or plain decoding and why.

The command (``run.py``: ``TuneConfig``, ``run_tune``); the measurement, simulation and ranking
it reports live in ``eaglewire.acceptance``, which the doctor and bench call too.
"""
