"""The model layer: targets, the draft, capture, TTT, vocabularies, checkpoints."""
