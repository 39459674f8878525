"""Preference optimisation with TRL's DPOTrainer, in the style of trl/scripts/dpo.py.

Runs under DeepSpeed with ``--deepspeed ds.json`` (the DPOConfig field) or plain DDP;
the reference model is built by the trainer from the same folder.
"""

from dataclasses import dataclass, field

import torch
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser
from trl import DPOConfig, DPOTrainer


@dataclass
class ScriptArguments:
    model_name_or_path: str = field(metadata={"help": "a local model folder"})
    train_file: str = field(metadata={"help": "a JSON-lines file of prompt/chosen/rejected"})


def main():
    parser = HfArgumentParser((ScriptArguments, DPOConfig))
    script_args, training_args = parser.parse_args_into_dataclasses()
    dataset = load_dataset("json", data_files={"train": script_args.train_file})
    tokenizer = AutoTokenizer.from_pretrained(script_args.model_name_or_path)
    model = AutoModelForCausalLM.from_pretrained(script_args.model_name_or_path)
    trainer = DPOTrainer(
        model=model,
        args=training_args,
        train_dataset=dataset["train"],
        processing_class=tokenizer,
    )
    trainer.train()
    trainer.save_model(training_args.output_dir)
    trainer.save_state()
    if torch.distributed.is_initialized():
        # every rank past its last collective before the group goes (a gloo group torn down
        # while a gather's work is still being released can deadlock at exit)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
