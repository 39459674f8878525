"""The ``zeroio`` command: train, launch, bench, tune, estimate, consolidate, inspect."""
