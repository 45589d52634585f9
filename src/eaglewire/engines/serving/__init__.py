"""What a running server reports and reads at launch, whatever the engine: the draft it computes with
(``served_draft``), what it says it accepted (``served_counts``, ``spec_decode_metrics``), the temperature its
users sample at (``sampling_defaults``) and its launch flags (``launch_flags``)."""
