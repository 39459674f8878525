"""Integrations with the Hugging Face stack.

- ``zeroio.integrations.transformers``: the drop-in ``Trainer`` and ``TrainingArguments``
  (``deepspeed=`` is the zeroio config); ``ZeroIOTrainer`` is the same ``Trainer``.
- ``zeroio.integrations.hf_args``: ``TrainingArguments`` and the stage-3 ``from_pretrained`` scope.
- ``zeroio.integrations.hf_config``: the run's config from the JSON and TrainingArguments
  (``optim`` / ``lr_scheduler_type`` honoured or refused).
- ``zeroio.integrations.accelerate``: ``initialize_from_accelerator`` and the check that
  ``accelerate launch`` started as many processes as it was asked for.
- ``zeroio.integrations.autofill``: how "auto" keys are filled from
  TrainingArguments-style values and how explicit contradictions are found.

Scripts that keep transformers' own classes run on zeroio through the ``deepspeed``
facade instead (``zeroio.deepspeed``; importing ``zeroio.integrations.transformers``
activates it). Submodules import transformers / accelerate only when used.
"""
