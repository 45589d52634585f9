"""``doctor --engine-url``: the τ a running server achieves against the draft's replay on the server's own text
(``served_check``, ``served_replay``), and when it falls short, which wiring it feeds the draft (``wiring_fit``,
``probes``, ``diagnosis``) and the fix, proven (``fix_proof``)."""
