"""The base layer: the hidden-state contract, configs, atomic files and locks, user errors, presets, the machine."""
