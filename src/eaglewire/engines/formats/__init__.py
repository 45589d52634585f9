"""Draft formats that are not one engine's: the EAGLE-3 layout every engine's format shares, the speculators, z-lab
and DFlash layouts, SpecForge's and the EAGLE reference code's checkpoints (import-only engines), importing a
foreign draft directory, and what an engine release's target model file does with a config's layer ids."""
