"""Supervised fine-tuning with TRL's SFTTrainer, in the style of trl/scripts/sft.py.

Runs under DeepSpeed with ``--deepspeed ds.json`` (the SFTConfig field) or plain DDP.
"""

from dataclasses import dataclass, field

import torch
from datasets import load_dataset
from transformers import AutoTokenizer, HfArgumentParser
from trl import SFTConfig, SFTTrainer


@dataclass
class ScriptArguments:
    model_name_or_path: str = field(metadata={"help": "a local model folder"})
    train_file: str = field(metadata={"help": "a text file, one example per line"})


def main():
    parser = HfArgumentParser((ScriptArguments, SFTConfig))
    script_args, training_args = parser.parse_args_into_dataclasses()
    dataset = load_dataset("text", data_files={"train": script_args.train_file})
    tokenizer = AutoTokenizer.from_pretrained(script_args.model_name_or_path)
    trainer = SFTTrainer(
        model=script_args.model_name_or_path,
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
