"""Integrations with the Hugging Face stack.

- ``zeroio.integrations.transformers``: ``ZeroIOTrainer``, a ``transformers.Trainer``
  that trains through a zeroio engine (``zeroio_config=`` beside ``args=``).
- ``zeroio.integrations.accelerate``: ``initialize_from_accelerator`` for scripts
  run under ``accelerate launch``.
- ``zeroio.integrations.autofill``: how "auto" keys are filled from
  TrainingArguments-style values and how explicit contradictions are found.

Submodules import transformers / accelerate only when used.
"""
