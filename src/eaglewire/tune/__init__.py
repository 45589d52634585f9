"""`eaglewire tune`: which speculation shape pays in a given engine, or plain decoding and why.

The command (``tune_command.py``: ``TuneConfig``, ``run_tune``; ``load_schedule.py``: ``--concurrency``); the
measurement, simulation and ranking it reports live in ``eaglewire.acceptance`` and ``eaglewire.concurrency``,
which the doctor and bench call too.
"""
