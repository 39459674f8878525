"""The parts of `zeroio train`: model presets, byte-level data, the default config and the loop."""
